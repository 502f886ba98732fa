"""The pure rules of replication (DESIGN.md §7.3): what heat asks for (kvstore/node/heat.py), where copies, puts and
reads go (kvstore/index/choose.py), the PUT frame's optional replicas byte (kvstore/wire/tcp.py), peer tokens
(kvstore/security.py) and the settings' validation (kvstore/config.py)."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from kvstore.config import NodeConfig
from kvstore.errors import InvalidArgument, Unauthenticated
from kvstore.index.choose import (
    OTHER_HOST,
    SAME_HOST,
    SUSPECT,
    NodeLoad,
    copy_targets,
    from_record,
    pick,
    put_target,
    read_preference,
)
from kvstore.index.lookup import summarize
from kvstore.layout import DType, PageLayout
from kvstore.names import TierKind
from kvstore.node.heat import MAX_HOSTS, HeatTable
from kvstore.replication.service import leader
from kvstore.security import TENANT_HEADER, Role, TokenAuthenticator
from kvstore.wire import PutOpen, tcp

NS, H = "ns", b"\x01" * 32
KEY = (NS, H)
RATE = 1.0  # hot: one read a second, all holders together
MAX = 3


def reads(table: HeatTable, n: int, start: float = 0.0, every: float = 0.1, host: str = "") -> float:
    t = start
    for _ in range(n):
        table.note_read(KEY, host, t)
        t += every
    return t


def test_a_page_read_often_asks_for_two_copies_a_page_read_rarely_for_one() -> None:
    hot, cold = HeatTable(), HeatTable()
    now = reads(hot, 60)  # 10 reads a second for 6 s
    assert hot.wanted(KEY, 1, now, RATE, MAX) == 2
    now = reads(cold, 3, every=5.0)  # a read every 5 s
    assert cold.wanted(KEY, 1, now, RATE, MAX) == 1
    assert HeatTable().wanted(KEY, 1, 0.0, RATE, MAX) == 1  # never read: cold


def test_heat_fades_when_reads_stop() -> None:
    t = HeatTable()
    now = reads(t, 60)
    assert t.wanted(KEY, 1, now, RATE, MAX) == 2
    assert t.wanted(KEY, 1, now + 120.0, RATE, MAX) == 1


def test_holders_share_the_reads_of_a_page() -> None:
    """Each holder sees its share: a rate under the threshold on one of three holders is hot cluster-wide."""
    t = HeatTable()
    now = reads(t, 8, every=1.0)  # about 0.4 reads/s here
    assert t.wanted(KEY, 1, now, RATE, MAX) == 1
    assert t.wanted(KEY, 3, now, RATE, MAX) == 2


def test_readers_on_several_hosts_ask_for_a_copy_each_up_to_the_cap() -> None:
    t = HeatTable()
    for i, host in enumerate(["", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]):
        t.note_read(KEY, host, float(i))
    assert t.wanted(KEY, 1, 5.0, 1000.0, MAX) == MAX  # five hosts, capped at MAX
    assert t.wanted(KEY, 1, 5.0, 1000.0, 10) == 5
    for i in range(3 * MAX_HOSTS):  # hosts remembered per page are bounded
        t.note_read(KEY, f"10.1.0.{i}", 6.0 + i)
    assert len(t.pages[KEY].hosts or {}) <= MAX_HOSTS


def test_a_puts_replicas_ask_whatever_the_heat_until_the_page_leaves() -> None:
    t = HeatTable()
    t.ask(KEY, 4, 0.0)
    assert t.wanted(KEY, 1, 1000.0, RATE, MAX) == 4  # above the heat cap, no reads, long after
    assert [k for k, _ in t.candidates(1000.0, RATE, MAX, 10)] == [KEY]
    t.forget(KEY)
    assert t.wanted(KEY, 1, 1000.0, RATE, MAX) == 1
    t.ask(KEY, 1, 0.0)  # one copy asks nothing: no entry made
    assert KEY not in t.pages


def test_the_table_is_bounded_and_forgets_the_coldest_first() -> None:
    t = HeatTable(capacity=100)
    t.ask(("ns", b"\xff" * 32), 3, 0.0)
    for i in range(500):
        t.note_read(("ns", i.to_bytes(32, "big")), "", float(i))
    assert len(t.pages) <= 100
    assert ("ns", b"\xff" * 32) in t.pages  # a Put's replicas are forgotten last
    assert ("ns", (499).to_bytes(32, "big")) in t.pages and ("ns", (0).to_bytes(32, "big")) not in t.pages


def test_candidates_are_the_hottest_first_and_a_leaving_node_takes_warm_ones() -> None:
    t = HeatTable()
    reads(t, 60)
    warm = ("ns", b"\x02" * 32)
    t.note_read(warm, "", 5.0)
    now = 6.0
    assert [k for k, _ in t.candidates(now, RATE, MAX, 10)] == [KEY]
    assert [k for k, _ in t.candidates(now, RATE, MAX, 10, min_rate=0.02)] == [KEY, warm]


def nodes(*spec: tuple[str, int, float]) -> list[NodeLoad]:
    return [NodeLoad(n, "h-" + n, free, 100, load) for n, free, load in spec]


def test_puts_go_by_room_and_load_never_by_node_id() -> None:
    cands = nodes(("a", 50, 0.0), ("b", 50, 0.0), ("c", 50, 0.0))
    rng = random.Random(0)
    got = Counter(put_target(cands, rng).node_id for _ in range(300))  # type: ignore[union-attr]
    assert set(got) == {"a", "b", "c"} and min(got.values()) > 60  # equals: spread, not "the highest id"
    joined = [*cands, NodeLoad("z", "h-z", 100, 100)]  # a node that joins: empty
    got = Counter(put_target(joined, rng).node_id for _ in range(300))  # type: ignore[union-attr]
    assert got["z"] > 100  # wins every draw it is in (half of them)
    busy = nodes(("a", 50, 0.0), ("b", 50, 100e6))  # as roomy, but serving 100 MB/s
    assert Counter(put_target(busy, rng).node_id for _ in range(100))["a"] == 100  # type: ignore[union-attr]


def test_puts_prefer_this_hosts_node_then_the_parents_holder_skipping_full_and_suspect_ones() -> None:
    cands = nodes(("a", 50, 0.0), ("b", 50, 0.0), ("c", 50, 0.0))
    rng = random.Random(1)
    assert {put_target(cands, rng, local=["b"]).node_id for _ in range(20)} == {"b"}  # type: ignore[union-attr]
    assert {put_target(cands, rng, affinity=["c"]).node_id for _ in range(20)} == {"c"}  # type: ignore[union-attr]
    full = [NodeLoad("b", "h", 0, 100), *nodes(("a", 50, 0.0))]
    assert {put_target(full, rng, local=["b"]).node_id for _ in range(20)} == {"a"}  # type: ignore[union-attr]
    hung = [NodeLoad("b", "h", 50, 100, suspect=True), *nodes(("a", 50, 0.0))]
    assert {put_target(hung, rng, local=["b"]).node_id for _ in range(20)} == {"a"}  # type: ignore[union-attr]
    assert put_target([], rng) is None


def test_copies_go_where_room_is_left_and_holders_deciding_together_pick_alike() -> None:
    cands = nodes(("a", 50, 0.0), ("b", 50, 0.0), ("c", 9, 0.0), ("d", 50, 0.0))

    def draw(cands: list[NodeLoad], count: int, need_slots: int) -> list[str]:
        return copy_targets(b"seed", cands, count=count, need_slots=need_slots, reserve=0.1, mean_load=0.0)

    first = draw(cands, 2, 1)
    assert len(first) == 2 and "c" not in first  # c would be left under the 10% reserve
    assert draw(list(reversed(cands)), 2, 1) == first  # same records, same draw
    assert draw(cands, 5, 1) == first + [n for n in ("a", "b", "d") if n not in first]
    assert draw([NodeLoad("s", "h", 90, 100, suspect=True)], 1, 1) == []
    assert draw(cands, 1, 45) == []  # 45 pages leave nobody 10% free


def test_reads_go_to_this_hosts_holder_then_the_least_loaded_suspects_last() -> None:
    loads = {
        "here": NodeLoad("here", "me", 50, 100),
        "idle": NodeLoad("idle", "other", 50, 100),
        "busy": NodeLoad("busy", "other", 50, 100, 500e6),
        "hung": NodeLoad("hung", "me", 50, 100, suspect=True),
    }
    prefer = read_preference(loads, "me", down=(), rng=random.Random(2))
    assert prefer("here")[0] == SAME_HOST and prefer("idle")[0] == OTHER_HOST and prefer("hung")[0] == SUSPECT
    assert read_preference(loads, "me", down=["here"], rng=random.Random(2))("here")[0] == SUSPECT
    found = summarize([{"idle": TierKind.DRAM, "busy": TierKind.DRAM}] * 4)
    got = Counter(found.plan(read_preference(loads, "elsewhere", (), random.Random(3)))[0][0] for _ in range(1))
    picks = Counter()
    rng = random.Random(4)
    for _ in range(400):
        picks[found.plan(read_preference(loads, "elsewhere", (), rng))[0][0]] += 1
    assert picks["idle"] > 3 * picks["busy"] > 0 and sum(got.values()) == 1  # odds fall with load, never zero
    split = summarize([{"here": TierKind.DRAM, "idle": TierKind.DRAM}] * 2 + [{"idle": TierKind.DRAM}] * 2)
    assert split.plan(read_preference(loads, "me", (), random.Random(5))) == [("here", 0, 2), ("idle", 2, 4)]
    hung_only = summarize([{"hung": TierKind.DRAM}])
    assert hung_only.plan(read_preference(loads, "me", (), random.Random(6))) == [("hung", 0, 1)]  # the only one


def test_records_of_older_nodes_read_as_empty_not_as_errors() -> None:
    n = from_record("x", {"slots_total_dram": "10", "slots_used_dram": "4", "load_bps": "bad", "host_id": "h"})
    assert (n.free_slots, n.total_slots, n.load_bps, n.host) == (6, 10, 0.0, "h")
    assert from_record("y", {}).free_fraction == 0.0
    assert pick([], random.Random(0)) is None


def test_one_holder_leads_each_page_whoever_asks() -> None:
    holders = ["n0", "n1", "n2"]
    assert len({leader(b"page", list(p)) for p in (holders, holders[::-1], holders[1:] + holders[:1])}) == 1
    assert Counter(leader(i.to_bytes(4, "big"), holders) for i in range(300)).most_common()[-1][1] > 60


LAYOUT = PageLayout(DType.FLOAT16, 2, 2, 64, 16)


def test_the_put_frame_carries_replicas_only_when_set() -> None:
    plain = tcp.put(PutOpen(NS, LAYOUT, None, None, True), 3)
    head = tcp.HEADER.unpack(plain[: tcp.HEADER_BYTES])
    meta = plain[tcp.HEADER_BYTES :]
    assert len(meta) == head[3]  # the frame of nodes that predate replicas, byte for byte
    assert tcp.parse_put(meta).replicas == 0
    framed = tcp.put(PutOpen(NS, LAYOUT, None, None, True, replicas=3), 3)[tcp.HEADER_BYTES :]
    assert len(framed) == len(meta) + 1
    assert tcp.put_npages(framed) == 3 and tcp.parse_put(framed).replicas == 3
    bad = framed[:-1] + bytes((99,))
    with pytest.raises(InvalidArgument, match=r"put\.replicas"):
        tcp.parse_put(bad)
    with pytest.raises(InvalidArgument, match=r"put\.layout"):  # only a bundle has a part table
        tcp.parse_put(framed + b"\x00")


def test_a_bundles_put_frame_carries_its_part_table_and_replicas() -> None:
    part = PageLayout(DType.FLOAT16, 2, 2, 64, 16)
    bundle = PageLayout.bundle({"kv": part, "swa": PageLayout(DType.FLOAT16, 1, 2, 64, 16)}, 16)
    for replicas in (0, 1, 5):
        meta = tcp.put(PutOpen(NS, bundle, None, None, True, replicas=replicas), 2)[tcp.HEADER_BYTES :]
        got = tcp.parse_put(meta)
        assert got.replicas == replicas and got.layout.part_names == ("kv", "swa")
    nameless = PageLayout.unpack(bundle.pack())  # a bundle's packed fields, its part names left out
    meta = tcp.put(PutOpen(NS, nameless, None, None, True, replicas=2), 2)[tcp.HEADER_BYTES :]
    assert tcp.parse_put(meta).replicas == 2 and not tcp.parse_put(meta).layout.has_parts
    with_table = tcp.put(PutOpen(NS, bundle, None, None, True, replicas=2), 2)[tcp.HEADER_BYTES :]
    with pytest.raises(InvalidArgument, match=r"put\.layout"):  # the table cut short
        tcp.parse_put(with_table[:-4])
    with pytest.raises(InvalidArgument, match=r"put\.layout"):  # more than a replicas byte after the table
        tcp.parse_put(with_table + b"\x01")


def test_a_peer_token_acts_for_the_tenant_it_names_a_client_token_never(tmp_path: Path) -> None:
    def file(name: str, text: str) -> str:
        p = tmp_path / name
        p.write_text(text)
        p.chmod(0o600)
        return str(p)

    auth = TokenAuthenticator(file("w", "client-token-" + "x" * 10 + " tenant-b\n"), None,
                              file("p", "peer-token-" + "y" * 10 + "\n"))  # fmt: skip
    peer = auth.identify([("authorization", "Bearer peer-token-" + "y" * 10), (TENANT_HEADER, "tenant-a")])
    assert (peer.role, peer.tenant) == (Role.PEER, "tenant-a")
    assert auth.identify([("authorization", "Bearer peer-token-" + "y" * 10)]).tenant is None  # the default one
    client = auth.identify([("authorization", "Bearer client-token-" + "x" * 10), (TENANT_HEADER, "tenant-a")])
    assert (client.role, client.tenant) == (Role.WRITE, "tenant-b")
    with pytest.raises(Unauthenticated, match=TENANT_HEADER):
        auth.identify([("authorization", "Bearer peer-token-" + "y" * 10), (TENANT_HEADER, "no*glob")])
    with pytest.raises(ValueError, match="names none"):
        TokenAuthenticator(None, None, file("p2", "peer-token-" + "z" * 10 + " tenant-a\n"))


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("replication_max_copies", 0, "replication_max_copies"),
        ("replication_max_copies", 17, "replication_max_copies"),
        ("replication_hot_reads_per_second", 0.0, "replication_hot_reads_per_second"),
        ("replication_hot_reads_per_second", float("nan"), "replication_hot_reads_per_second"),
        ("replication_free_reserve", 1.0, "replication_free_reserve"),
        ("replication_interval_seconds", 0.0, "replication_interval_seconds"),
        ("handoff_seconds", -1.0, "handoff_seconds"),
        ("auth_peer_tokens_file", "/no/such/file", "auth_peer_tokens_file"),
    ],
)
def test_bad_replication_settings_are_refused_naming_the_field(field: str, value: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        NodeConfig(**{field: value})  # type: ignore[arg-type]
