"""The Put transaction: pages staged invisibly in host-memory slots, verified and published together.

`Staging` is the small API a transaction uses (and all it may touch): reserve a slot, fill it through a
view, publish it as a page, or release it. Every transport (gRPC streams, shared memory, the bulk
planes) drives the same `PutTxn`, so atomicity and verification are the same everywhere.

Admission: a page the full host-memory tier's policy refuses (Placement.admit) is received into a
bounce buffer instead of a slot, verified like any other, and written through into the persistent tier
(NVMe) when the group is published; with no persistent tier (or no room there) it is not stored, and
the Put reports it neither stored nor already present (Stats counts it in `not_admitted`).

A sender may declare a page's checksum after its bytes (`DeclaredLater`: the same-host plane's writer hashes its
pages while the node copies them, DESIGN.md §8): such a page is verified once its checksum came, and no page of
the transaction is published before every staged page's declared checksum came and matched, mid-stream
publishing and write-through included.

A Put whose target is the persistent tier (`PutOpen.target_tier` NVMe) takes that same path for every page,
without asking admission: its pages land in NVMe, durable when the Put returns, and no DRAM page is
evicted for them.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.errors import DataLoss, InvalidArgument, ResourceExhausted
from kvstore.layout import PageLayout
from kvstore.manager.io import IoPool
from kvstore.manager.placement import Placement
from kvstore.manager.state import Entry, NodeCounters, PageTable, check_hash
from kvstore.names import Key, TierKind
from kvstore.pageformat import (
    HEADER_BYTES,
    ChecksumForm,
    PageHeader,
    identity_digest,
    node_side_digest,
    payload_checksum,
    slot_bytes_for,
)
from kvstore.scoping import tenant_of
from kvstore.tiers.dram import BouncePool
from kvstore.wire import PutOpen

log = logging.getLogger(__name__)

AfterCommit = Callable[[list[Key], TierKind], None]  # (pages published, the tier the writer asked for)


@dataclass(frozen=True, slots=True)
class DeclaredLater:
    """A checksum its sender declares after the page's bytes: item `index` of what `sums` resolves to (in the
    Put's ChecksumForm; 0: none). The plane that made `sums` resolves it, or fails it (an error the Put raises)."""

    sums: asyncio.Future[Sequence[int]]
    index: int


Declared = int | DeclaredLater  # what a sender declares for a page: its checksum (0: none), or that it comes later


class WriteThrough:
    """Where pages refused by the host-memory tier's admission go: a bounce buffer while they arrive,
    then straight into a slot of the persistent tier, never through host-memory slots.

    Invariant: a page is published in the persistent tier only after its whole slot (header and
    payload) was written there; a failed or superfluous write leaves nothing visible and frees its slot.
    """

    def __init__(
        self, table: PageTable, placement: Placement, io: IoPool, bounce: BouncePool, kind: TierKind | None
    ) -> None:
        self.table = table
        self.placement = placement
        self.io = io
        self.bounce = bounce
        self.tier = table.tiers[kind] if kind is not None and table.tiers[kind].available else None

    def take(self) -> mmap.mmap:
        return self.bounce.take()

    def give(self, buf: mmap.mmap) -> None:
        self.bounce.give(buf)

    async def store(
        self, namespace: str, h: bytes, layout: PageLayout, buf: mmap.mmap, *, checksum: int, parent: Key | None
    ) -> bool:
        """Write a verified page from `buf` into the persistent tier and publish it there; False (nothing
        visible) when there is no such tier, it is stored already, there is no room or the write failed."""
        tier = self.tier
        if tier is None or (namespace, h) in self.table:
            return False
        plen = layout.page_bytes
        try:  # its share; OSError: laying out a chunk for this page's size failed (disk full, I/O error)
            slot = await self.placement.allocate(
                tier.kind, slot_bytes_for(plen), wait=False, tenant=tenant_of(namespace)
            )
        except (ResourceExhausted, OSError) as exc:
            if isinstance(exc, OSError):
                log.error("writing %s through to %s failed (%s): not stored", h.hex(), tier.kind.label, exc)
            return False
        entry = Entry(namespace, h, tier.kind, slot, plen, checksum, self.table.next_generation(), layout)
        entry.parent = parent
        view = memoryview(buf)
        try:
            view[:HEADER_BYTES] = PageHeader(namespace, h, layout, plen, checksum, entry.generation).pack()
            await self.io.run(tier.medium.write, slot, view[: entry.used_len])
        except OSError as exc:  # ENOSPC, EIO: the medium erased the slot it could not finish
            tier.alloc.free(slot)
            log.error("writing %s through to %s failed (%s): not stored", h.hex(), tier.kind.label, exc)
            return False
        finally:
            view.release()
        if (namespace, h) in self.table:  # another stream published it while this one was writing
            await self.io.run(tier.medium.invalidate, slot, entry.used_len)
            tier.alloc.free(slot)
            return False
        self.table.layouts.setdefault(namespace, layout)
        self.table.publish(entry, tier.kind)
        tier.counters.bytes_in += plen
        return True


@dataclass(slots=True)
class _Staged:
    """A page of a transaction, received but not visible: in a host-memory slot, or (refused by
    admission) in a bounce buffer to be written through."""

    hash: bytes
    slot: int  # -1 when `through` holds the page
    declared: Declared  # checksum the client declared, in the Put's ChecksumForm (0: none), or comes later
    parent: bytes | None
    through: mmap.mmap | None = None
    hashed: int | None = None  # XXH3-64 of the bytes as they landed in its slot, when the plane hashed them so


class Staging:
    """Slots of the host-memory tier held by Put streams: invisible until published.

    Invariant: a reserved slot is either released or published exactly once; a published page's header
    (namespace, hash, layout, length, checksum, a fresh generation) is written into its slot before the
    page becomes visible.
    """

    def __init__(
        self,
        table: PageTable,
        placement: Placement,
        counters: NodeCounters,
        *,
        kind: TierKind,
        max_pages: int,
        after_commit: AfterCommit,
        through: WriteThrough,
    ) -> None:
        self.table = table
        self.placement = placement
        self.counters = counters
        self.tier = table.tiers[kind]
        self.max_pages = max_pages  # per transaction
        self.after_commit = after_commit
        self.through = through

    def admit(self, key: Key, parent: Key | None, nbytes: int) -> tuple[bool, Entry | None]:
        """Whether a new page (a slot of `nbytes`) may take room in the full staging tier (Placement.admit)."""
        return self.placement.admit(self.tier.kind, key, parent, nbytes)

    def has(self, key: Key) -> bool:
        return key in self.table

    async def reserve(
        self, nbytes: int, held: int, wait: bool, victim: Entry | None = None, tenant: str | None = None
    ) -> int:
        """A slot of `nbytes` for the next page (of `tenant`: its share); `held` bytes of slots are already
        staged by the caller (see Placement.allocate)."""
        return await self.placement.allocate(
            self.tier.kind, nbytes, reserve=held, wait=wait, victim=victim, tenant=tenant
        )

    def payload_view(self, slot: int, length: int) -> memoryview:
        return self.tier.medium.view(slot + HEADER_BYTES, length)

    def checksum(self, slot: int, length: int) -> int:
        return payload_checksum(self.payload_view(slot, length))

    def release(self, slot: int) -> None:
        self.tier.alloc.free(slot)

    def publish(
        self, namespace: str, h: bytes, layout: PageLayout, slot: int, *, checksum: int, parent: Key | None
    ) -> bool:
        """Make a staged page visible; False (and the slot released) when the key is stored already."""
        if (namespace, h) in self.table:
            self.release(slot)
            return False
        self.table.layouts.setdefault(namespace, layout)
        plen = layout.page_bytes
        gen = self.table.next_generation()
        self.tier.medium.view(slot, HEADER_BYTES)[:] = PageHeader(namespace, h, layout, plen, checksum, gen).pack()
        entry = Entry(namespace, h, self.tier.kind, slot, plen, checksum, gen, layout)
        entry.parent = parent
        self.table.publish(entry, self.tier.kind)
        self.tier.counters.bytes_in += plen
        return True

    def rejected(self) -> None:
        self.counters.put_rejected += 1

    def check_layout(self, namespace: str, layout: PageLayout) -> None:
        """Raise unless `namespace` may hold pages of `layout` (its first Put bound it)."""
        self.table.check_layout(namespace, layout)

    def space_changed(self) -> None:
        """Slots were freed or published: wake allocations waiting for room."""
        self.placement.space_changed()

    # -- pages refused by admission, written through to the persistent tier (WriteThrough)

    @property
    def through_kind(self) -> TierKind | None:
        """The tier pages are written through to (NVMe), or None when the node has none."""
        return self.through.tier.kind if self.through.tier is not None else None

    def take_bounce(self) -> mmap.mmap:
        return self.through.take()

    def give_bounce(self, buf: mmap.mmap) -> None:
        self.through.give(buf)

    async def store_through(
        self, namespace: str, h: bytes, layout: PageLayout, buf: mmap.mmap, *, checksum: int, parent: Key | None
    ) -> bool:
        return await self.through.store(namespace, h, layout, buf, checksum=checksum, parent=parent)


class PutTxn:
    """One Put stream. Pages are staged in host-memory slots the caller fills through `add_page`'s view;
    `commit` verifies and publishes them at once; `abort` (or a failed commit) frees what is staged.

    Atomicity: nothing is visible before commit, as long as the stream's pages fit in the staging tier
    together. A stream that outgrows it (no free or evictable slot left besides its own staged ones) is
    committed in groups: the staged, verified pages are published and the stream goes on. Each page is
    always atomic: a page is either complete and verified or absent. A page refused by admission is
    staged in a bounce buffer and written through at publish (see the module docstring).
    """

    def __init__(self, staging: Staging, op: PutOpen) -> None:
        """`op.namespace` is the stored (tenant-scoped) namespace; `op.target_tier` None means staging's tier."""
        self._staging = staging
        self.namespace = op.namespace
        self._tenant = tenant_of(op.namespace)  # whose share its slots count against
        self.layout = op.layout
        self.target = op.target_tier if op.target_tier is not None else staging.tier.kind
        # Pages asked for in the persistent tier skip host-memory slots: written through, like pages
        # admission refused (TierManager.begin_put checked that the node has that tier).
        self._through_only = self.target != staging.tier.kind and self.target == staging.through_kind
        self._chain = op.chain
        self._form = op.checksums  # the form of the checksums the sender declares (pageformat.ChecksumForm)
        self._prev: bytes | None = op.parent  # the chain's block before the next page
        self._staged: list[_Staged] = []
        self._sums: list[int] = []  # checksums of the staged pages verified so far: a prefix of _staged
        self._seen: set[bytes] = set()
        self._announced: list[bytes] = []  # every page's hash, in the order the sender announced them
        self._slots_held = 0  # staged pages holding a host-memory slot
        self.stored = 0
        self.already_present = 0
        self.not_admitted = 0  # refused by admission and not stored (no persistent tier, or no room there)
        self.done = False

    async def add_page(self, h: bytes, payload_len: int, checksum: Declared) -> memoryview | None:
        """Reserve a slot for the next page and return the writable view its payload goes into, or
        None when the page is already stored or not admitted and not storable (the caller discards its
        bytes). The previous page's view must be completely written before this is called."""
        st = self._staging
        check_hash(h, "page.hash")
        if payload_len != self.layout.page_bytes:
            raise InvalidArgument(
                "page.payload_bytes",
                f"{payload_len} bytes does not match the layout's page size {self.layout.page_bytes} "
                f"({self.layout.describe()})",
            )
        if len(self._seen) + self.already_present + self.not_admitted >= st.max_pages:
            raise InvalidArgument("pages", f"more than {st.max_pages} pages in one stream")
        self._announced.append(h)
        # NOTE: the previous page is complete now (the contract above), so it is verified here, while the
        # sender is still streaming this one, rather than all at once at commit with the sender idle.
        self._verify_staged()
        parent = self._prev if self._chain else None
        self._prev = h
        if st.has((self.namespace, h)) or h in self._seen:
            self.already_present += 1
            return None
        key_parent = (self.namespace, parent) if parent is not None else None
        nbytes = slot_bytes_for(payload_len)
        admitted, victim = (False, None) if self._through_only else st.admit((self.namespace, h), key_parent, nbytes)
        if not admitted:
            # NOTE: staged in a bounce buffer even with nowhere to write it through: a refused page is
            # verified like any other (a wrong checksum is DataLoss), then counted not admitted at publish.
            buf = st.take_bounce()
            self._seen.add(h)
            self._staged.append(_Staged(h, -1, checksum, parent, buf))
            return memoryview(buf)[HEADER_BYTES : HEADER_BYTES + payload_len]
        try:
            slot = await st.reserve(
                nbytes, held=self._slots_held * nbytes, wait=not self._slots_held, victim=victim, tenant=self._tenant
            )
        except ResourceExhausted:
            if not self._slots_held:
                raise
            await self._publish_staged()  # the stream outgrew the staging tier: commit what it staged so far
            slot = await st.reserve(nbytes, held=0, wait=True, tenant=self._tenant)
        self._seen.add(h)
        self._staged.append(_Staged(h, slot, checksum, parent))
        self._slots_held += 1
        return st.payload_view(slot, payload_len)

    def filled(self, checksum: int) -> None:
        """The view add_page returned last was filled by a pass that hashed the bytes as they landed in it:
        `checksum` is their payload XXH3-64, hashed out of the view (never out of the sender's source), so
        verifying the page costs no second pass over its slot."""
        if self._staged:
            self._staged[-1].hashed = checksum

    async def commit(self) -> tuple[int, int]:
        """Verify every staged page and publish them; returns (stored, already_present)."""
        if self.done:
            raise RuntimeError("transaction already finished")
        await self._publish_staged()
        self.done = True
        self._staging.after_commit([(self.namespace, h) for h in self._seen], self.target)
        return self.stored, self.already_present

    def held(self) -> list[bool]:
        """Per page announced, in order: whether the node holds it now (stored, or already present). Asked after
        commit, it is what the Put answers per page, so no sender is told of a store it did not get: a page
        refused by admission with nowhere to go, or stored and then evicted by this same stream (a stream
        larger than its tier), is not held."""
        st = self._staging
        return [st.has((self.namespace, h)) for h in self._announced]

    def _verify_staged(self) -> None:
        """Checksum the staged pages not verified yet, bound to their identity (pageformat: the stored form),
        up to the first whose declared checksum has not come yet; a mismatch with what the sender declared
        aborts the transaction (DataLoss)."""
        st = self._staging
        plen = self.layout.page_bytes
        node_side = node_side_digest(self.namespace, self.layout)
        try:
            for p in self._staged[len(self._sums) :]:
                if isinstance(p.declared, DeclaredLater):
                    if not p.declared.sums.done():
                        break  # NOTE: verified in order: _sums stays a prefix of _staged
                    p.declared = p.declared.sums.result()[p.declared.index]
                if p.hashed is not None:
                    actual = p.hashed
                elif p.through is None:
                    actual = st.checksum(p.slot, plen)
                else:
                    with memoryview(p.through) as view:
                        actual = payload_checksum(view[HEADER_BYTES : HEADER_BYTES + plen])
                ident = identity_digest(self.namespace, p.hash, self.layout)
                bound = actual ^ ident
                if p.declared:
                    # The declared checksum in the stored form: the node adds what the sender does not know.
                    declared = p.declared ^ (node_side if self._form is ChecksumForm.KEYED else ident)
                    if declared != bound:
                        raise DataLoss(
                            f"page {p.hash.hex()}: its bytes do not match the checksum its sender declared for "
                            f"this namespace, key and layout ({actual:#x} hashed)"
                        )
                self._sums.append(bound)
        except BaseException:
            self.abort()
            raise

    async def _publish_staged(self) -> None:
        """Verify all staged pages (any failure aborts the transaction), then publish them: the ones in
        host-memory slots at once, then the written-through ones as their writes finish."""
        st = self._staging
        try:
            st.check_layout(self.namespace, self.layout)
            for p in self._staged:  # NOTE: nothing is published before every declared checksum came
                if isinstance(p.declared, DeclaredLater):
                    await p.declared.sums
        except BaseException:
            self.abort()
            raise
        self._verify_staged()
        staged, sums = self._staged, self._sums
        self._staged, self._sums, self._slots_held = [], [], 0
        through: list[tuple[_Staged, int]] = []
        for p, csum in zip(staged, sums, strict=True):
            key_parent = (self.namespace, p.parent) if p.parent is not None else None
            if p.through is not None:
                through.append((p, csum))
            elif st.publish(self.namespace, p.hash, self.layout, p.slot, checksum=csum, parent=key_parent):
                self.stored += 1
            else:  # another stream committed it meanwhile
                self.already_present += 1
        try:
            for p, csum in through:
                key_parent = (self.namespace, p.parent) if p.parent is not None else None
                assert p.through is not None
                if await st.store_through(
                    self.namespace, p.hash, self.layout, p.through, checksum=csum, parent=key_parent
                ):
                    self.stored += 1
                elif st.has((self.namespace, p.hash)):
                    self.already_present += 1
                else:
                    self.not_admitted += 1
                st.give_bounce(p.through)
                p.through = None
        finally:  # cancelled mid-way: the buffers not written yet go back
            for p, _ in through:
                if p.through is not None:
                    st.give_bounce(p.through)
                    p.through = None
        st.space_changed()

    def abort(self) -> None:
        """Free every staged slot and buffer; idempotent."""
        if self.done:
            return
        self.done = True
        st = self._staging
        for p in self._staged:
            if p.through is None:
                st.release(p.slot)
            else:
                st.give_bounce(p.through)
        self._staged.clear()
        self._sums.clear()
        self._slots_held = 0
        st.rejected()
        st.space_changed()
