"""What the node's UCX worker does with tagged messages nobody has posted a receive for: hold or drop.

UCX buffers an unmatched tagged message (its payload when eager, a small rendezvous request when not)
until someone receives it, and tells the receiver nothing about who sent it. Left alone, any process
that reaches the node's worker could grow it without bound (200k x 64 B: +220 MiB). So after every
progress of the worker the intake takes each unexpected message out of UCX's queue (`tag_probe` with
remove) and either
- holds it for the connection whose open page range its tag lies in (a PUT's pages may arrive before
  the node posts their receives: they follow the request on the wire), to be received with its handle
  straight into the page's buffer; at most `max_held` per connection, else that connection is closed;
- or drops it: received into a scratch buffer that nothing reads (a larger one is truncated, which
  consumes it too) and counted.

Invariants: after `drain` returns, UCX holds no unexpected message; a held message belongs to a
range still open, and is received (into its page or dropped) when its range closes; every probe
handle taken is consumed exactly once (an unconsumed handle would leak inside UCX).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from kvstore.wire.ucx import range_base

log = logging.getLogger(__name__)

SCRATCH_BYTES = 64 << 10  # where dropped messages land (eager ones are at most a few KiB)
REPORT_SECONDS = 60.0  # dropped messages are logged at most this often, as a count


class Holder(Protocol):
    """A connection the intake holds early messages for."""

    held: dict[int, Any]

    def overflow(self) -> None:
        """Too many messages held: close the connection (the intake drops what it held)."""


class Intake:
    """The node worker's unexpected-message policy. Single-threaded: call it from the node's loop only."""

    def __init__(self, ucx: Any, worker: Any, array: Any, max_held: int) -> None:
        self.ucx = ucx
        self.worker = worker
        self.max_held = max_held
        self._any = ucx.UCXXTag(0)
        self._mask_any = ucx.UCXXTagMask(0)
        self._scratch = array(bytearray(SCRATCH_BYTES))  # never read, never freed while the node runs
        self._ranges: dict[int, Holder] = {}
        self._dropping: list[Any] = []  # receives into the scratch buffer not completed yet
        self.dropped = 0  # messages dropped since start (no open range, or their connection overflowed)
        self._reported = 0
        self._report_at = 0.0

    # -- ranges

    def open_range(self, base: int, holder: Holder) -> bool:
        """Hold early messages tagged in [base, base + 65536) for `holder`; False if the range is taken
        (another connection's: the caller then closes its connection, as the chance is 2^-48)."""
        owner = self._ranges.get(base)
        if owner is not None and owner is not holder:
            return False
        self._ranges[base] = holder
        return True

    def close_range(self, base: int, holder: Holder) -> None:
        """Stop holding for this range; drop what is held in it."""
        if self._ranges.get(base) is holder:
            del self._ranges[base]
        for tag in [t for t in holder.held if range_base(t) == base]:
            self._drop(holder.held.pop(tag))

    def release(self, holder: Holder) -> None:
        """A connection ends: close all its ranges, drop everything held for it."""
        for base in [b for b, h in self._ranges.items() if h is holder]:
            del self._ranges[base]
        for probe in holder.held.values():
            self._drop(probe)
        holder.held.clear()

    # -- receiving

    def receive(self, holder: Holder, ep: Any, tag: int, arr: Any) -> Any:
        """A receive of `tag` into `arr`: from the message held for it, or posted on `ep` (which tracks
        it, so closing the endpoint cancels it)."""
        probe = holder.held.pop(tag, None)
        if probe is not None:
            return self.worker.tag_recv_with_handle(arr, probe)
        return ep.tag_recv(arr, self.ucx.UCXXTag(tag))

    def drain(self) -> None:
        """Take every unexpected message out of UCX (hold or drop each). Called after each worker
        progress, so what UCX buffers at once is bounded by what one progress reads off its transports
        (UCX_TCP_MAX_POLL events of at most one receive segment each), whatever a peer sends."""
        if self._dropping:
            self._dropping = [r for r in self._dropping if not r.completed]
        while True:
            probe = self.worker.tag_probe(self._any, self._mask_any, remove=True)
            if not probe.matched:
                break
            tag = probe.sender_tag.value
            holder = self._ranges.get(range_base(tag))
            if holder is None or tag in holder.held:
                self._drop(probe)
                continue
            holder.held[tag] = probe
            if len(holder.held) > self.max_held:
                log.warning("UCX connection held more than %d early messages: closing it", self.max_held)
                self.release(holder)
                holder.overflow()
        self._report()

    def _drop(self, probe: Any) -> None:
        self.dropped += 1
        req = self.worker.tag_recv_with_handle(self._scratch, probe)
        if not req.completed:
            self._dropping.append(req)

    def _report(self) -> None:
        if self.dropped == self._reported or time.monotonic() < self._report_at:
            return
        log.warning(
            "UCX plane: dropped %d tagged messages that no authenticated request expected (%d since start)",
            self.dropped - self._reported,
            self.dropped,
        )
        self._reported = self.dropped
        self._report_at = time.monotonic() + REPORT_SECONDS
