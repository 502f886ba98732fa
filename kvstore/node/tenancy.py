"""Binding callers to tenants on the node: the tenants file, and mTLS subjects (DESIGN.md §10).

Where a caller's tenant comes from, in order:
1. its token's line in a token file (`TOKEN TENANT`, kvstore/security.py): rotated like the tokens
   themselves (files re-read within a second, failing closed);
2. otherwise, its mTLS certificate: a subject (the certificate's common name or one of its DNS names)
   listed under a tenant in the tenants file;
3. otherwise the default tenant, which is every caller of a node without tenancy (nothing changes).
A call whose token names one tenant and whose certificate another is refused (PERMISSION_DENIED):
neither credential may widen the other.

The tenants file (`--tenants-file`, TOML) is read once at start; a file that is missing, unreadable,
accessible to others' writes or invalid refuses the start with a message naming the file and the key:

    [tenants.alice]
    dram_bytes = "2GiB"          # share of each tier (optional; absent: no cap in that tier)
    nvme_bytes = "50GiB"
    mtls_subjects = ["alice-engine.clients.example"]
"""

from __future__ import annotations

import dataclasses
import os
import stat
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.config import parse_size
from kvstore.errors import PermissionDenied
from kvstore.names import TierKind
from kvstore.pageformat import slot_bytes_for
from kvstore.scoping import check_tenant
from kvstore.security import Principal, Role

_SHARE_KEYS = {"hbm_bytes": TierKind.HBM, "dram_bytes": TierKind.DRAM, "nvme_bytes": TierKind.NVME}
# gRPC auth-context properties that name the peer's certificate
_CERT_NAME_KEYS = ("x509_common_name", "x509_subject_alternative_name")


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One tenant of the tenants file."""

    name: str
    shares: dict[TierKind, int] = field(default_factory=dict)  # bytes per tier
    mtls_subjects: tuple[str, ...] = ()


def load_tenants_file(path: str | os.PathLike[str]) -> dict[str, TenantSpec]:
    """The tenants of a tenants file; ValueError naming the file and what is wrong."""
    try:
        st = os.stat(path)
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"tenants file {path}: {exc}") from None
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise ValueError(
            f"tenants file {path}: writable by other users (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"it decides who reads which pages: chmod go-w {path}"
        )
    unknown = set(data) - {"tenants"}
    if unknown or not isinstance(data.get("tenants", {}), dict):
        raise ValueError(f"tenants file {path}: only [tenants.NAME] tables are allowed, found {sorted(data)}")
    specs: dict[str, TenantSpec] = {}
    owner: dict[str, str] = {}
    for name, table in data.get("tenants", {}).items():
        where = f"tenants file {path}: [tenants.{name}]"
        check_tenant(name, where)
        if not isinstance(table, dict):
            raise ValueError(f"{where} must be a table")
        bad = set(table) - set(_SHARE_KEYS) - {"mtls_subjects"}
        if bad:
            raise ValueError(f"{where}: unknown keys {sorted(bad)} (allowed: {sorted(_SHARE_KEYS)}, mtls_subjects)")
        shares = {}
        for key, kind in _SHARE_KEYS.items():
            if key in table:
                try:
                    shares[kind] = parse_size(table[key])
                except (ValueError, TypeError) as exc:
                    raise ValueError(f"{where}.{key}: {exc}") from None
        subjects = table.get("mtls_subjects", [])
        if not isinstance(subjects, list) or not all(isinstance(x, str) and x for x in subjects):
            raise ValueError(f"{where}.mtls_subjects must be a list of certificate names")
        for subject in subjects:
            if subject in owner:
                raise ValueError(f"{where}.mtls_subjects: {subject!r} is bound to tenant {owner[subject]!r} already")
            owner[subject] = name
        specs[name] = TenantSpec(name, shares, tuple(subjects))
    return specs


def share_bytes(specs: Mapping[str, TenantSpec]) -> dict[str, dict[TierKind, int]]:
    """Shares in bytes of slots (what placement counts); ValueError for a share smaller than the smallest
    slot (a 4 KiB header and one 4 KiB block), which no page could ever fit."""
    smallest = slot_bytes_for(1)
    out: dict[str, dict[TierKind, int]] = {}
    for spec in specs.values():
        for kind, nbytes in spec.shares.items():
            if nbytes < smallest:
                raise ValueError(
                    f"tenant {spec.name}: its {kind.label} share of {nbytes} B is smaller than one "
                    f"slot ({smallest} B: a 4 KiB header and a page of at least 1 B, rounded to 4 KiB)"
                )
            out.setdefault(spec.name, {})[kind] = nbytes
    return out


class TenantBinder:
    """Completes a caller's Principal with the tenant of its mTLS certificate (module docstring)."""

    def __init__(self, specs: Mapping[str, TenantSpec]) -> None:
        self.by_subject = {s: spec.name for spec in specs.values() for s in spec.mtls_subjects}

    def bind(self, caller: Principal | None, cert_names: Iterable[str]) -> Principal | None:
        """`caller` bound to its certificate's tenant (unchanged when the certificate names none)."""
        tenants = {self.by_subject[n]: n for n in cert_names if n in self.by_subject}
        if not tenants:
            return caller
        if len(tenants) > 1:
            raise PermissionDenied(f"the client certificate names subjects of several tenants {sorted(tenants)}")
        tenant, subject = next(iter(tenants.items()))
        if caller is None:  # a node without tokens: mutual TLS alone identifies the caller
            return Principal(Role.WRITE, f"mtls:{subject}", tenant)
        if caller.tenant is not None and caller.tenant != tenant:
            raise PermissionDenied(
                f"this token belongs to tenant {caller.tenant!r} but the client certificate to tenant {tenant!r}"
            )
        return dataclasses.replace(caller, tenant=tenant)


def grpc_cert_names(auth_context: Mapping[str, Iterable[bytes]]) -> list[str]:
    """Names of the peer certificate in a gRPC auth context (common name, DNS names)."""
    return [v.decode(errors="replace") for k in _CERT_NAME_KEYS for v in auth_context.get(k, ())]
