"""The Put transaction: pages staged invisibly in host-memory slots, verified and published together.

`Staging` is the small API a transaction uses (and all it may touch): reserve a slot, fill it through a
view, publish it as a page, or release it. Every transport (gRPC streams, shared memory, the bulk
planes) drives the same `PutTxn`, so atomicity and verification are the same everywhere.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.errors import DataLoss, InvalidArgument, ResourceExhausted
from kvstore.layout import PageLayout
from kvstore.manager.placement import Placement
from kvstore.manager.state import Entry, NodeCounters, PageTable, check_hash
from kvstore.names import Key, TierKind
from kvstore.pageformat import HEADER_BYTES, PageHeader, payload_checksum
from kvstore.tenants import tenant_of

AfterCommit = Callable[[list[Key], TierKind], None]  # (pages published, the tier the writer asked for)


class Staging:
    """Slots of the host-memory tier held by Put streams: invisible until published.

    Invariant: a reserved slot is either released or published exactly once; a published page's header
    (namespace, hash, layout, length, checksum, a fresh generation) is written into its slot before the
    page becomes visible.
    """

    def __init__(self, table: PageTable, placement: Placement, counters: NodeCounters, kind: TierKind,
                 max_pages: int, after_commit: AfterCommit) -> None:  # fmt: skip
        self.table = table
        self.placement = placement
        self.counters = counters
        self.tier = table.tiers[kind]
        self.max_pages = max_pages  # per transaction
        self.after_commit = after_commit

    def has(self, key: Key) -> bool:
        return key in self.table

    async def reserve(self, held: int, wait: bool, tenant: str | None = None) -> int:
        """A slot for the next page (of `tenant`: its share); `held` slots are already staged by the caller
        (see Placement.allocate)."""
        return await self.placement.allocate(self.tier.kind, reserve=held, wait=wait, tenant=tenant)

    def payload_view(self, slot: int, length: int) -> memoryview:
        return self.tier.medium.view(slot)[HEADER_BYTES : HEADER_BYTES + length]

    def checksum(self, slot: int, length: int) -> int:
        return payload_checksum(self.payload_view(slot, length))

    def release(self, slot: int) -> None:
        self.tier.alloc.free(slot)

    def publish(self, namespace: str, h: bytes, layout: PageLayout, slot: int, checksum: int,
                parent: Key | None) -> bool:  # fmt: skip
        """Make a staged page visible; False (and the slot released) when the key is stored already."""
        if (namespace, h) in self.table:
            self.release(slot)
            return False
        self.table.layouts.setdefault(namespace, layout)
        plen = layout.page_bytes
        gen = self.table.next_generation()
        self.tier.medium.view(slot)[:HEADER_BYTES] = PageHeader(namespace, h, layout, plen, checksum, gen).pack()
        entry = Entry(namespace, h, self.tier.kind, slot, plen, checksum, gen, layout)
        entry.parent = parent
        self.table.publish(entry, self.tier.kind)
        self.tier.counters.bytes_in += plen
        return True

    def rejected(self) -> None:
        self.counters.put_rejected += 1


class PutTxn:
    """One Put stream. Pages are staged in host-memory slots the caller fills through `add_page`'s view;
    `commit` verifies and publishes them at once; `abort` (or a failed commit) frees what is staged.

    Atomicity: nothing is visible before commit, as long as the stream's pages fit in the staging tier
    together. A stream that outgrows it (no free or evictable slot left besides its own staged ones) is
    committed in groups: the staged, verified pages are published and the stream goes on. Each page is
    always atomic: a page is either complete and verified or absent.
    """

    def __init__(self, staging: Staging, namespace: str, layout: PageLayout, target: TierKind,
                 parent: bytes | None = None, chain: bool = False) -> None:  # fmt: skip
        self._staging = staging
        self.namespace = namespace
        self._tenant = tenant_of(namespace)  # whose share its slots count against
        self.layout = layout
        self.target = target
        self._chain = chain
        self._prev: bytes | None = parent  # the chain's block before the next page
        self._staged: list[tuple[bytes, int, int, bytes | None]] = []  # (hash, slot, declared checksum, parent)
        self._sums: list[int] = []  # checksums of the staged pages verified so far: a prefix of _staged
        self._seen: set[bytes] = set()
        self.stored = 0
        self.already_present = 0
        self.done = False

    async def add_page(self, h: bytes, payload_len: int, checksum: int) -> memoryview | None:
        """Reserve a slot for the next page and return the writable view its payload goes into, or
        None when the page is already stored (the caller discards its bytes). The previous page's
        view must be completely written before this is called."""
        st = self._staging
        check_hash(h, "page.hash")
        if payload_len != self.layout.page_bytes:
            raise InvalidArgument(
                "page.payload_bytes",
                f"{payload_len} bytes does not match the layout's page size {self.layout.page_bytes} "
                f"({self.layout.describe()})",
            )
        if len(self._seen) + self.already_present >= st.max_pages:
            raise InvalidArgument("pages", f"more than {st.max_pages} pages in one stream")
        # NOTE: the previous page is complete now (the contract above), so it is verified here, while the
        # sender is still streaming this one, rather than all at once at commit with the sender idle.
        self._verify_staged()
        parent = self._prev if self._chain else None
        self._prev = h
        if st.has((self.namespace, h)) or h in self._seen:
            self.already_present += 1
            return None
        try:
            slot = await st.reserve(held=len(self._staged), wait=not self._staged, tenant=self._tenant)
        except ResourceExhausted:
            if not self._staged:
                raise
            self._publish_staged()  # the stream outgrew the staging tier: commit what it staged so far
            slot = await st.reserve(held=0, wait=True, tenant=self._tenant)
        self._seen.add(h)
        self._staged.append((h, slot, checksum, parent))
        return st.payload_view(slot, payload_len)

    async def commit(self) -> tuple[int, int]:
        """Verify every staged page and publish them; returns (stored, already_present)."""
        if self.done:
            raise RuntimeError("transaction already finished")
        self._publish_staged()
        self.done = True
        self._staging.after_commit([(self.namespace, h) for h in self._seen], self.target)
        return self.stored, self.already_present

    def _verify_staged(self) -> None:
        """Checksum the staged pages not verified yet; a mismatch aborts the transaction (DataLoss)."""
        st = self._staging
        plen = self.layout.page_bytes
        try:
            for h, slot, declared, _ in self._staged[len(self._sums) :]:
                actual = st.checksum(slot, plen)
                if declared and declared != actual:
                    raise DataLoss(f"page {h.hex()}: payload checksum {actual:#x} != declared {declared:#x}")
                self._sums.append(actual)
        except BaseException:
            self.abort()
            raise

    def _publish_staged(self) -> None:
        """Verify all staged pages (any failure aborts the transaction), then publish them."""
        st = self._staging
        try:
            st.table.check_layout(self.namespace, self.layout)
        except BaseException:
            self.abort()
            raise
        self._verify_staged()
        for (h, slot, _, parent), csum in zip(self._staged, self._sums, strict=True):
            key_parent = (self.namespace, parent) if parent is not None else None
            if st.publish(self.namespace, h, self.layout, slot, csum, key_parent):
                self.stored += 1
            else:  # another stream committed it meanwhile
                self.already_present += 1
        self._staged.clear()
        self._sums.clear()
        st.placement.space_changed()

    def abort(self) -> None:
        """Free every staged slot; idempotent."""
        if self.done:
            return
        self.done = True
        st = self._staging
        for _, slot, _, _ in self._staged:
            st.release(slot)
        self._staged.clear()
        self._sums.clear()
        st.rejected()
        st.placement.space_changed()
