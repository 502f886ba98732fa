"""Two checkouts of kvstore side by side: each plane's put and get GB/s, the trees alternated, paired ratios.

    .venv/bin/python benchmarks/tree_ab.py --tree /path/to/old-checkout [--tree .] [--rounds 5]

Each round runs every tree once, in turn, in a child process whose working directory and PYTHONPATH are that
tree (so its node, started with `python -m`, runs that tree's code too: the working directory comes first on
the import path). A child starts one DRAM-only node per page size and measures, per plane and operation, the
median of 5 phases of 64 MiB in calls of 16 pages: `put` (fresh keys, deleted after each call, untimed),
`put_from` / `get_into` (the caller's pages in a shared buffer), `get`. Uses only the public client API, so any
checkout of this project since the same-host plane's shared buffers can be measured.

Printed: per cell each tree's median GB/s and the median of the same-round ratios (second tree / first), with
the load average of each round: on a shared 2-vCPU machine read the paired ratios, and run it more than once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("tcp:put", "tcp:get", "shm:put", "shm:put_from", "shm:get_into", "shm:get", "grpc:get")
DEFAULT_MODES = ("tcp:put", "tcp:get", "shm:put_from", "shm:get_into", "shm:get", "grpc:get")


def _phase(kv: object, mode: str, *, lay: object, size: int, batch: int, calls: int, pages: list, views: list,
           keys: list) -> float:  # fmt: skip
    n = 0
    t0 = time.perf_counter()
    for _ in range(calls):
        if mode in ("put", "put_from"):
            hs = [random.randbytes(32) for _ in range(batch)]
            if mode == "put":
                kv.put("ab", lay, hs, pages, chain=False)  # type: ignore[attr-defined]
            else:
                kv.put_from("ab", lay, hs, views, chain=False)  # type: ignore[attr-defined]
            n += batch * size
            kv.delete("ab", hs)  # type: ignore[attr-defined]
        elif mode == "get":
            n += sum(len(g) for g in kv.get("ab", keys))  # type: ignore[attr-defined]
        else:
            n += sum(r.nbytes for r in kv.get_into("ab", keys, views))  # type: ignore[attr-defined]
    return n / (time.perf_counter() - t0) / 1e9


def worker(sizes: list[int], modes: list[str], phases: int, batch: int) -> dict[str, float]:
    """One tree's figures (runs inside that tree: imports the kvstore on PYTHONPATH)."""
    from kvstore.cli.launch import NodeProcess
    from kvstore.client import KVStoreClient
    from kvstore.layout import DType, PageLayout

    out: dict[str, float] = {}
    for size in sizes:
        lay = PageLayout(DType.UINT8, 1, 1, size // 2, 1)
        calls = max(1, (64 << 20) // (size * batch))
        node = NodeProcess(dram_bytes=512 << 20, max_page_bytes=size, node_id="tree-ab").start()
        try:
            for m in modes:
                plane, mode = m.split(":")
                with KVStoreClient(node.addr, timeout=60, transport=plane) as kv:
                    views: list = []
                    if mode in ("put_from", "get_into"):
                        buf = kv.shared_buffer(batch * size)
                        views = buf.pages(size, batch)
                        for v in views:
                            v[:] = os.urandom(size)
                    pages = [os.urandom(size) for _ in range(batch)]
                    keys = [random.randbytes(32) for _ in range(batch)]
                    kv.put("ab", lay, keys, pages, chain=False)
                    runs = [
                        _phase(
                            kv, mode, lay=lay, size=size, batch=batch, calls=calls, pages=pages, views=views, keys=keys
                        )
                        for _ in range(phases)
                    ]
                    out[f"{size >> 20}MiB {m}"] = statistics.median(runs)
        finally:
            node.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--tree", action="append", type=Path, help="a checkout to measure (twice: the two trees)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="1,4", help="page sizes in MiB, comma-separated")
    ap.add_argument(
        "--modes", default=",".join(DEFAULT_MODES), help=f"plane:operation cells (default {','.join(DEFAULT_MODES)})"
    )
    ap.add_argument("--phases", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16, help="pages per call")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes = [int(s) << 20 for s in a.sizes.split(",")]
    modes = a.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: unknown {bad} (known: {', '.join(MODES)})")
    if a.worker:
        print(json.dumps(worker(sizes, modes, a.phases, a.batch)))
        return 0
    trees = [t.resolve() for t in (a.tree or [])]
    if len(trees) == 1:
        trees.append(Path(__file__).resolve().parents[1])
    if len(trees) != 2 or not all((t / "kvstore" / "__init__.py").is_file() for t in trees):
        ap.error(f"--tree: two kvstore checkouts (one --tree: that one beside this one), got {trees}")
    rows: list[dict[str, object]] = []
    for r in range(a.rounds):
        for t in trees:
            load = os.getloadavg()[0]
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--sizes", a.sizes, "--modes",
                    a.modes, "--phases", str(a.phases), "--batch", str(a.batch)]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(t)}
            done = subprocess.run(argv, cwd=t, env=env, capture_output=True, text=True, timeout=900, check=False)
            if done.returncode != 0:
                print(f"{t}: failed ({done.returncode}): {done.stderr[-2000:]}", file=sys.stderr)
                return 1
            rows.append({"round": r, "tree": str(t), "load": load, "gbs": json.loads(done.stdout.splitlines()[-1])})
            print(f"round {r} {t.name} load {load:.1f}: {rows[-1]['gbs']}", flush=True)
    print(f"\n| cell | {trees[0].name} GB/s | {trees[1].name} GB/s | {trees[1].name} / {trees[0].name}, paired |")
    print("|---|--:|--:|--:|")
    for cell in rows[0]["gbs"]:  # type: ignore[union-attr]
        a0 = [x["gbs"][cell] for x in rows if x["tree"] == str(trees[0])]  # type: ignore[index]
        a1 = [x["gbs"][cell] for x in rows if x["tree"] == str(trees[1])]  # type: ignore[index]
        ratio = statistics.median(y / x for x, y in zip(a0, a1, strict=True))
        print(f"| {cell} | {statistics.median(a0):.2f} | {statistics.median(a1):.2f} | {ratio:.2f}x |")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "tree_ab.json").write_text(json.dumps({"trees": [str(t) for t in trees], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
