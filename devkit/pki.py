"""A throwaway PKI for trying TLS and mutual TLS locally (tests, benchmarks, a laptop).

`make_dev_pki(dir)` writes a CA, a node certificate valid for localhost / 127.0.0.1 (plus any names
given), a client certificate, and a second, unrelated CA (to show what a wrong trust root does), all
PEM, EC P-256, valid for `days`. With `node_ids`, also one certificate per node naming only that node
id (`node_certs[id]`: how a client checks it reached the node the index sent it to), and a "rogue"
certificate for those ids, localhost and 127.0.0.1 signed by the unrelated CA (an impostor's). Never use these in production: the CA key sits next to the certs.
Needs the `cryptography` package (in the dev extra).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class DevPki:
    ca: Path
    node_cert: Path
    node_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing here but the rogue certificate
    node_certs: dict[str, tuple[Path, Path]] = field(default_factory=dict)  # node id -> (cert, key)
    rogue: tuple[Path, Path] | None = None  # (cert, key) signed by other_ca, naming every node id


def make_dev_pki(directory: str | Path, *, hosts: tuple[str, ...] = (), days: int = 7,
                 node_ids: tuple[str, ...] = ()) -> DevPki:  # fmt: skip
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError as exc:  # pragma: no cover - the dev extra has it
        raise RuntimeError("make_dev_pki needs the 'cryptography' package (pip install -e '.[dev]')") from exc

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(cn: str, key: ec.EllipticCurvePrivateKey, issuer: str, issuer_key: ec.EllipticCurvePrivateKey,
             *, ca: bool, san: list[x509.GeneralName] | None = None) -> x509.Certificate:  # fmt: skip
        b = (
            x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name(issuer))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )  # fmt: skip
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def save(stem: str, c: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> tuple[Path, Path]:
        crt, pem = out / f"{stem}.crt", out / f"{stem}.key"
        crt.write_bytes(c.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))  # fmt: skip
            pem.chmod(0o600)
        return crt, pem

    ca_key, other_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca, _ = save("ca", cert("kvstore dev CA", ca_key, "kvstore dev CA", ca_key, ca=True))
    other, _ = save("other-ca", cert("unrelated CA", other_key, "unrelated CA", other_key, ca=True))
    san: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for h in hosts:
        try:
            san.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            san.append(x509.DNSName(h))
    node_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ncrt, nkey = save("node", cert("kvstore node", node_key, "kvstore dev CA", ca_key, ca=False, san=san), node_key)
    ccrt, ckey = save("client", cert("kvstore client", client_key, "kvstore dev CA", ca_key, ca=False), client_key)
    per_node = {}
    for nid in node_ids:
        k = ec.generate_private_key(ec.SECP256R1())
        per_node[nid] = save(
            f"node-{nid}", cert(nid, k, "kvstore dev CA", ca_key, ca=False, san=[x509.DNSName(nid)]), k
        )
    rogue = None
    if node_ids:
        k = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = [x509.DNSName(n) for n in node_ids] + san[:2]
        rogue = save("rogue", cert("impostor", k, "unrelated CA", other_key, ca=False, san=names), k)
    return DevPki(ca, ncrt, nkey, ccrt, ckey, other, per_node, rogue)
