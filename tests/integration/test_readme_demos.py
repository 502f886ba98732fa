"""The README's demos and its Python snippet, run as a new user runs them.

- `./dev demo` is `./dev setup` and then `kvstore pd-demo`: Redis, a node and Ray prefill/decode workers
  serving a multi-turn chat; run here through the installed `kvstore` script (fewer generated tokens).
- `.venv/bin/kvstore demo`: the cache-node-only demo.
- The client snippet under "Using it": executed as written against a real node (the address and the
  `token_ids` / `new_pages` it leaves to the reader filled in), twice: a cold prompt, then the same prompt,
  whose pages must then come back as the bytes put.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from devkit.readme import blocks
from kvstore.cli.launch import NodeProcess
from kvstore.pageformat import slot_bytes_for

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}


def kvstore(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "kvstore"
    return subprocess.run([str(script), *args], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout, check=False, stdin=subprocess.DEVNULL)  # fmt: skip


def test_dev_demo_runs_the_pd_demo_through_the_cache() -> None:
    r = kvstore("pd-demo", "--max-new-tokens", "2", timeout=800)
    assert r.returncode == 0, f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert "demo finished" in r.stdout and "kvctl stats" in r.stdout
    # Later turns share system prompts and history with earlier ones: some prompt tokens came from the cache.
    assert "dram:" in r.stdout or "nvme:" in r.stdout, r.stdout[-4000:]


def test_kvstore_demo_runs() -> None:
    r = kvstore("demo", timeout=600)
    assert r.returncode == 0, f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}"


def test_the_client_snippet_runs_as_written(tmp_path: Path) -> None:
    snippet = next(b.text for b in blocks() if b.lang == "python" and "KVStoreClient" in b.text)  # the first
    assert 'KVStoreClient("127.0.0.1:50051")' in snippet
    from kvstore.layout import DType, PageLayout

    layout = PageLayout(DType.BFLOAT16, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)  # the snippet's
    slot = slot_bytes_for(layout.page_bytes)
    with NodeProcess(dram_bytes=8 * slot, max_page_bytes=layout.page_bytes, log_path=tmp_path / "node.log") as node:
        code = compile(snippet.replace("127.0.0.1:50051", node.addr), "README.md", "exec")
        token_ids = [random.Random(1).randrange(32000) for _ in range(3 * 16 + 5)]
        pages = [random.Random(i).randbytes(layout.page_bytes) for i in range(3)]
        first: dict[str, object] = {"token_ids": token_ids, "new_pages": pages}
        exec(code, first)
        assert first["hit"] == 0 and first["cached"] == []
        again: dict[str, object] = {"token_ids": token_ids, "new_pages": []}
        exec(code, again)
        assert again["hit"] == 3
        assert [bytes(p) for p in again["cached"]] == pages  # type: ignore[attr-defined]


def test_the_retention_snippet_runs_as_written(tmp_path: Path) -> None:
    """The README's client retention example, every call of it, against a real node holding `hashes`."""
    (snippet,) = [b.text for b in blocks() if b.lang == "python" and "kv.retain(" in b.text]
    from kvstore.client import KVStoreClient
    from kvstore.layout import DType, PageLayout

    layout = PageLayout(DType.FLOAT16, num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
    slot = slot_bytes_for(layout.page_bytes)
    hashes = [random.Random(i).randbytes(32) for i in range(8)]
    with NodeProcess(dram_bytes=64 * slot, max_page_bytes=layout.page_bytes, log_path=tmp_path / "node.log") as node:
        with KVStoreClient(node.addr) as kv:
            kv.put("my-ns", layout, hashes, [bytes(layout.page_bytes)] * len(hashes))
        scope: dict[str, object] = {"hashes": hashes}
        exec(compile(snippet.replace("127.0.0.1:50051", node.addr), "README.md", "exec"), scope)
        with KVStoreClient(node.addr) as kv:
            assert kv.lookup("my-ns", hashes) == len(hashes)  # the session ended; its pages stay cached
