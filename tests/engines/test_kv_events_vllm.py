"""The node's KV events decoded by vLLM 0.32's own classes (`vllm.distributed.kv_events.KVEventBatch`).

A subscriber in the vLLM venv (devkit/kv_events_sub.py --classes vllm, a subprocess) follows a node while
pages are stored, demoted to NVMe, promoted back and deleted; what it decodes must replay to what the node
holds, with vLLM's medium names, and hashes in both formats (32-byte keys, u64) must decode.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from devkit.engines import REPO as ROOT
from devkit.engines import engine_env
from devkit.kv_events_sub import replay_state
from kvstore.client import KVStoreClient
from kvstore.hashing import prefix_hashes
from kvstore.node.kv_events import MEDIUM, topic_of
from tests.integration.conftest import LAYOUT, NS, page, start_node

SUB = ROOT / "devkit" / "kv_events_sub.py"


def subscribe(python: Path, endpoints: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen([str(python), str(SUB), *endpoints, "--classes", "vllm", "--seconds", "120",
                             "--until-quiet", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=engine_env(), cwd=ROOT)  # fmt: skip
    assert proc.stdout is not None
    first = proc.stdout.readline()  # the subscriber is connected once it says so (vLLM imported by then)
    assert json.loads(first or "{}").get("ready"), proc.stderr.read() if proc.stderr else first
    return proc


def collect(proc: subprocess.Popen[str]) -> list[dict[str, Any]]:
    try:
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err[-3000:]
    return [json.loads(ln) for ln in out.splitlines() if ln.strip()]


def churn(kv: KVStoreClient, wire: Any) -> dict[Any, set[str]]:
    """Store 10 pages into 6 DRAM slots (demotions), read 3 (promotions), delete 1; what the node holds."""
    hashes = prefix_hashes(list(range(16 * 10)), 16, NS)
    kv.put(NS, LAYOUT, hashes, [page(h) for h in hashes])
    kv.get(NS, hashes[:3])
    kv.delete(NS, hashes[-1:])
    truth = {}
    for h in hashes:
        res = kv.lookup_detail(NS, [h])
        if res.matched:
            truth[wire(h)] = {MEDIUM[res.tiers[0]]}
    return truth


def test_vllm_classes_decode_the_feed(vllm_python: Path, tmp_path: Path) -> None:
    """One subscriber (one vLLM import) on two nodes: 32-byte hashes (bytes) and their u64 form."""
    formats = {"bytes": lambda h: h.hex(), "u64": lambda h: int.from_bytes(h[-8:], "big")}
    nodes = {f: start_node(tmp_path, dram_pages=6, nvme_pages=32, name=f, extra_args=[
        "--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-hash-format", f, "--policy", "lru"])
        for f in formats}  # fmt: skip
    proc = None
    try:
        clients = {f: KVStoreClient(n.addr, timeout=30, transport="grpc") for f, n in nodes.items()}
        proc = subscribe(vllm_python, [c.stats().kv_events.endpoint for c in clients.values()])
        time.sleep(0.5)  # its subscriptions reach the nodes (which answer with snapshots)
        truth = {f: churn(c, formats[f]) for f, c in clients.items()}
        for c in clients.values():
            c.close()
        messages = collect(proc)
        proc = None
        for f in formats:
            mine = [m for m in messages if m["topic"].split("@")[1] == f]
            assert replay_state(mine).get(topic_of("kv", f, NS)) == truth[f], f
            seqs = [m["seq"] for m in mine]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f
        types = {e["type"] for m in messages for e in m["events"]}
        assert types >= {"AllBlocksCleared", "BlockStored", "BlockRemoved"}
        media = {e["medium"] for m in messages for e in m["events"] if e["type"] != "AllBlocksCleared"}
        assert media == {"CPU", "STORAGE"}
        stored = [e for m in messages for e in m["events"] if e["type"] == "BlockStored"]
        assert all(e["block_size"] == 16 and e["token_ids"] == [] and e["lora_id"] is None for e in stored)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for n in nodes.values():
            n.close()
