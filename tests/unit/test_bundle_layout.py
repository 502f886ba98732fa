"""A bundle's layout (kvstore/layout.py) and the door's grouping of a hybrid model's parts (integrations/groups.py):
pure rules, pinned here (DESIGN.md §4.3)."""

from __future__ import annotations

import pytest

from kvstore.client.bundles import gather, part_regions, scatter
from kvstore.integrations.groups import groups_label, runs
from kvstore.layout import DType, PageEncoding, PageLayout, PagePart, bundle_difference, unpack_part_table

KV = PageLayout(DType.FLOAT16, 2, 2, 8, 4)  # 512 B
STATE = PageLayout(DType.UINT8, 1, 1, 50, 1)  # 100 B


def test_a_bundle_packs_to_twenty_bytes_that_name_its_parts_by_digest() -> None:
    b = PageLayout.bundle({"kv": KV, "mamba": STATE}, block_size=4)
    assert b.encoding is PageEncoding.BUNDLE and b.page_bytes == 612 and len(b.pack()) == 20
    back = PageLayout.unpack(b.pack())
    assert back == b and hash(back) == hash(b) and not back.has_parts  # a header's copy: equal, names unknown
    assert unpack_part_table(b.part_table()) == b.parts
    other = PageLayout.bundle({"kv": KV, "swa": STATE}, block_size=4)  # same sizes, another name
    assert other != b and other.pack() != b.pack()
    assert b.part_spans() == {"kv": (0, 512), "mamba": (512, 100)}


def test_bundle_difference_names_the_part() -> None:
    b = PageLayout.bundle({"kv": KV, "mamba": STATE}, 4)
    assert bundle_difference(b, b) is None
    assert "'swa'" in (bundle_difference(b, PageLayout.bundle({"kv": KV, "swa": STATE}, 4)) or "")
    assert "'mamba' is missing" in (bundle_difference(b, PageLayout.bundle({"kv": KV}, 4)) or "")
    bigger = PageLayout.bundle({"kv": KV, "mamba": PageLayout(DType.UINT8, 1, 1, 51, 1)}, 4)
    assert "'mamba'" in (bundle_difference(b, bigger) or "")
    assert "order" in (bundle_difference(b, PageLayout.bundle({"mamba": STATE, "kv": KV}, 4)) or "")


@pytest.mark.parametrize(
    "make",
    [
        lambda: PageLayout.bundle({}, 1),
        lambda: PageLayout.bundle({"kv": KV, "in ner": STATE}, 1),
        lambda: PageLayout.bundle([PagePart("kv", KV), PagePart("kv", STATE)], 1),
        lambda: PagePart("b", PageLayout.bundle({"kv": KV}, 1)),
        lambda: PageLayout(DType.FLOAT16, 2, 2, 8, 4, parts=(PagePart("kv", KV),)),
    ],
)
def test_bad_bundles_are_refused(make: object) -> None:
    with pytest.raises(ValueError):
        make()  # type: ignore[operator]


def test_parts_gather_and_scatter_exactly_and_bad_parts_are_named() -> None:
    b = PageLayout.bundle({"kv": KV, "mamba": STATE}, 4)
    src = {"kv": [bytes(range(256)), bytes(range(256))], "mamba": bytes(100 * [7])}
    page = bytearray(b.page_bytes)
    gather(part_regions(b, [src], writable=False)[0], memoryview(page))
    assert bytes(page) == bytes(range(256)) * 2 + bytes(100 * [7])
    dst = {"kv": bytearray(512), "mamba": bytearray(100)}
    scatter(memoryview(page), part_regions(b, [dst], writable=True)[0])
    assert bytes(dst["kv"]) == bytes(range(256)) * 2 and bytes(dst["mamba"]) == bytes(100 * [7])
    with pytest.raises(ValueError, match=r"pages\[0\]\['mamba'\]: missing"):
        part_regions(b, [{"kv": bytearray(512)}], writable=True)
    with pytest.raises(ValueError, match=r"pages\[0\]\['swa'\]: the bundle has no such part"):
        part_regions(b, [{**dst, "swa": bytearray(1)}], writable=True)
    with pytest.raises(ValueError, match="overlap"):
        shared = bytearray(612)
        part_regions(b, [{"kv": memoryview(shared)[:512], "mamba": memoryview(shared)[500:600]}], writable=True)


def test_runs_cut_a_calls_items_into_chunks_with_the_same_groups() -> None:
    items = [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("c", 0)]  # group-major; chunk c carries group 0 only
    got = runs(items)
    assert [(r.groups, r.chunks, r.items) for r in got] == [
        ((0, 1), ["a", "b"], [{0: 0, 1: 2}, {0: 1, 1: 3}]),
        ((0,), ["c"], [{0: 4}]),
    ]
    assert groups_label((0, 1)) == "g0+g1"
