"""The node's page manager: placement, moves between tiers, Put transactions, reads, prefetch and the
durable copies on NVMe. `TierManager` (core.py) is the entry point; see each module for its invariants.

    state.py      PageTable, Entry, Tier: which page is where (pure bookkeeping)
    placement.py  slots on demand: eviction over the pure policy, waiting for space
    moves.py      demotion, promotion, eviction, dropping: every change of a visible page's place
    durable.py    NVMe shadow slots, recovery after a restart, shutdown spill
    put.py        PutTxn and the Staging API it uses
    reads.py      leases, verified reads, read-ahead
    prefetch.py   background promotions
    io.py         the blocking-I/O pool
    pins.py       pins and pin leases (Pin, Unpin, the sweep of passed deadlines)
    snapshot.py   the Stats snapshot of the tiers, namespaces and counters
    core.py       TierManager: wires the parts, answers requests, reports stats
"""

from kvstore.manager.core import TierManager
from kvstore.manager.put import PutTxn
from kvstore.manager.reads import ReadLease
from kvstore.manager.state import Entry

__all__ = ["Entry", "PutTxn", "ReadLease", "TierManager"]
