"""Bad inputs fail with TypeError / ValueError naming the argument, before any kernel runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import kernels
from tests.kernels._cases import AttentionCase, make_attention_case, make_caches


def _case() -> AttentionCase:
    return make_attention_case([5, 17], num_kv_heads=2, group=2, head_dim=64, block_size=8, dtype=torch.float16)


def _call(case: AttentionCase, **changes: Any) -> Callable[[], object]:
    fields: dict[str, Any] = dict(
        zip(("query", "key_cache", "value_cache", "block_tables", "seq_lens"), case.args(), strict=True)
    )
    fields["scale"] = case.scale
    fields.update(changes)
    return lambda: kernels.paged_attention_decode(**fields)


ATTENTION_ERRORS: list[tuple[str, Callable[[AttentionCase], dict[str, Any]], type[Exception], str]] = [
    ("query not a tensor", lambda c: {"query": c.query.tolist()}, TypeError, "query must be a torch.Tensor"),
    ("int query", lambda c: {"query": c.query.int()}, TypeError, "query must have dtype"),
    ("cache dtype differs", lambda c: {"key_cache": c.key_cache.float()}, TypeError, "key_cache has dtype"),
    ("int64 block table", lambda c: {"block_tables": c.block_tables.long()}, TypeError, "block_tables must have dtype"),
    ("float seq_lens", lambda c: {"seq_lens": c.seq_lens.float()}, TypeError, "seq_lens must have dtype"),
    ("non-contiguous query", lambda c: {"query": c.query.transpose(0, 1).contiguous().transpose(0, 1)}, ValueError, "query must be contiguous"),
    ("non-contiguous cache", lambda c: {"value_cache": c.value_cache[:, ::2]}, ValueError, "value_cache must be contiguous"),
    ("2-D query", lambda c: {"query": c.query[0]}, ValueError, "query must be 3-D"),
    ("value shape differs", lambda c: {"value_cache": c.value_cache[:-1].contiguous()}, ValueError, "value_cache has shape"),
    ("head_dim differs", lambda c: {"query": c.query[..., :32].contiguous()}, ValueError, "head_dim"),
    ("heads not a multiple", lambda c: {"query": c.query[:, :3].contiguous()}, ValueError, "multiple of key_cache num_kv_heads"),
    ("table rows", lambda c: {"block_tables": c.block_tables[:1].contiguous()}, ValueError, "block_tables has 1 rows"),
    ("seq_lens entries", lambda c: {"seq_lens": c.seq_lens[:1].contiguous()}, ValueError, "seq_lens has 1 entries"),
    ("length past table", lambda c: {"seq_lens": torch.tensor([5, 10_000], dtype=torch.int32)}, ValueError, r"seq_lens\[1\]"),
    ("negative length", lambda c: {"seq_lens": torch.tensor([-1, 17], dtype=torch.int32)}, ValueError, r"seq_lens\[0\]"),
    ("block id out of range", lambda c: {"block_tables": c.block_tables.clone().fill_(99)}, ValueError, r"block_tables\[0\] uses block ids"),
    ("scale NaN", lambda c: {"scale": float("nan")}, ValueError, "scale must be finite"),
    ("scale tensor", lambda c: {"scale": torch.tensor(0.1)}, TypeError, "scale must be a float"),
    ("scale bool", lambda c: {"scale": True}, TypeError, "scale must be a float"),
    ("partition 0", lambda c: {"partition_size": 0}, ValueError, "partition_size must be >= 1"),
    ("partition float", lambda c: {"partition_size": 2.5}, TypeError, "partition_size must be an int"),
    ("max_seq_len too small", lambda c: {"max_seq_len": 6}, ValueError, "exceeds max_seq_len"),
    ("device mismatch", lambda c: {"seq_lens": c.seq_lens.to("meta")}, ValueError, "seq_lens is on meta"),
]  # fmt: skip


@pytest.mark.parametrize(("label", "change", "error", "match"), ATTENTION_ERRORS, ids=[e[0] for e in ATTENTION_ERRORS])
def test_attention_rejects(
    label: str, change: Callable[[AttentionCase], dict[str, Any]], error: type[Exception], match: str
) -> None:
    case = _case()
    with pytest.raises(error, match=match):
        _call(case, **change(case))()


def _cache_args() -> dict[str, torch.Tensor]:
    key_cache, value_cache = make_caches(1, 4, 8, 2, 64, torch.float16, seed=0)[0]
    key = torch.zeros(3, 2, 64, dtype=torch.float16)
    return {
        "key": key,
        "value": key.clone(),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "slot_mapping": torch.tensor([0, 9, -1]),
    }


RESHAPE_ERRORS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("float slots", {"slot_mapping": torch.tensor([0.0, 1.0, 2.0])}, TypeError, "slot_mapping must have dtype"),
    ("value dtype", {"value": torch.zeros(3, 2, 64)}, TypeError, "value has dtype"),
    ("key heads", {"key": torch.zeros(3, 1, 64, dtype=torch.float16), "value": torch.zeros(3, 1, 64, dtype=torch.float16)}, ValueError, "key has shape"),
    ("slot count", {"slot_mapping": torch.tensor([0, 1])}, ValueError, "slot_mapping has 2 entries"),
    ("slot out of range", {"slot_mapping": torch.tensor([0, 32, 1])}, ValueError, "slots must be < num_blocks x block_size = 32"),
    ("non-contiguous key", {"key": torch.zeros(3, 64, 2, dtype=torch.float16).transpose(1, 2)}, ValueError, "key must be contiguous"),
]  # fmt: skip


@pytest.mark.parametrize(("label", "changes", "error", "match"), RESHAPE_ERRORS, ids=[e[0] for e in RESHAPE_ERRORS])
def test_reshape_and_cache_rejects(label: str, changes: dict[str, Any], error: type[Exception], match: str) -> None:
    args = _cache_args() | changes
    with pytest.raises(error, match=match):
        kernels.reshape_and_cache(**args)


def test_page_copies_reject_bad_ids_and_shapes() -> None:
    caches = make_caches(2, 4, 8, 2, 64, torch.float32, seed=0)
    for ids in ([4], [-1], torch.tensor([0, 7])):
        with pytest.raises(ValueError, match=r"block_ids must lie in \[0, 4\)"):
            kernels.gather_pages(caches, ids)
    with pytest.raises(TypeError, match="block_ids must have dtype"):
        kernels.gather_pages(caches, torch.tensor([0.0]))
    with pytest.raises(TypeError, match="block_ids must be"):
        kernels.gather_pages(caches, [0, "1"])
    with pytest.raises(TypeError, match="kv_caches must be a non-empty list"):
        kernels.gather_pages([], [0])
    with pytest.raises(TypeError, match=r"kv_caches\[1\] must be a \(key_cache, value_cache\) pair"):
        kernels.gather_pages([caches[0], caches[1][0]], [0])
    with pytest.raises(ValueError, match=r"kv_caches\[1\]\[0\] has shape"):
        kernels.gather_pages([caches[0], (caches[1][0][:2].contiguous(), caches[1][1])], [0])
    with pytest.raises(TypeError, match=r"kv_caches\[0\]\[1\] has dtype"):
        kernels.gather_pages([(caches[0][0], caches[0][1].half())], [0])
    with pytest.raises(ValueError, match="out has shape"):
        kernels.gather_pages(caches, [0], out=torch.empty(2, 2, 2, 8, 2, 64))

    pages = kernels.gather_pages(caches, [1, 2])
    with pytest.raises(ValueError, match="pages has shape"):
        kernels.scatter_pages(pages, caches, [1])
    with pytest.raises(ValueError, match=r"block_ids must lie in \[0, 4\)"):
        kernels.scatter_pages(pages, caches, [1, 4])
    with pytest.raises(TypeError, match="pages has dtype"):
        kernels.scatter_pages(pages.half(), caches, [1, 2])
    with pytest.raises(ValueError, match="pages must be contiguous"):
        kernels.scatter_pages(pages.transpose(0, 1).contiguous().transpose(0, 1), caches, [1, 2])


def test_fp8_rejects_bad_input() -> None:
    pages = torch.zeros(2, 1, 2, 8, 2, 64, dtype=torch.float16)
    with pytest.raises(TypeError, match="pages must have dtype"):
        kernels.quantize_fp8(pages.int())
    with pytest.raises(ValueError, match="pages must be 6-D"):
        kernels.quantize_fp8(pages[0])
    with pytest.raises(ValueError, match="pages must be"):
        kernels.quantize_fp8(torch.zeros(2, 1, 3, 8, 2, 64))
    q, scales = kernels.quantize_fp8(pages)
    with pytest.raises(TypeError, match="q must have dtype"):
        kernels.dequantize_fp8(q.float(), scales)
    with pytest.raises(ValueError, match="scales has shape"):
        kernels.dequantize_fp8(q, scales[:1].contiguous())
    with pytest.raises(TypeError, match="scales must have dtype"):
        kernels.dequantize_fp8(q, scales.double())
    with pytest.raises(TypeError, match="dtype must be float16, bfloat16 or float32"):
        kernels.dequantize_fp8(q, scales, torch.int8)
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype"):
        kernels.dequantize_fp8(q, scales, "float16")  # type: ignore[arg-type]
