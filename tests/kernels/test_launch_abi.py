"""The launchers' kernel arguments match the CUDA signatures, checked on CPU without CuPy.

A kernel argument of the wrong width (a Python int where the kernel takes `long long`, a missing
stride) shifts every later argument and fails silently on the GPU. Here the launchers in kernels.cuda
run against a recording stand-in for CuPy, and every launch is compared, argument by argument, with
the parameter list parsed from the .cu source: tensors for pointers, numpy.int32 for `int`,
numpy.int64 for `long long`, numpy.float32 for `float`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kernels import cuda
from tests.kernels._cases import make_attention_case, make_caches, make_fp8_pages


@dataclass
class Launch:
    filename: str
    name: str
    grid: tuple[int, ...]
    block: tuple[int, ...]
    args: tuple[Any, ...]
    shared_mem: int


@dataclass
class Recorder:
    launches: list[Launch] = field(default_factory=list)

    def launcher(self, device: torch.device) -> Any:
        recorder = self

        class FakeLauncher:
            index = 0

            def __call__(
                self, filename: str, name: str, grid: Any, block: Any, args: Any, *, shared_mem: int = 0
            ) -> None:
                recorder.launches.append(Launch(filename, name, tuple(grid), tuple(block), tuple(args), shared_mem))

        return FakeLauncher()


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(cuda, "_Launcher", rec.launcher)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(multi_processor_count=132))
    return rec


def kernel_params(filename: str, name: str) -> list[str]:
    """Parameter kinds of a kernel template in a .cu file: 'ptr', 'int', 'long long' or 'float'."""
    base = re.sub(r"^.*::|<.*$", "", name)  # "kvstore::foo<T, 4>" -> "foo"
    source = (cuda.KERNEL_DIR / filename).read_text()
    match = re.search(rf"\b{base}\(\s*(.*?)\)\s*\{{", source, flags=re.S)
    assert match, f"{base} not found in {filename}"
    params = re.sub(r"//[^\n]*", "", match.group(1))
    kinds = []
    for param in (p.strip() for p in params.split(",")):
        if "*" in param:
            kinds.append("ptr")
        elif "long long" in param:
            kinds.append("long long")
        elif re.search(r"\bint\b", param):
            kinds.append("int")
        elif re.search(r"\bfloat\b", param):
            kinds.append("float")
        else:
            raise AssertionError(f"unexpected parameter {param!r} of {base}")
    return kinds


KIND_OF = {np.int32: "int", np.int64: "long long", np.float32: "float"}


def check_launch(launch: Launch) -> None:
    assert launch.name in cuda.all_kernel_names()[launch.filename]
    expected = kernel_params(launch.filename, launch.name)
    got = ["ptr" if isinstance(a, torch.Tensor) else KIND_OF.get(type(a), type(a).__name__) for a in launch.args]
    assert got == expected, launch.name
    assert all(1 <= g < 2**31 for g in launch.grid) and len(launch.grid) == 3
    assert launch.block[0] % 32 == 0


def test_decode_single_pass_and_split(recorder: Recorder) -> None:
    case = make_attention_case([5, 300], num_kv_heads=2, group=4, head_dim=128, block_size=16, dtype=torch.float16)
    cuda.paged_attention_decode(*case.args(), scale=case.scale, max_seq_len=300, partition_size=None)
    cuda.paged_attention_decode(*case.args(), scale=case.scale, max_seq_len=300, partition_size=64)
    names = [launch.name for launch in recorder.launches]
    assert names == [
        "kvstore::paged_attention_decode_kernel<__half, 128, 4>",  # 2 seqs x 2 tiles: too short to split
        "kvstore::paged_attention_decode_kernel<__half, 128, 4>",
        "kvstore::paged_attention_reduce_kernel<__half>",
    ]
    single, split, reduce = recorder.launches
    assert single.grid == (2, 2, 1) and split.grid == (2, 2, 5) and reduce.grid == (8, 2, 1)
    assert reduce.shared_mem == 4 * 5
    for launch in recorder.launches:
        check_launch(launch)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_reshape_and_cache(recorder: Recorder, slot_dtype: torch.dtype) -> None:
    key_cache, value_cache = make_caches(1, 4, 16, 2, 64, torch.bfloat16, seed=0)[0]
    key = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    cuda.reshape_and_cache(key, key.clone(), key_cache, value_cache, torch.tensor([0, 5, -1], dtype=slot_dtype))
    (launch,) = recorder.launches
    assert launch.grid == (3, 1, 1)
    check_launch(launch)
    assert launch.args[5] == 2 * 64 * 2 // 16  # row of 2 heads x 64 bf16 in 16-byte units


def test_gather_and_scatter(recorder: Recorder) -> None:
    caches = make_caches(3, 5, 16, 2, 64, torch.float32, seed=0)
    ids = torch.tensor([4, 0], dtype=torch.int64)
    pages = torch.empty(2, 3, 2, 16, 2, 64)
    cuda.gather_pages(caches, ids, pages)
    cuda.scatter_pages(pages, caches, ids)
    gather, scatter = recorder.launches
    assert gather.grid == (2 * 6, 1, 1) and scatter.grid == (2 * 6, 1, 1)
    table = gather.args[1]
    assert table.tolist() == [t.data_ptr() for pair in caches for t in pair]  # K0, V0, K1, V1, ...
    for launch in recorder.launches:
        check_launch(launch)


def test_fp8(recorder: Recorder) -> None:
    pages = make_fp8_pages((2, 3, 2, 16, 4, 64), torch.float16, seed=0)
    q = torch.empty(pages.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty((2, 3, 2, 4), dtype=torch.float32)
    cuda.quantize_fp8(pages, q, scales)
    cuda.dequantize_fp8(q, scales, torch.bfloat16)
    quant, dequant = recorder.launches
    assert quant.grid == (2 * 3 * 2 * 4, 1, 1)
    assert quant.args[3:6] == (3 * 2 * 16 * 4 * 64, 3 * 2 * 4, 3 * 2)  # page strides, planes per page
    assert dequant.args[3] == pages.numel() // cuda.FP8_GROUP
    for launch in recorder.launches:
        check_launch(launch)


def test_fp8_packed_pages(recorder: Recorder) -> None:
    """Views into packed encoded pages pass their page strides (bytes for q, floats for the scales)."""
    pages = make_fp8_pages((2, 3, 2, 16, 4, 64), torch.float16, seed=0)
    page_bytes, values_at = 48 + 3 * 2 * 16 * 4 * 64 + 16, 48
    packed = torch.zeros((2, page_bytes), dtype=torch.uint8)
    q = packed[:, values_at : values_at + pages[0].numel()].view(torch.float8_e4m3fn).view(pages.shape)
    scales = packed[:, : 3 * 2 * 4 * 4].view(torch.float32).view(2, 3, 2, 4)
    cuda.quantize_fp8(pages, q, scales)
    cuda.dequantize_fp8(q, scales, torch.float16)
    quant, dequant = recorder.launches
    assert quant.args[3:5] == (page_bytes, page_bytes // 4)
    assert dequant.args[4:6] == (page_bytes, page_bytes // 4)
    for launch in recorder.launches:
        check_launch(launch)
