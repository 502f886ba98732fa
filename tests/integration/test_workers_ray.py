"""Disaggregated prefill/decode on a real local Ray, a real cache node and a real redis-server."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from devkit.hf import CheckpointWriter, TinyLlamaSpec, hf_reference_logits, load_hf_oracle, make_tiny_llama
from kvstore.client import KVStoreClient
from kvstore.integrations.hints import SessionHints
from kvstore.names import RetainMode, TierKind
from kvstore.pageformat import slot_bytes_for
from workers.loader import load_model
from workers.model import CacheConfig, PagedLlama
from workers.runtime import LocalStack, StackConfig

BLOCK = 8
SPEC = TinyLlamaSpec(hidden=64, layers=2, heads=4, kv_heads=2, vocab=512, seed=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny", SPEC, writer=CheckpointWriter.SAFETENSORS)


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    cfg = StackConfig(model_dir=str(model_dir), block_size=BLOCK, num_blocks=512, torch_threads=1,
                      run_dir=str(tmp_path_factory.mktemp("run")))  # fmt: skip
    slot = slot_bytes_for(LocalStack.page_bytes(cfg))
    cfg.dram_bytes, cfg.nvme_bytes = 12 * slot, 256 * slot  # small DRAM: older pages go to NVMe
    with LocalStack(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> PagedLlama:
    return load_model(model_dir, cache=CacheConfig(block_size=BLOCK, num_blocks=512))


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> object:
    """transformers' LlamaForCausalLM: the outside oracle."""
    return load_hf_oracle(model_dir)


def oracle_agrees(oracle: object, prompt: list[int], tokens: list[int]) -> bool:
    """transformers' own greedy run gives `tokens`: every teacher-forced row's argmax is the next token."""
    logits = hf_reference_logits(oracle, prompt, tokens)  # type: ignore[arg-type]
    return [int(x) for x in logits.argmax(-1)] == tokens


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, SPEC.vocab) for _ in range(n)]


def test_pd_matches_single_process_token_for_token(stack: LocalStack, reference: PagedLlama, oracle: object) -> None:
    rng = random.Random(0)
    system = prompt(rng, 5 * BLOCK + 3)
    prompts = [system + prompt(rng, k) for k in (1, 7, BLOCK, 2 * BLOCK + 5)] + [prompt(rng, 3), system]
    for i, p in enumerate(prompts):
        r = stack.generate(f"eq-{i}", p, 12)
        assert r.tokens == list(reference.greedy_generate(p, 12).tokens), f"prompt {i}"
    # The shared system prompt was computed once: later prompts fetched it.
    again = stack.generate("eq-again", [*system, 5, 6, 7], 16)
    assert again.cached_blocks == len(system) // BLOCK and again.cached_tiers.get("dram") == again.cached_blocks
    assert again.tokens == list(reference.greedy_generate([*system, 5, 6, 7], 16).tokens)
    assert oracle_agrees(oracle, [*system, 5, 6, 7], again.tokens)  # pages from DRAM, tokens as transformers


def test_node_restart_between_requests_loses_nothing_on_nvme(stack: LocalStack, reference: PagedLlama,
                                                             oracle: object) -> None:  # fmt: skip
    rng = random.Random(1)
    p = prompt(rng, 6 * BLOCK + 1)
    first = stack.generate("rs-0", p, 6)
    filler = [prompt(rng, 4 * BLOCK + 1) for _ in range(4)]  # push p's pages down to NVMe
    for i, f in enumerate(filler):
        stack.generate(f"rs-fill-{i}", f, 1)
    with KVStoreClient(stack.node.addr) as kv:  # type: ignore[union-attr]
        on_nvme = sum(t.pages for t in kv.stats().tiers if t.tier is TierKind.NVME)
    assert on_nvme > 0
    stack.node.kill()  # type: ignore[union-attr]  # a crash: DRAM is lost, NVMe is not
    stack.node.start()  # type: ignore[union-attr]
    again = stack.generate("rs-1", p, 32)
    assert again.tokens[:6] == first.tokens == list(reference.greedy_generate(p, 6).tokens)
    assert again.cached_blocks >= 1 and again.cached_tiers.get("nvme", 0) >= 1  # pages came back from NVMe
    assert oracle_agrees(oracle, p, again.tokens)  # 32 tokens as transformers, with NVMe-served pages


def test_pages_evicted_between_prefill_and_decode_fall_back_to_recompute(
    stack: LocalStack, reference: PagedLlama
) -> None:
    rng = random.Random(2)
    p = prompt(rng, 4 * BLOCK + 2)
    router = stack.router
    prefill_worker = ray.get(router.__ray_call__.remote(lambda self: self.prefill[0]))  # type: ignore[attr-defined]
    decode_worker = ray.get(router.__ray_call__.remote(lambda self: self.decode[0]))  # type: ignore[attr-defined]
    steps = list(prefill_worker.prefill.options(num_returns="streaming").remote("ev-0", p))
    pre = ray.get(steps[-1])
    assert pre.stored_blocks == 4
    with KVStoreClient(stack.node.addr) as kv:  # type: ignore[union-attr]
        assert kv.delete(stack.namespace, pre.block_hashes).deleted == 4  # "evicted" before decode runs
    tokens = [ray.get(ref) for ref in decode_worker.generate.options(num_returns="streaming").remote("ev-0", p, pre, 8)]
    stats = ray.get(decode_worker.pop_stats.remote("ev-0"))
    assert stats.fetched_blocks == 0 and stats.recomputed_tokens == len(p)
    assert tokens == list(reference.greedy_generate(p, 8).tokens)


def test_kvstore_generate_cli(model_dir: Path, reference: PagedLlama) -> None:
    ids = list(range(3, 3 + 2 * BLOCK + 5))
    out = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "generate", "--model", str(model_dir),
                          "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "5", "--block-size",
                          str(BLOCK), "--json"], capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["tokens"] == list(reference.greedy_generate(ids, 5).tokens)
    assert {"lookup_s", "fetch_s", "prefill_s", "ttft_s", "decode_s"} <= set(res["timings"])


def test_a_conversations_pages_are_retained_resumed_and_released(stack: LocalStack) -> None:
    """A session id per conversation (DESIGN.md §6.5): the prefill worker retains its prompt's pages, the
    router resumes them when its next turn arrives, and ending the conversation releases them."""
    assert stack.node is not None
    rng = random.Random(7)
    turn1 = prompt(rng, 4 * BLOCK + 2)
    hints = SessionHints("conv-ray", ttl_s=120, priority=70, mode=RetainMode.DEMOTE)
    r1 = stack.generate("s-1", turn1, 4, session=hints)
    assert r1.retained_on == ["node-0"]
    with KVStoreClient(stack.node.addr, timeout=30) as kv:
        state = kv.update_session("conv-ray").state
        assert state is not None and state.pages == len(turn1) // BLOCK and state.mode is RetainMode.DEMOTE
        turn2 = turn1 + r1.tokens + prompt(rng, BLOCK)  # the conversation so far, and the user's next message
        before = kv.stats().retention.calls
        r2 = stack.generate("s-2", turn2, 4, session=hints)
        assert r2.cached_blocks >= len(turn1) // BLOCK  # the first turn's pages, found again
        state = kv.update_session("conv-ray").state
        assert state is not None and state.pages == len(turn2) // BLOCK
        assert kv.stats().retention.calls >= before + 2  # the resume, and the second turn's retain
        assert stack.end_session("conv-ray") == ["node-0"]
        deadline = time.monotonic() + 20
        while kv.stats().retention.sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        r = kv.stats().retention
        assert (r.sessions, r.retained_pages) == (0, 0) and r.ended >= 1
