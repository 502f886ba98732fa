"""How the LMCache L2 adapter names what LMCache hands it (mapping l2v1, kvstore/integrations/lmcache_l2_mapping.py):
the namespace and page key of each ObjectKey, the runs of a task's keys that share a namespace and object size,
and a chunk's object groups as one bundle (DESIGN.md §4.3, integrations/groups.py). Part of `KVStoreL2Adapter`
(lmcache_l2.py), which supplies the attributes `L2Names` annotates.

Invariant: a key is named from its own fields and its object's (or its layout description's) shapes and
dtypes; a key without a layout takes the last one seen for its (model, kv rank, group), and a key that cannot
be named is a logged miss (namespace None), never an exception into LMCache. No I/O but the log.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.memory_management import MemoryObj

from kvstore.hashing import MAX_NAMESPACE_BYTES
from kvstore.integrations.groups import Run, groups_label, runs
from kvstore.integrations.lmcache_l2_mapping import (
    L2Settings,
    MappingError,
    l2_layout_tag,
    l2_namespace,
    l2_page_key,
    l2_salt_part,
)
from kvstore.integrations.lmcache_mapping import model_part
from kvstore.integrations.remote import RemoteStore


class L2Names:
    """Names for `KVStoreL2Adapter`'s keys; the adapter supplies the attributes annotated here."""

    settings: L2Settings
    store: RemoteStore
    # Last layout tag seen per (model, kv rank, group): for calls that carry no layout (unlock, delete, a lookup
    # with an empty layout description).
    _tags: dict[tuple[str, int, int], str]
    _salts: dict[str, str]  # namespace salt component -> the salt, for usage per salt

    def _grouped(self, keys: Sequence[ObjectKey]) -> tuple[list[int], list[Run]]:
        """The keys of chunks this task carries with one object group (`plain`: the rows above), and the runs of
        chunks it carries with several (each chunk one bundle of its groups)."""
        all_runs = runs(
            [((k.model_name, k.kv_rank, k.cache_salt, bytes(k.chunk_hash)), k.object_group_id) for k in keys]
        )
        plain = [i for r in all_runs if len(r.groups) == 1 for items in r.items for i in items.values()]
        return sorted(plain), [r for r in all_runs if len(r.groups) > 1]

    def _bundle_call(
        self, keys: Sequence[ObjectKey], run: Run, tags: Mapping[int, str]
    ) -> tuple[str, list[bytes]] | None:
        """(namespace, hashes) of a run's bundles: the namespace of its first group's row, then the groups and a
        digest of every group's layout tag; a chunk's hash is its group-0 page key (None: unnamed, logged)."""
        first = keys[run.items[0][run.groups[0]]]
        try:
            base = self._namespace(first, tags[run.groups[0]])
        except MappingError as exc:
            self.store.say("mapping", logging.ERROR, "kvstore L2 adapter: key of model %r cannot be mapped: %s; "
                           "treated as a miss", first.model_name, exc)  # fmt: skip
            return None
        if base is None:
            return None
        digest = hashlib.sha256(";".join(f"{g}={tags[g]}" for g in run.groups).encode()).hexdigest()[:12]
        ns = f"{base}/{groups_label(run.groups)}~{digest}"
        if len(ns.encode()) > MAX_NAMESPACE_BYTES:
            ns = f"{base[: MAX_NAMESPACE_BYTES - 30]}/{hashlib.sha256(ns.encode()).hexdigest()[:24]}"
        hashes = [l2_page_key(k.model_name, k.kv_rank, 0, k.chunk_hash, k.cache_salt)
                  for k in (keys[items[run.groups[0]]] for items in run.items)]  # fmt: skip
        return ns, hashes

    def _runs(
        self,
        keys: Sequence[ObjectKey],
        tag_of: Callable[[ObjectKey], str | None],
        objects: Sequence[MemoryObj] | None = None,
    ) -> Iterator[tuple[str | None, list[int], int]]:
        """(namespace, key indices, object size) of consecutive keys sharing a namespace and object size.
        With objects, the layout comes from each object; else from tag_of(key). A key whose namespace
        cannot be named comes as namespace None (logged)."""
        run: list[int] = []
        cur: tuple[str | None, int] | None = None
        for i, key in enumerate(keys):
            size = 0
            try:
                if objects is not None:
                    obj = objects[i]
                    size = obj.get_size()
                    tag = object_tag(obj)
                else:
                    tag = tag_of(key)
                ns = self._namespace(key, tag)
            except MappingError as exc:
                self.store.say(
                    "mapping",
                    logging.ERROR,
                    "kvstore L2 adapter: key of model %r cannot be mapped: %s; treated as a miss",
                    key.model_name,
                    exc,
                )
                ns = None
            if cur is not None and (ns, size) != cur:
                yield cur[0], run, cur[1]
                run = []
            cur = (ns, size)
            run.append(i)
        if cur is not None:
            yield cur[0], run, cur[1]

    def _namespace(self, key: ObjectKey, tag: str | None) -> str | None:
        if tag is not None:
            self._tags[(key.model_name, key.kv_rank, key.object_group_id)] = tag
        if self.settings.namespace is not None:
            return self.settings.namespace
        if tag is None:
            return None
        if key.cache_salt:
            self._salts.setdefault(l2_salt_part(key.cache_salt), key.cache_salt)
        model = model_part(key.model_name, self.settings.revision_of(key.model_name))
        return _namespace_of(
            self.settings.namespace_prefix, model, key.kv_rank, key.object_group_id, salt=key.cache_salt, layout_tag=tag
        )

    def _desc_tag(self, key: ObjectKey, descs: Mapping[int, MemoryLayoutDesc]) -> str | None:
        desc = descs.get(key.object_group_id) if descs else None
        if desc is not None and desc.shapes:
            return l2_layout_tag([list(s) for s in desc.shapes], [dtype_name(d) for d in desc.dtypes])
        return self._tags.get((key.model_name, key.kv_rank, key.object_group_id))  # no layout given: the last seen

    @staticmethod
    def _hash(key: ObjectKey) -> bytes:
        return l2_page_key(key.model_name, key.kv_rank, key.object_group_id, key.chunk_hash, key.cache_salt)


# Every key of a row maps to the same namespace: validating it once per row, not once per key (bounded).
_namespace_of = functools.lru_cache(maxsize=4096)(l2_namespace)


def object_tag(obj: MemoryObj) -> str:
    """The layout tag of a MemoryObj: its tensors' shapes and dtypes (older objects carry only one)."""
    meta = obj.metadata
    shapes = meta.shapes if meta.shapes else [meta.shape]
    dtypes = meta.dtypes if meta.dtypes else [meta.dtype]
    return l2_layout_tag([list(s) for s in shapes], [dtype_name(d) for d in dtypes])


def desc_bytes(desc: MemoryLayoutDesc) -> int:
    """Bytes of one object of a layout description (0 when it names none or a dtype of unknown size)."""
    total = 0
    for shape, dtype in zip(desc.shapes or (), desc.dtypes or (), strict=False):
        n = int(getattr(dtype, "itemsize", 0))
        for dim in shape:
            n *= int(dim)
        total += n
    return total


def dtype_name(d: object) -> str:
    """`torch.bfloat16` -> "bfloat16" (any dtype, without importing torch here)."""
    return str(d).removeprefix("torch.")
