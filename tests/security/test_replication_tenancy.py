"""Copies keep tenancy (DESIGN.md §7.3, §10), on two real nodes with tokens, tenants and a peer token:

- a tenant's Put with replicas=2 is copied node to node into the same tenant's scope on the other node: that
  tenant reads it there, another tenant and the default one get the cold miss they would get anywhere;
- a copy counts against the tenant's share on the destination: past it the copy is refused, nothing is evicted;
- only a peer (a node's token) may act for a tenant: a client naming another tenant in its metadata stays in its
  own scope, and a tenant asking for copies of pages it does not have copies nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.cli.redis_procs import RedisProcess
from kvstore.client import KVStoreClient
from kvstore.errors import NamespaceNotFound
from kvstore.names import TierKind
from kvstore.security import ClientSecurity
from tests.integration.conftest import LAYOUT, NS, SLOT, key, page
from tests.security.conftest import private_file, wait_for

TOK_A = "tenant-a-" + "a" * 24
TOK_B = "tenant-b-" + "b" * 24
TOK_D = "default--" + "d" * 24
PEER = "peer-----" + "p" * 24
SHARE = 6  # tenant-a's DRAM share on each node, in slots


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[dict[str, NodeProcess]]:
    tokens = private_file(tmp_path / "rw.tokens", f"{TOK_A} tenant-a\n{TOK_B} tenant-b\n{TOK_D}\n")
    peers = private_file(tmp_path / "peer.tokens", f"{PEER}\n")
    tenants = private_file(tmp_path / "tenants.toml", f"[tenants.tenant-a]\ndram_bytes = {SHARE * SLOT}\n")
    args = ["--auth-tokens-file", str(tokens), "--auth-peer-tokens-file", str(peers), "--tenants-file", str(tenants),
            "--index-ttl", "1.5"]  # fmt: skip
    # NOTE: nodes send the peer token to addresses read from the index; on loopback without TLS they may only
    # with the plaintext opt-in (SECURITY.md), as a cluster on a trusted network would.
    env = {"KVSTORE_ALLOW_PLAINTEXT_TOKEN": "1", "KVSTORE_REPLICATION_INTERVAL_SECONDS": "0.2"}
    r = RedisProcess().start()
    out: dict[str, NodeProcess] = {}
    try:
        for n in ("n0", "n1"):
            out[n] = NodeProcess(dram_bytes=64 * SLOT, nvme_path=tmp_path / n, nvme_bytes=64 * SLOT, node_id=n,
                                 max_page_bytes=LAYOUT.page_bytes, redis_url=r.url, extra_args=args, env=env,
                                 log_path=tmp_path / f"{n}.log").start()  # fmt: skip
        yield out
    finally:
        for p in out.values():
            p.close()
        r.close()


def client(node: NodeProcess, token: str, **kw: Any) -> KVStoreClient:
    return KVStoreClient(node.addr, timeout=30, security=ClientSecurity(token=token, **kw))


def test_a_tenants_copies_stay_in_its_scope_and_share(nodes: dict[str, NodeProcess]) -> None:
    chain = [key(i, "tenant-copy") for i in range(4)]
    with client(nodes["n0"], TOK_A) as a0, client(nodes["n1"], TOK_A) as a1, client(nodes["n1"], TOK_B) as b1, \
            client(nodes["n1"], TOK_D) as d1:  # fmt: skip
        assert a0.put(NS, LAYOUT, chain, [page(h) for h in chain], replicas=2).stored == 4
        wait_for(lambda: a1.lookup(NS, chain) == 4, 20, "tenant-a's copy on n1")
        assert [bytes(p) for p in a1.get(NS, chain)] == [page(h) for h in chain]
        for other in (b1, d1):  # another tenant, and the default one: a cold miss, as anywhere
            assert other.lookup(NS, chain) == 0
            with pytest.raises(NamespaceNotFound):
                other.get(NS, chain)
        row = next(t for t in d1.stats().tenants if t.tenant == "tenant-a")
        assert row.pages.get(TierKind.DRAM, 0) == 4  # counted against tenant-a on n1
        rep = d1.stats().replication
        assert rep is not None and rep.copies_in == 4

        more = [key(i, "past-share") for i in range(4)]
        a0.put(NS, LAYOUT, more, [page(h) for h in more])
        res = a1.replicate(NS, more, "n0", layout=LAYOUT)  # tenant-a holds 4 of its 6 DRAM slots on n1
        assert (res.copied, res.refused) == (2, 2)  # the share bounds the copy; nothing of tenant-a was evicted
        assert a1.lookup(NS, chain) == 4

        # tenant-b asking n1 to copy the same pages copies nothing: on n0 its own scope holds none of them
        res = b1.replicate(NS, more, "n0", layout=LAYOUT)
        assert res.copied == 0 and b1.lookup(NS, more) == 0


def test_only_a_peer_may_act_for_a_tenant(nodes: dict[str, NodeProcess]) -> None:
    chain = [key(i, "impostor") for i in range(2)]
    with client(nodes["n0"], TOK_B, acting_for="tenant-a") as b, client(nodes["n0"], TOK_A) as a:
        b.put(NS, LAYOUT, chain, [page(h) for h in chain])  # names tenant-a in its metadata: ignored for a client
        assert a.lookup(NS, chain) == 0  # not in tenant-a's scope
        assert b.lookup(NS, chain) == 2  # in tenant-b's own
    with client(nodes["n0"], PEER, acting_for="tenant-a") as peer, client(nodes["n0"], TOK_A) as a:
        peer.put(NS, LAYOUT, chain, [page(h) for h in chain])  # a node's token acts for the tenant it names
        assert a.lookup(NS, chain) == 2
