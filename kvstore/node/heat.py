"""Which pages this node's readers make hot, and how many copies each asks for (DESIGN.md §7.3). Pure: no I/O,
no clock of its own (every call is given `now`), no randomness.

Per page (stored namespace, hash) the table keeps:
- a read score decayed with half-life HALF_LIFE_S: reads per second, once multiplied by ln 2 / HALF_LIFE_S;
- the hosts that read it lately (at most MAX_HOSTS, each forgotten HOST_MEMORY_S after its last read): "" is this
  node's own host (the same-host plane, loopback peers), anything else a peer's address;
- the copies a Put asked for (`replicas`, carried by its copies too), kept while the page is held here.

The rule (`wanted`): a page is hot when the reads of all its holders together reach `hot_rate` (this node sees
its own share: its rate times the number of holders) or when readers on two or more hosts read it; a hot page
asks for max(2, hosts, total rate / READS_PER_COPY) copies, capped by `max_copies`; a cold page asks for one. A
Put's replicas=k asks for k whatever the heat. Bounded: at most `capacity` pages; past it the coldest half is
forgotten (a forgotten page is cold; a page whose Put asked for copies is forgotten last).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvstore.names import Key

HALF_LIFE_S = 10.0  # reads older than half a minute hardly count: heat follows traffic within seconds
MAX_HOSTS = 8  # hosts remembered per page: enough to say "several", bounded per page
HOST_MEMORY_S = 60.0  # a host not seen for this long no longer counts as a reader
# Reads per second (all holders together) one copy is asked to serve before the page asks for one more beyond
# two. A copy is worth more for locality and for surviving a node's loss than for throughput (one node serves a
# page thousands of times a second), so this only adds copies to pages read at very high rates.
READS_PER_COPY = 50.0
_K = math.log(2) / HALF_LIFE_S


@dataclass(slots=True)
class PageHeat:
    """One page's reads: decayed score (at time `at`), recent reader hosts, copies asked for by its Put."""

    score: float = 0.0
    at: float = 0.0
    host: str = ""  # the last reader's host (most pages are read from one host: no dict for them)
    hosts: dict[str, float] | None = None  # host -> last read, once a second host read it
    replicas: int = 0

    def rate(self, now: float) -> float:
        """Reads per second lately (the decayed score as a rate)."""
        return self.score * math.exp(-(now - self.at) * _K) * _K

    def host_count(self, now: float) -> int:
        if self.hosts is None:
            return 1 if self.score else 0
        return sum(1 for t in self.hosts.values() if now - t < HOST_MEMORY_S)


class HeatTable:
    """Reads per page and the copies they ask for (see the module docstring). Called on the node's event loop."""

    def __init__(self, capacity: int = 50_000) -> None:
        if capacity < 2:
            raise ValueError(f"capacity must be >= 2, got {capacity}")
        self.capacity = capacity
        self.pages: dict[Key, PageHeat] = {}

    def note_read(self, key: Key, host: str, now: float) -> None:
        """One read of `key` by a reader on `host` ("" this node's host). O(1)."""
        h = self.pages.get(key)
        if h is None:
            if len(self.pages) >= self.capacity:
                self.prune(now)
            h = self.pages[key] = PageHeat(host=host)
        h.score = h.score * math.exp(-(now - h.at) * _K) + 1.0
        h.at = now
        if host != h.host or h.hosts is not None:
            if h.hosts is None:
                h.hosts = {h.host: now}
            h.hosts[host] = now
            h.host = host
            if len(h.hosts) > MAX_HOSTS:
                del h.hosts[min(h.hosts, key=h.hosts.__getitem__)]

    def ask(self, key: Key, replicas: int, now: float) -> None:
        """A Put (or a copy) of `key` asked for `replicas` copies: kept while the page is here (the most asked)."""
        if replicas <= 1 and key not in self.pages:
            return
        h = self.pages.get(key)
        if h is None:
            if len(self.pages) >= self.capacity:
                self.prune(now)
            h = self.pages[key] = PageHeat(at=now)
        h.replicas = max(h.replicas, replicas)

    def forget(self, key: Key) -> None:
        """The page left this node."""
        self.pages.pop(key, None)

    def wanted(self, key: Key, holders: int, now: float, hot_rate: float, max_copies: int) -> int:
        """Copies `key` asks for, given how many live nodes hold it now (this one included)."""
        h = self.pages.get(key)
        return 1 if h is None else want(h, holders, now, hot_rate, max_copies)

    def candidates(
        self, now: float, hot_rate: float, max_copies: int, limit: int, min_rate: float | None = None
    ) -> list[tuple[Key, float]]:
        """Pages that may ask for more than one copy (however many holders they turn out to have): (key, rate),
        at most `limit`, hottest first (a Put's replicas count as heat above any read rate). `min_rate`: every
        page read at least this often instead (a node leaving hands off what was read lately)."""
        out: list[tuple[float, Key, float]] = []
        floor = hot_rate / max_copies if min_rate is None else min_rate
        for key, h in self.pages.items():
            rate = h.rate(now)
            if h.replicas > 1 or rate >= floor or h.host_count(now) >= 2:
                out.append((rate + (1e9 if h.replicas > 1 else 0.0), key, rate))
        out.sort(key=lambda t: t[0], reverse=True)
        return [(key, rate) for _, key, rate in out[:limit]]

    def prune(self, now: float) -> int:
        """Forget the coldest half (pages whose Put asked for copies last); returns how many were forgotten."""
        order = sorted(self.pages, key=lambda k: (self.pages[k].replicas > 1, self.pages[k].rate(now)))
        drop = order[: max(1, len(order) // 2)]
        for k in drop:
            del self.pages[k]
        return len(drop)


def want(h: PageHeat, holders: int, now: float, hot_rate: float, max_copies: int) -> int:
    """The rule of the module docstring for one page."""
    total = h.rate(now) * max(1, holders)
    hosts = h.host_count(now)
    by_heat = 1
    if total >= hot_rate or hosts >= 2:
        by_heat = min(max_copies, max(2, hosts, math.ceil(total / READS_PER_COPY)))
    return max(by_heat, h.replicas)
