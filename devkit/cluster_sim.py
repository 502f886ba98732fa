"""A cluster of many nodes under churn, simulated: hit rate and bytes moved with replication by heat, without
it, and with a static two copies of every page (Mooncake's rule). Pure: no I/O, seeded, deterministic.

The model (one host per node, readers on every host; time is requests / `rate`):
- a request is one turn of a conversation: its chain is a shared prefix (`prefix_pages`, one of `prefixes` drawn
  by Zipf(1): system prompts) and the conversation's own pages (`suffix_pages`). A new conversation starts on a
  random host; an old one is read again from its own host, or (`moved`) from another;
- a read walks the chain and stops at the first page no live node holds (the engine can only use a prefix);
  each page is served by a holder on the reader's host if there is one, else by a random holder; what is missing
  is recomputed and put on the reader's host's node (kvstore's local-first placement), each node an LRU cache of
  `capacity` pages. A recomputed page becomes visible `recompute_s` later (its prefill): the requests that
  arrive meanwhile miss it too, which is what makes a lost hot prefix a recompute storm;
- churn: every `churn_every` seconds a node dies (SIGKILL: its pages are gone) and comes back empty: a random one,
  or (`churn="busiest"`) the one that served the most since the last death, the worst case for a hot prefix;
- modes: `none` (one copy: where it was put); `static2` (every put also copies the page to a second node, drawn
  by room: Mooncake's fixed replica count; nothing re-creates a lost copy); `heat` (kvstore's rules, the same code
  the nodes run: kvstore/node/heat.py decides how many copies a page asks for, kvstore/index/choose.py where they
  go, a holder leads per page; plus the cluster client's locality rule: a page a host reads remotely a second
  time is copied to that host's node). Copies go only into room (a destination keeps `reserve` free).

Figures (`SimResult`): hit rate over every page read, hit rate of the shared prefixes (overall, and in the
AFTER_KILL_S after each death: the recompute storm), bytes moved by copies as a share of the bytes served, and the
busiest node's served pages over the mean. `benchmarks/cluster_bench.py`
measures the same on real nodes; `python -m devkit.cluster_sim` prints the table for 100 and 1,000 nodes.
"""

from __future__ import annotations

import argparse
import bisect
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from kvstore.index.choose import NodeLoad, copy_targets, pick
from kvstore.node.heat import HeatTable
from kvstore.replication.service import leader

MODES = ("none", "static2", "heat")
LOCAL_COPY_READS = 2  # as kvstore/client/cluster.py
LOCAL_COPY_WINDOW_S = 60.0
AFTER_KILL_S = 2.0  # the window after a death whose shared-prefix hits are counted apart


@dataclass(frozen=True, slots=True)
class SimConfig:
    nodes: int = 100
    capacity: int = 600  # pages per node
    prefixes: int = 20
    prefix_pages: int = 64
    suffix_pages: int = 16
    active: int = 2000  # conversations that may be read again
    requests: int = 10_000
    rate: float = 100.0  # requests per second, cluster-wide
    new_conversation: float = 0.3
    moved: float = 0.05
    churn_every: float = 5.0  # seconds between node deaths
    churn: str = "random"  # which node dies: "random" or "busiest" (served the most since the last death)
    reserve: float = 0.1
    hot_rate: float = 1.0  # the node defaults (kvstore/config.py)
    max_copies: int = 3
    round_every: float = 1.0  # seconds between replication rounds
    recompute_s: float = 0.5  # from a miss until the recomputed page is stored (a prefill of the chain)
    seed: int = 0


@dataclass(slots=True)
class SimResult:
    mode: str
    pages_read: int = 0
    pages_hit: int = 0
    prefix_read: int = 0
    prefix_hit: int = 0
    served_remote: int = 0
    copies: int = 0  # pages copied node to node (bytes moved, in pages)
    kills: int = 0
    storm_read: int = 0  # shared-prefix pages read within AFTER_KILL_S of a death
    storm_hit: int = 0
    served: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.pages_hit / self.pages_read if self.pages_read else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit / self.prefix_read if self.prefix_read else 0.0

    @property
    def storm_hit_rate(self) -> float:
        return self.storm_hit / self.storm_read if self.storm_read else 0.0

    @property
    def copy_share(self) -> float:
        return self.copies / self.pages_hit if self.pages_hit else 0.0

    @property
    def max_over_mean(self) -> float:
        mean = sum(self.served) / len(self.served) if self.served else 0.0
        return max(self.served) / mean if mean else 0.0


Page = tuple[str, int, int]


class _Node:
    __slots__ = ("heat", "lru", "recent", "served")

    def __init__(self) -> None:
        self.lru: OrderedDict[Page, None] = OrderedDict()
        self.heat = HeatTable(capacity=1024)
        self.served = 0
        self.recent = 0  # served since the last death (churn="busiest")


class Cluster:
    """The simulated cluster: nodes (LRU caches), the index (page -> holders) and the replication rules."""

    def __init__(self, cfg: SimConfig, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.cfg, self.mode = cfg, mode
        self.rng = random.Random(cfg.seed)
        self.nodes = [_Node() for _ in range(cfg.nodes)]
        self.index: dict[Page, set[int]] = {}
        self.remote: dict[tuple[int, Page], tuple[int, float]] = {}
        self.pending: list[tuple[float, int, list[Page]]] = []  # (visible at, host, pages) being recomputed
        self.res = SimResult(mode)
        weights = [1.0 / (k + 1) for k in range(cfg.prefixes)]
        total = sum(weights)
        self._zipf = [sum(weights[: k + 1]) / total for k in range(cfg.prefixes)]

    # -- pages

    def _store(self, n: int, page: Page) -> None:
        node = self.nodes[n]
        if page in node.lru:
            node.lru.move_to_end(page)
            return
        while len(node.lru) >= self.cfg.capacity:
            old, _ = node.lru.popitem(last=False)
            self._drop(n, old)
        node.lru[page] = None
        self.index.setdefault(page, set()).add(n)

    def _drop(self, n: int, page: Page) -> None:
        held = self.index.get(page)
        if held is not None:
            held.discard(n)
            if not held:
                del self.index[page]
        self.nodes[n].heat.forget(("", page))  # type: ignore[arg-type]

    def _load(self, n: int) -> NodeLoad:
        node = self.nodes[n]
        return NodeLoad(str(n), str(n), self.cfg.capacity - len(node.lru), self.cfg.capacity)

    def _copy(self, dest: int, page: Page) -> None:
        if dest in self.index.get(page, ()):
            return
        self._store(dest, page)
        self.res.copies += 1

    # -- a request

    def request(self, now: float, host: int, chain: list[Page], storm: bool = False) -> None:
        missing_from = len(chain)
        res = self.res
        prefix_pages = sum(1 for p in chain if p[0] == "p")
        res.prefix_read += prefix_pages
        res.storm_read += prefix_pages if storm else 0
        for i, page in enumerate(chain):
            held = self.index.get(page)
            res.pages_read += 1
            is_prefix = page[0] == "p"
            if not held:
                missing_from = i
                res.pages_read += len(chain) - i - 1
                break
            src = host if host in held else self.rng.choice(sorted(held))
            node = self.nodes[src]
            node.lru.move_to_end(page)
            node.served += 1
            node.recent += 1
            res.pages_hit += 1
            res.prefix_hit += is_prefix
            res.storm_hit += is_prefix and storm
            node.heat.note_read(("", page), "" if src == host else str(host), now)  # type: ignore[arg-type]
            if src != host:
                self.res.served_remote += 1
                if self.mode == "heat":
                    self._locality(now, host, page)
        if missing_from < len(chain):  # recomputed, put on the reader's host's node once the prefill is done
            self.pending.append((now + self.cfg.recompute_s, host, chain[missing_from:]))

    def settle(self, now: float) -> None:
        """Store the recomputed pages whose prefill has finished by `now`."""
        while self.pending and self.pending[0][0] <= now:
            _, host, pages = self.pending.pop(0)
            for page in pages:
                self._put(host, page)

    def _put(self, host: int, page: Page) -> None:
        """An engine's put of a page it recomputed: to its host's node (a second engine that recomputed the same
        page meanwhile puts another copy on its own node, as real engines do); static2 copies a new page."""
        new = page not in self.index
        self._store(host, page)
        if new and self.mode == "static2":
            chosen = pick([self._load(n) for n in self._draw(8, {host})], self.rng)
            if chosen is not None:
                self._copy(int(chosen.node_id), page)

    def _draw(self, k: int, exclude: set[int]) -> list[int]:
        """Up to k distinct nodes outside `exclude`, at random (a node reads every record; a few are enough)."""
        out: set[int] = set()
        for _ in range(4 * k):
            if len(out) >= k or len(out) + len(exclude) >= self.cfg.nodes:
                break
            n = self.rng.randrange(self.cfg.nodes)
            if n not in exclude:
                out.add(n)
        return sorted(out)

    def _locality(self, now: float, host: int, page: Page) -> None:
        """The cluster client's rule: the second remote read of a page within the window copies it here."""
        key = (host, page)
        reads, first = self.remote.get(key, (0, now))
        if now - first > LOCAL_COPY_WINDOW_S:
            reads, first = 0, now
        reads += 1
        if reads >= LOCAL_COPY_READS:
            reads = -1_000_000
            if self._load(host).free_fraction - 1 / self.cfg.capacity >= self.cfg.reserve:
                self._copy(host, page)
        self.remote[key] = (reads, first)
        if len(self.remote) > 50 * self.cfg.nodes:
            self.remote.clear()

    # -- replication rounds (heat mode): what each node's Replicator does

    def replicate(self, now: float) -> None:
        cfg = self.cfg
        for n, node in enumerate(self.nodes):
            if not node.heat.pages:
                continue
            for (_, page), _rate in node.heat.candidates(now, cfg.hot_rate, cfg.max_copies, 64):
                held = self.index.get(page, set())
                if n not in held:
                    continue
                wanted = node.heat.wanted(("", page), len(held), now, cfg.hot_rate, cfg.max_copies)  # type: ignore[arg-type]
                deficit = wanted - len(held)
                if deficit <= 0 or leader(repr(page).encode(), [str(h) for h in held]) != str(n):
                    continue
                sample = [self._load(d) for d in self._draw(16, held)]
                for dest in copy_targets(
                    repr(page).encode(), sample, count=deficit, need_slots=1, reserve=cfg.reserve, mean_load=0.0
                ):
                    self._copy(int(dest), page)

    def kill(self) -> None:
        if self.cfg.churn == "busiest":
            n = max(range(self.cfg.nodes), key=lambda i: self.nodes[i].recent)
        else:
            n = self.rng.randrange(self.cfg.nodes)
        for node in self.nodes:
            node.recent = 0
        for page in list(self.nodes[n].lru):
            self._drop(n, page)
        served = self.nodes[n].served
        self.nodes[n] = _Node()
        self.nodes[n].served = served
        self.res.kills += 1

    # -- the run

    def run(self) -> SimResult:
        cfg, rng = self.cfg, self.rng
        convs: list[tuple[int, int, int]] = []  # (id, prefix, host)
        next_conv = 0
        next_round = cfg.round_every
        next_kill = cfg.churn_every
        last_kill = -1e9
        for r in range(cfg.requests):
            now = r / cfg.rate
            self.settle(now)
            if now >= next_kill:
                self.kill()
                last_kill = now
                next_kill += cfg.churn_every
            if self.mode == "heat" and now >= next_round:
                self.replicate(now)
                next_round += cfg.round_every
            if not convs or rng.random() < cfg.new_conversation:
                prefix = bisect.bisect_left(self._zipf, rng.random())
                conv = (next_conv, prefix, rng.randrange(cfg.nodes))
                next_conv += 1
                convs.append(conv)
                if len(convs) > cfg.active:
                    convs.pop(rng.randrange(len(convs)))
                host = conv[2]
            else:
                conv = rng.choice(convs)
                host = rng.randrange(cfg.nodes) if rng.random() < cfg.moved else conv[2]
            chain = [("p", conv[1], i) for i in range(cfg.prefix_pages)]
            chain += [("c", conv[0], i) for i in range(cfg.suffix_pages)]
            self.request(now, host, chain, storm=now - last_kill < AFTER_KILL_S)
        self.res.served = [n.served for n in self.nodes]
        return self.res


def simulate(cfg: SimConfig, mode: str) -> SimResult:
    return Cluster(cfg, mode).run()


def scaled(nodes: int, requests_per_node: int = 100, seed: int = 0, churn: str = "random") -> SimConfig:
    """The default shape at `nodes` nodes: prefixes, active conversations and request rate grow with the cluster."""
    return SimConfig(
        nodes=nodes,
        prefixes=max(5, nodes // 5),
        active=20 * nodes,
        rate=float(nodes),
        requests=requests_per_node * nodes,
        seed=seed,
        churn=churn,
    )


def table(rows: list[tuple[SimConfig, SimResult]]) -> str:
    out = [
        "| nodes | churn | mode | hit rate | shared-prefix hit rate | ... within 2 s of a death | copies / pages "
        "served | served max/mean | deaths |",
        "|--:|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for c, r in rows:
        out.append(
            f"| {c.nodes} | {c.churn} | {r.mode} | {100 * r.hit_rate:.1f}% | {100 * r.prefix_hit_rate:.1f}% | "
            f"{100 * r.storm_hit_rate:.1f}% | {100 * r.copy_share:.1f}% | {r.max_over_mean:.2f} | {r.kills} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="100,1000")
    ap.add_argument("--requests-per-node", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--churn", default="random,busiest")
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.nodes.split(",")):
        for churn in args.churn.split(","):
            cfg = scaled(n, args.requests_per_node, args.seed, churn)
            for mode in args.modes.split(","):
                rows.append((cfg, simulate(cfg, mode)))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
