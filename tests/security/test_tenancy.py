"""Tenancy enforced by the server (DESIGN.md §10), against real nodes on every plane:
two tenants' equal namespaces and hashes never meet; a cross-tenant Lookup/Get is the cold miss a fresh
tenant gets, and is counted; one tenant cannot plant pages another reads (cache poisoning); a restarted
node keeps every page in its tenant's scope; shares hold under pressure, each tenant evicting its own
pages; mTLS subjects bind tenants; bad tenancy files refuse the start, naming the file."""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from rich.console import Console

from kvstore.cli.launch import NodeProcess
from kvstore.cli.stats import render_stats
from kvstore.client import KVStoreClient
from kvstore.errors import InvalidArgument, KVStoreError, NamespaceNotFound, PermissionDenied
from kvstore.names import TierKind
from kvstore.scoping import SEP
from kvstore.security import ClientSecurity
from kvstore.wire.ucx import ucxx_installed
from tests.integration.conftest import LAYOUT, NS, SLOT, key, page, start_node
from tests.security.conftest import private_file

TOK_A = "tenant-a-" + "a" * 24
TOK_B = "tenant-b-" + "b" * 24
TOK_C = "tenant-c-" + "c" * 24  # a tenant that never stores anything: what a cold cache answers
TOK_D = "default--" + "d" * 24  # no tenant on its line: the default tenant
READ_A = "read-a---" + "r" * 24
PLANES = ["grpc", "shm", "tcp", *(["ucx"] if ucxx_installed() else [])]


def tenant_args(tmp_path: Path, tenants_toml: str | None = None) -> list[str]:
    w = private_file(tmp_path / "rw.tokens", f"# token tenant\n{TOK_A} tenant-a\n{TOK_B} tenant-b\n"
                                             f"{TOK_C} tenant-c\n{TOK_D}\n")  # fmt: skip
    r = private_file(tmp_path / "ro.tokens", f"{READ_A} tenant-a\n")
    args = ["--auth-tokens-file", str(w), "--auth-read-tokens-file", str(r)]
    if tenants_toml is not None:
        args += ["--tenants-file", str(private_file(tmp_path / "tenants.toml", tenants_toml))]
    return args


def other_page(h: bytes) -> bytes:
    return random.Random(b"poison" + h).randbytes(LAYOUT.page_bytes)


class Clients:
    def __init__(self, node: NodeProcess, transport: str = "auto", **kw: object) -> None:
        self.stack = ExitStack()
        self.node, self.transport, self.kw = node, transport, kw

    def __call__(self, token: str) -> KVStoreClient:
        return self.stack.enter_context(KVStoreClient(self.node.addr, timeout=30, transport=self.transport,
                                                      security=ClientSecurity(token=token), **self.kw))  # type: ignore[arg-type]  # fmt: skip


@pytest.fixture
def clients() -> Iterator[list[Clients]]:
    made: list[Clients] = []
    yield made
    for c in made:
        c.stack.close()


def miss(fn: object) -> tuple[str, str]:
    """What a call answers: its value, or its error's class and message."""
    try:
        return ("ok", repr(fn()))  # type: ignore[operator]
    except KVStoreError as exc:
        return (type(exc).__name__, str(exc))


@pytest.mark.parametrize("plane", PLANES)
def test_tenants_share_nothing_and_cannot_poison_each_other(tmp_path: Path, plane: str,
                                                            clients: list[Clients]) -> None:  # fmt: skip
    node = start_node(tmp_path, name="ten", extra_args=[*tenant_args(tmp_path), *(["--ucx"] if plane == "ucx" else [])])
    try:
        cs = Clients(node, plane)
        clients.append(cs)
        a, b, c, d, ra = cs(TOK_A), cs(TOK_B), cs(TOK_C), cs(TOK_D), cs(READ_A)
        chain = [key(i, "tenancy") for i in range(4)]
        cold = (miss(lambda: c.lookup_detail(NS, chain)), miss(lambda: c.get(NS, chain)))  # nothing stored yet
        assert cold[0][0] == "ok" and cold[1][0] == NamespaceNotFound.__name__
        assert a.put(NS, LAYOUT, chain, [page(h) for h in chain]).stored == 4
        # Another tenant (and the default one) sees exactly what a cold cache answered.
        for other in (b, c, d):
            assert (miss(lambda o=other: o.lookup_detail(NS, chain)), miss(lambda o=other: o.get(NS, chain))) == cold
        assert [bytes(p) for p in ra.get(NS, chain)] == [page(h) for h in chain]  # a's read-only token: a's pages
        # Poisoning: b writes other bytes under the same namespace and hashes. Nothing is "already
        # present" for b, and each tenant reads back its own bytes.
        res = b.put(NS, LAYOUT, chain, [other_page(h) for h in chain])
        assert (res.stored, res.already_present) == (4, 0)
        assert [bytes(p) for p in a.get(NS, chain)] == [page(h) for h in chain]
        assert [bytes(p) for p in b.get(NS, chain)] == [other_page(h) for h in chain]
        assert miss(lambda: d.get(NS, chain))[0] == NamespaceNotFound.__name__
        # No client namespace can name another tenant's scope.
        with pytest.raises(InvalidArgument, match="namespace"):
            d.get(f"{SEP}tenant-a{SEP}{NS}", chain)
        # Counted for the operator: the others' misses on pages a held (c's two misses before a's put were
        # cold ones; the default tenant's own are not counted, tests/security/test_tenant_oracle.py).
        rows = {t.tenant: t for t in d.stats().tenants}  # the default tenant (the operator) sees every row
        assert rows["tenant-b"].cross_tenant_misses == 2 and rows["tenant-c"].cross_tenant_misses == 2
        assert rows["default"].cross_tenant_misses == 0 and rows["tenant-a"].cross_tenant_misses == 0
        assert (rows["tenant-c"].lookups, rows["tenant-c"].lookup_blocks, rows["tenant-c"].lookup_matched) == (2, 8, 0)
        assert rows["tenant-a"].get_served == rows["tenant-a"].get_pages == 8  # its read-write and read-only tokens
        assert rows["tenant-a"].pages[TierKind.DRAM] == rows["tenant-b"].pages[TierKind.DRAM] == 4
        sb = b.stats()  # a tenant sees its own row and namespaces only, without the cross-tenant figure
        assert [t.tenant for t in sb.tenants] == ["tenant-b"] and [ns for ns, _, _ in sb.namespaces] == [NS]
        assert sb.tenants[0].cross_tenant_misses == 0
        assert d.stats().namespaces == []
    finally:
        node.close()


def test_a_restarted_node_keeps_every_page_in_its_tenant(tmp_path: Path, clients: list[Clients]) -> None:
    args = tenant_args(tmp_path)
    chain = [key(i, "restart") for i in range(6)]
    node = start_node(tmp_path, name="rs", extra_args=args)
    try:
        cs = Clients(node)
        clients.append(cs)
        cs(TOK_A).put(NS, LAYOUT, chain, [page(h) for h in chain])
        cs(TOK_B).put(NS, LAYOUT, chain[:3], [other_page(h) for h in chain[:3]])
        cs.stack.close()
    finally:
        assert node.stop() == 0  # SIGTERM: DRAM pages spill to NVMe
    node = start_node(tmp_path, name="rs", extra_args=args)  # same NVMe directory
    try:
        cs = Clients(node)
        clients.append(cs)
        a, b, d = cs(TOK_A), cs(TOK_B), cs(TOK_D)
        assert [bytes(p) for p in a.get(NS, chain)] == [page(h) for h in chain]
        assert [bytes(p) for p in b.get(NS, chain)] == [other_page(h) for h in chain[:3]]
        assert d.lookup(NS, chain) == 0 and d.stats().namespaces == []
        rows = {t.tenant: t for t in d.stats().tenants}
        assert sum(rows["tenant-a"].pages.values()) == 6 and sum(rows["tenant-b"].pages.values()) == 3
    finally:
        node.close()


def test_shares_hold_under_pressure_and_a_tenant_evicts_its_own_pages(tmp_path: Path,
                                                                      clients: list[Clients]) -> None:  # fmt: skip
    shares = (f"[tenants.tenant-a]\ndram_bytes = {2 * SLOT}\nnvme_bytes = {4 * SLOT}\n"
              f"[tenants.tenant-b]\ndram_bytes = {4 * SLOT}\nnvme_bytes = {8 * SLOT}\n")  # fmt: skip
    node = start_node(tmp_path, name="q", dram_pages=8, nvme_pages=16,
                      extra_args=[*tenant_args(tmp_path, shares), "--metrics-port", "0"])  # fmt: skip
    try:
        cs = Clients(node)
        clients.append(cs)
        a, b, d = cs(TOK_A), cs(TOK_B), cs(TOK_D)
        b_chain = [key(i, "b-share") for i in range(10)]  # within b's share: 4 in DRAM, 6 on NVMe
        assert b.put(NS, LAYOUT, b_chain, [page(h) for h in b_chain]).stored == 10
        for round_ in range(3):  # a floods: far over its share of both tiers
            a_chain = [key(i, f"a-flood-{round_}") for i in range(12)]
            a.put(NS, LAYOUT, a_chain, [page(h) for h in a_chain])
        rows = {t.tenant: t for t in d.stats().tenants}
        assert rows["tenant-a"].pages[TierKind.DRAM] <= 2 and rows["tenant-a"].pages[TierKind.NVME] <= 4
        assert rows["tenant-a"].quota_bytes == {TierKind.DRAM: 2 * SLOT, TierKind.NVME: 4 * SLOT}
        assert sum(rows["tenant-b"].pages.values()) == 10  # not one of b's pages went
        assert [bytes(p) for p in b.get(NS, b_chain)] == [page(h) for h in b_chain]
        # The last pages a wrote are the ones it kept (its own oldest went first).
        assert a.lookup(NS, a_chain[-2:]) >= 1
        # Per-tenant figures reach /metrics and `kvctl stats` (its renderer, over the same Stats).
        with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'kvstore_tenant_pages{node="q",tenant="tenant-b",tier="dram"}' in text
        assert 'kvstore_tenant_share_bytes{node="q",tenant="tenant-a",tier="dram"} ' + f"{2 * SLOT}" in text
        assert 'kvstore_tenant_lookup_blocks_total{node="q",tenant="tenant-a"} 2.0' in text
        console = Console(record=True, width=200)
        render_stats(d.stats(), console)
        table = console.export_text()
        assert "cross-tenant misses" in table and "tenant-a" in table and "tenant-b" in table
    finally:
        node.close()


def test_mtls_subjects_bind_a_tenant_and_never_widen_a_token(tmp_path: Path, clients: list[Clients]) -> None:
    from devkit.pki import make_dev_pki

    pki = make_dev_pki(tmp_path / "pki")
    tls = ["--tls-cert", str(pki.node_cert), "--tls-key", str(pki.node_key), "--tls-client-ca", str(pki.ca)]
    args = [*tenant_args(tmp_path, '[tenants.tenant-m]\nmtls_subjects = ["kvstore client"]\n'), *tls]
    node = start_node(tmp_path, name="mt", extra_args=args)
    try:
        chain = [key(i, "mtls") for i in range(3)]
        for plane in ("grpc", "tcp"):

            def client(token: str, plane: str = plane) -> KVStoreClient:
                sec = ClientSecurity(token=token, ca_file=str(pki.ca), cert_file=str(pki.client_cert),
                                     key_file=str(pki.client_key), server_name="localhost")  # fmt: skip
                return KVStoreClient(f"127.0.0.1:{node.port}", timeout=30, transport=plane, security=sec)

            with client(TOK_D) as m, client(TOK_A) as a:
                # The default token over this certificate is tenant-m.
                m.put(NS, LAYOUT, chain, [page(h) for h in chain])
                assert [bytes(p) for p in m.get(NS, chain)] == [page(h) for h in chain]
                st = m.stats()
                assert [t.tenant for t in st.tenants] == ["tenant-m"] and [n for n, _, _ in st.namespaces] == [NS]
                # A token bound to another tenant does not combine with it.
                with pytest.raises(PermissionDenied, match="tenant"):
                    a.get(NS, chain)
    finally:
        node.close()


@pytest.mark.parametrize(("where", "text", "says"), [
    ("token", f"{TOK_A} tenant/a\n", "rw.tokens:1: tenant"),
    ("token", f"{TOK_A} tenant-a extra\n", "rw.tokens:1: a line is a token"),
    ("tenants", "[tenants.x]\ndram_bytes = 1\n", "smaller than one slot"),
    ("tenants", "[tenants.x]\ndram = 1\n", "unknown keys ['dram']"),
    ("tenants", '[tenants.x]\nmtls_subjects = ["s"]\n[tenants.y]\nmtls_subjects = ["s"]\n', "bound to tenant 'x'"),
    ("tenants", "[tenants.x\n", "tenants.toml"),
])  # fmt: skip
def test_bad_tenancy_files_refuse_the_start_naming_the_file(tmp_path: Path, where: str, text: str, says: str) -> None:
    if where == "token":
        args = ["--auth-tokens-file", str(private_file(tmp_path / "rw.tokens", text))]
    else:
        args = ["--tenants-file", str(private_file(tmp_path / "tenants.toml", text))]
    with pytest.raises(RuntimeError) as err:
        start_node(tmp_path, name="bad", extra_args=args)
    assert says in " ".join(str(err.value).split())  # the CLI wraps its message


def test_index_entries_are_per_tenant_and_redis_acls_keep_tenants_apart(tmp_path: Path, clients: list[Clients]) -> None:
    import redis

    from kvstore.cli.redis_procs import RedisProcess
    from kvstore.client.cluster import ClusterClient
    from kvstore.index import acl
    from kvstore.index.keys import PREFIX, entry_of
    from kvstore.index.reader import IndexReader
    from kvstore.scoping import scope
    from tests.security.conftest import wait_for

    users = {acl.CLIENT_USER: ("c" * 24, acl.CLIENT_RULES), acl.node_user("n0"): ("n" * 24, acl.node_rules("n0")),
             **{acl.tenant_client_user(t): (t[-1] * 24, acl.tenant_client_rules(t)) for t in ("tenant-a", "tenant-b")}}  # fmt: skip
    r = RedisProcess(password="admin-" + "a" * 20, users=users).start()
    node = None
    try:
        node = start_node(tmp_path, name="n0", redis_url=r.url_for(acl.node_user("n0")),
                          extra_args=[*tenant_args(tmp_path), "--index-ttl", "30"])  # fmt: skip
        cs = Clients(node)
        clients.append(cs)
        chain = [key(i, "index") for i in range(4)]
        cs(TOK_A).put(NS, LAYOUT, chain, [page(h) for h in chain])
        cs(TOK_B).put(NS, LAYOUT, chain[:2], [other_page(h) for h in chain[:2]])
        admin = redis.Redis.from_url(r.url, socket_timeout=5)
        wait_for(lambda: all(admin.hexists(*entry_of(scope(NS, t), h)) for t, n in (("tenant-a", 4), ("tenant-b", 2))
                             for h in chain[:n]), what="index entries")  # fmt: skip
        assert admin.keys(f"{PREFIX}t:tenant-a:b:*") and not admin.keys(f"{PREFIX}b:*")  # none in the default scope

        def cluster(user: str, tenant: str | None, token: str) -> ClusterClient:
            sec = ClientSecurity(token=token, allow_plaintext_token=True)  # loopback only
            return ClusterClient(r.url_for(user), timeout=10, security=sec, tenant=tenant)

        with cluster(acl.tenant_client_user("tenant-a"), "tenant-a", TOK_A) as ca, \
                cluster(acl.tenant_client_user("tenant-b"), "tenant-b", TOK_B) as cb, \
                cluster(acl.CLIENT_USER, None, TOK_D) as cd:  # fmt: skip
            assert ca.lookup(NS, chain).matched == 4 and cb.lookup(NS, chain).matched == 2
            assert cd.lookup(NS, chain).matched == 0  # the default tenant's entries: none
            assert [bytes(p.data) for p in ca.get_pages(NS, chain)] == [page(h) for h in chain]
            assert [bytes(p.data) for p in cb.get_pages(NS, chain)] == [other_page(h) for h in chain[:2]]
        # Redis itself keeps each tenant's client to its own entries (and the default client to the default's).
        for user in (acl.tenant_client_user("tenant-b"), acl.CLIENT_USER):
            with redis.Redis.from_url(r.url_for(user), socket_timeout=5) as spy, \
                    pytest.raises(redis.exceptions.NoPermissionError):  # fmt: skip
                spy.hmget(*entry_of(scope(NS, "tenant-a"), chain[0]))
        # ... a lookup too: b's index user asking for a's entries is refused by Redis, which the
        # reader answers as the miss it is for that user (SECURITY.md, round 3, finding 7f), as does a cluster client.
        with IndexReader(r.url_for(acl.tenant_client_user("tenant-b")), tenant="tenant-a") as spy_index:
            assert spy_index.lookup(NS, chain).matched == 0
        with cluster(acl.tenant_client_user("tenant-b"), "tenant-a", TOK_A) as wrong_url:
            assert wrong_url.lookup(NS, chain).matched == 0 and wrong_url.get_pages(NS, chain) == []
        admin.close()
    finally:
        if node is not None:
            node.close()
        r.close()
