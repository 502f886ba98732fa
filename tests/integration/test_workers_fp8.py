"""An fp8 deployment on a real local Ray, a real cache node and a real redis-server: the workers quantize
on Put and dequantize on fetch (torch references on CPU), the node stores half-size pages in a namespace
of their own, and the tokens are exactly those of the same model fed the same pages through the codec in
one process (devkit/kv_quality.py), so the P/D path adds nothing to the fp8 error."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.hf import CheckpointWriter, TinyLlamaSpec, make_tiny_llama
from devkit.kv_quality import prefix_pages, through
from kvstore.client import KVStoreClient
from kvstore.layout import PageEncoding
from kvstore.pageformat import slot_bytes_for
from workers.loader import load_model
from workers.model import CacheConfig, PagedLlama
from workers.page_codec import PageCodec
from workers.runtime import LocalStack, StackConfig

BLOCK = 8
SPEC = TinyLlamaSpec(hidden=64, layers=2, heads=4, kv_heads=2, vocab=512, seed=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny", SPEC, writer=CheckpointWriter.SAFETENSORS)


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    cfg = StackConfig(model_dir=str(model_dir), block_size=BLOCK, num_blocks=512, torch_threads=1,
                      run_dir=str(tmp_path_factory.mktemp("run")), kv_encoding="fp8")  # fmt: skip
    slot = slot_bytes_for(LocalStack.page_bytes(cfg))
    cfg.dram_bytes, cfg.nvme_bytes = 64 * slot, 64 * slot
    with LocalStack(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> PagedLlama:
    return load_model(model_dir, cache=CacheConfig(block_size=BLOCK, num_blocks=512))


def expected_tokens(model: PagedLlama, prompt: list[int], n: int) -> list[int]:
    """A request whose whole usable prefix comes from the cache, in fp8: prefix pages through the codec,
    the rest of the prompt computed, greedy decode."""
    pages = through(PageCodec(model.page_layout(), PageEncoding.FP8_E4M3), prefix_pages(model, prompt))
    return list(model.greedy_generate(prompt, n, prefix_pages=pages).tokens)


def test_fp8_pages_through_prefill_and_decode(stack: LocalStack, reference: PagedLlama) -> None:
    assert stack.namespace.endswith(f"/tp1/b{BLOCK}/fp8-e4m3")  # block size and encoding named (namespace_for)
    rng = random.Random(5)
    p = [rng.randrange(3, SPEC.vocab) for _ in range(5 * BLOCK + 3)]
    first = stack.generate("fp8-0", p, 10)
    assert first.cached_blocks == 0 and first.decode_fetched_blocks == 5  # the decode worker read fp8 pages
    assert first.tokens[0] == reference.greedy_generate(p, 1).tokens[0]  # prefill's own KV is not quantized
    again = stack.generate("fp8-1", p, 10)
    assert again.cached_blocks == 5  # the whole usable prefix, dequantized by the prefill worker
    assert again.tokens == expected_tokens(reference, p, 10)

    with KVStoreClient(stack.node.addr) as kv:  # type: ignore[union-attr]
        st = kv.stats()
    ((_, layout, pages),) = [n for n in st.namespaces if n[0] == stack.namespace]
    assert layout.encoding is PageEncoding.FP8_E4M3 and pages == 5
    raw_bytes = reference.page_layout().page_bytes
    assert layout.page_bytes <= raw_bytes // 4 + 64  # fp32 model: a quarter of the bytes, plus the scales


def test_kv_encoding_flag_is_checked_before_anything_starts(model_dir: Path) -> None:
    """`--kv-encoding` takes raw or fp8 (the fp8 path itself: the stack above, `kvstore up --values` in
    tests/integration/test_up_values.py); anything else is a usage error naming the flag."""
    bad = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "generate", "--model", str(model_dir),
                          "--prompt-ids", "1,2,3", "--kv-encoding", "int4"],
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert bad.returncode == 2 and "kv-encoding" in bad.stderr and "redis" not in bad.stdout
