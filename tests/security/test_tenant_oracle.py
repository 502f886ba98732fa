"""The cross-tenant oracle of SECURITY.md's round 3 (finding 1), replayed against a real node: tenant bob, holding only a
read-only token, guesses whether tenant alice cached a prompt. Before the fix his own Stats row counted
`cross_tenant_misses` exactly when the guess was right (gRPC Lookup and TCP GET alike), `kvctl stats`
printed it to him and the unauthenticated /metrics showed it per tenant. Now everything bob can read
(his Stats, kvctl's rendering of them, /metrics) changes identically for a right and a wrong guess,
and only the operator (the default tenant) sees the count."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from rich.console import Console

from kvstore.cli.launch import NodeProcess
from kvstore.cli.stats import render_stats
from kvstore.client import KVStoreClient
from kvstore.errors import NamespaceNotFound
from kvstore.node.metrics import SNAPSHOT_MAX_AGE_S
from kvstore.security import ClientSecurity
from kvstore.stats import NodeStats, stats_as_dict
from kvstore.wire.ucx import ucxx_installed
from tests.integration.conftest import LAYOUT, NS, key, page, start_node
from tests.security.conftest import private_file

ALICE = "alice-rw-" + "a" * 24
BOB_RO = "bob-ro---" + "b" * 24
BOB_RW = "bob-rw---" + "c" * 24  # bob's writer: gives bob a namespace of his own, as a real tenant has
OPERATOR = "operator-" + "o" * 24  # no tenant on its line: the default tenant, the operator's
PLANES = ["grpc", "tcp", *(["ucx"] if ucxx_installed() else [])]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    d = tmp_path_factory.mktemp("oracle")
    rw = private_file(d / "rw.tokens", f"{ALICE} alice\n{BOB_RW} bob\n{OPERATOR}\n")
    ro = private_file(d / "ro.tokens", f"{BOB_RO} bob\n")
    # The DRAM scrubber off: its byte count moves with the clock, not with bob's guesses, and /metrics shows it.
    args = ["--auth-tokens-file", str(rw), "--auth-read-tokens-file", str(ro), "--metrics-port", "0"]
    args += ["--scrub-bytes-per-second", "0", *(["--ucx"] if ucxx_installed() else [])]
    n = start_node(d, name="oracle", extra_args=args)
    yield n
    n.close()


def client(node: NodeProcess, token: str, transport: str = "grpc") -> KVStoreClient:
    return KVStoreClient(node.addr, timeout=30, transport=transport, security=ClientSecurity(token=token))


def seen_by_bob(bob: KVStoreClient, node: NodeProcess) -> tuple[dict[str, object], str, str]:
    """Everything bob can read about the node: his Stats, kvctl's table of them, and /metrics."""
    stats = bob.stats()
    console = Console(record=True, width=240)
    render_stats(stats, console)
    time.sleep(SNAPSHOT_MAX_AGE_S + 0.05)  # a scrape within that of the last one reuses its snapshot
    with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    return _numbers(stats), console.export_text(), metrics


def _numbers(stats: NodeStats) -> dict[str, object]:
    d = stats_as_dict(stats)
    d.pop("uptime_seconds")
    return d


def _delta(a: object, b: object) -> object:
    """b - a, field by field (numbers), equality elsewhere."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _delta(a.get(k), b.get(k)) for k in sorted(set(a) | set(b))}
    if isinstance(a, list) and isinstance(b, list):
        return [_delta(x, y) for x, y in zip(a, b, strict=True)] if len(a) == len(b) else ("len", len(a), len(b))
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return round(b - a, 6)
    return ("same",) if a == b else (a, b)


def _metric_lines(text: str) -> dict[str, float]:
    """/metrics samples except the RPC latency histogram (its buckets vary with timing, not content)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "kvstore_rpc_duration" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@pytest.mark.parametrize("plane", PLANES)
def test_a_tenant_cannot_tell_whether_another_tenant_cached_its_guess(node: NodeProcess, plane: str) -> None:
    with ExitStack() as stack:
        alice = stack.enter_context(client(node, ALICE))
        bob_w = stack.enter_context(client(node, BOB_RW))
        bob = stack.enter_context(client(node, BOB_RO, plane))
        operator = stack.enter_context(client(node, OPERATOR))
        secret = [key(i, f"alice-prompt-{plane}") for i in range(4)]
        wrong = [key(i, f"never-cached-{plane}") for i in range(4)]
        alice.put(NS, LAYOUT, secret, [page(h) for h in secret])
        mine = [key(0, f"bob-own-{plane}")]
        bob_w.put(NS, LAYOUT, mine, [page(h) for h in mine])  # bob knows the namespace: Get answers, not NOT_FOUND

        def probe(chain: list[bytes]) -> tuple[object, ...]:
            """What bob's guess answers: the Lookup's result and the Get's pages, on his plane."""
            got = bob.get(NS, chain)
            return bob.lookup_detail(NS, chain), len(got)

        probe([key(0, f"warm-up-{plane}")])  # every ratio bob sees is defined from here on
        base = seen_by_bob(bob, node)
        right = probe(secret)
        after_right = seen_by_bob(bob, node)
        wrong_answer = probe(wrong)
        after_wrong = seen_by_bob(bob, node)
        assert right == wrong_answer  # the same answers (a cold miss)...
        # ...and every figure bob can read moved the same way for both guesses.
        assert _delta(base[0], after_right[0]) == _delta(after_right[0], after_wrong[0])
        own = list(after_wrong[0]["tenants"])  # type: ignore[call-overload]
        assert [t["tenant"] for t in own] == ["bob"] and own[0]["cross_tenant_misses"] == 0  # type: ignore[index]
        assert "cross-tenant" not in after_wrong[1]  # kvctl stats prints nothing of it to a tenant
        m0, m1, m2 = (_metric_lines(x[2]) for x in (base, after_right, after_wrong))
        assert {k: m1[k] - m0.get(k, 0) for k in m1} == {k: m2[k] - m1.get(k, 0) for k in m2}
        assert "cross_tenant" not in after_wrong[2]  # /metrics carries no cross-tenant figure at all
        # The operator still sees that bob's guesses hit another tenant's pages: 2 misses (the Get's and
        # the Lookup's) on the right guess, none on the wrong one.
        rows = {t.tenant: t for t in operator.stats().tenants}
        assert rows["bob"].cross_tenant_misses >= 2 and rows["alice"].cross_tenant_misses == 0
        before = rows["bob"].cross_tenant_misses
        probe(wrong)
        assert {t.tenant: t for t in operator.stats().tenants}["bob"].cross_tenant_misses == before
        probe(secret)
        assert {t.tenant: t for t in operator.stats().tenants}["bob"].cross_tenant_misses == before + 2


def test_the_operator_is_no_oracle_for_its_own_guesses(node: NodeProcess) -> None:
    """The default tenant sees every row, but its own misses are not counted: its view says nothing
    about whether its own guess hit another tenant's page either."""
    with client(node, ALICE) as alice, client(node, OPERATOR) as operator:
        secret = [key(i, "alice-op") for i in range(2)]
        alice.put(NS, LAYOUT, secret, [page(h) for h in secret])
        before = {t.tenant: t.cross_tenant_misses for t in operator.stats().tenants}
        assert operator.lookup(NS, secret) == 0
        with pytest.raises(NamespaceNotFound):
            operator.get(NS, secret)
        assert {t.tenant: t.cross_tenant_misses for t in operator.stats().tenants} == before
