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

`--single-calls N` measures single calls instead: one long-lived child per tree (its node and clients set up
once), N pairs of calls per cell, each pair's two calls in a shuffled order one right after the other, so load
that drifts hits both trees alike; printed per cell each tree's median ms per call and the median of the
per-pair ratios (first tree's time / second's: the second tree's speed relative to the first). Steadier than
whole phases on a shared machine; a call's pages come from DRAM rather than cache, as they do beside an engine.
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


def _one_call(kv: object, mode: str, *, lay: object, batch: int, pages: list, views: list, keys: list) -> float:
    """Seconds of one call of `mode` (a put's fresh keys are deleted after it, untimed)."""
    hs = [random.randbytes(32) for _ in range(batch)]
    t0 = time.perf_counter()
    if mode == "put":
        kv.put("ab", lay, hs, pages, chain=False)  # type: ignore[attr-defined]
    elif mode == "put_from":
        kv.put_from("ab", lay, hs, views, chain=False)  # type: ignore[attr-defined]
    elif mode == "get":
        kv.get("ab", keys)  # type: ignore[attr-defined]
    else:
        kv.get_into("ab", keys, views)  # type: ignore[attr-defined]
    took = time.perf_counter() - t0
    if mode in ("put", "put_from"):
        kv.delete("ab", hs)  # type: ignore[attr-defined]
    return took


def serve(size: int, modes: list[str], batch: int) -> None:
    """One tree's long-lived child for --single-calls: a node and a client per cell, then one call per line of
    stdin naming a cell, its seconds printed; "quit" ends it (runs inside that tree)."""
    from kvstore.cli.launch import NodeProcess
    from kvstore.client import KVStoreClient
    from kvstore.layout import DType, PageLayout

    lay = PageLayout(DType.UINT8, 1, 1, size // 2, 1)
    node = NodeProcess(dram_bytes=512 << 20, max_page_bytes=size, node_id="tree-ab").start()
    clients = []
    try:
        cells = {}
        for m in modes:
            plane, mode = m.split(":")
            kv = KVStoreClient(node.addr, timeout=60, transport=plane)
            clients.append(kv)
            views: list = []
            if mode in ("put_from", "get_into"):
                views = kv.shared_buffer(batch * size).pages(size, batch)
                for v in views:
                    v[:] = os.urandom(size)
            pages = [os.urandom(size) for _ in range(batch)]
            keys = [random.randbytes(32) for _ in range(batch)]
            kv.put("ab", lay, keys, pages, chain=False)
            cells[m] = (kv, mode, pages, views, keys)
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() == "quit":
                break
            kv, mode, pages, views, keys = cells[line.strip()]
            print(_one_call(kv, mode, lay=lay, batch=batch, pages=pages, views=views, keys=keys), flush=True)
    finally:
        for kv in clients:
            kv.close()
        node.close()


def _ask(kid: subprocess.Popen, cell: str) -> float:
    """One call of `cell` in a --serve child: its seconds."""
    kid.stdin.write(cell + "\n")  # type: ignore[union-attr]
    kid.stdin.flush()  # type: ignore[union-attr]
    return float(kid.stdout.readline())  # type: ignore[union-attr]


def single_calls(trees: list[Path], sizes: list[int], modes: list[str], pairs: int, batch: int) -> list[dict]:
    """Per cell: each tree's call times, pairs alternated in a shuffled order (see the module docstring)."""
    rows = []
    for size in sizes:
        kids = []
        try:
            for t in trees:
                argv = [sys.executable, str(Path(__file__).resolve()), "--serve", "--sizes", str(size >> 20),
                        "--modes", ",".join(modes), "--batch", str(batch)]  # fmt: skip
                kid = subprocess.Popen(argv, cwd=t, env={**os.environ, "PYTHONPATH": str(t)}, text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
                kids.append(kid)
                if kid.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                    raise RuntimeError(f"{t}: the child did not start (its stderr above)")

            for cell in modes:
                for _ in range(5):  # warm-up, untimed
                    for i in range(len(kids)):
                        _ask(kids[i], cell)
                times: list[list[float]] = [[] for _ in kids]
                for _ in range(pairs):
                    order = list(range(len(kids)))
                    random.shuffle(order)
                    for i in order:
                        times[i].append(_ask(kids[i], cell))
                load = os.getloadavg()[0]
                ratio = statistics.median(a / b for a, b in zip(times[0], times[1], strict=True))
                rows.append({"cell": f"{size >> 20}MiB {cell}", "ms": [statistics.median(x) * 1e3 for x in times],
                             "ratio": ratio, "load": load, "times": times})  # fmt: skip
                print(f"{rows[-1]['cell']}: {rows[-1]['ms'][0]:.2f} / {rows[-1]['ms'][1]:.2f} ms, {ratio:.2f}x, "
                      f"load {load:.1f}", flush=True)  # fmt: skip
        finally:
            for kid in kids:
                if kid.poll() is None:
                    try:
                        kid.stdin.write("quit\n")  # type: ignore[union-attr]
                        kid.stdin.flush()  # type: ignore[union-attr]
                        kid.wait(60)
                    except (OSError, subprocess.TimeoutExpired):
                        kid.kill()
                        kid.wait(10)
    return rows


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
    ap.add_argument("--single-calls", type=int, default=0, metavar="N",
                    help="N pairs of single calls per cell instead of whole phases (see above)")  # fmt: skip
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes = [int(s) << 20 for s in a.sizes.split(",")]
    modes = a.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: unknown {bad} (known: {', '.join(MODES)})")
    if a.worker:
        print(json.dumps(worker(sizes, modes, a.phases, a.batch)))
        return 0
    if a.serve:
        serve(sizes[0], modes, a.batch)
        return 0
    trees = [t.resolve() for t in (a.tree or [])]
    if len(trees) == 1:
        trees.append(Path(__file__).resolve().parents[1])
    if len(trees) != 2 or not all((t / "kvstore" / "__init__.py").is_file() for t in trees):
        ap.error(f"--tree: two kvstore checkouts (one --tree: that one beside this one), got {trees}")
    if a.single_calls > 0:
        calls = single_calls(trees, sizes, modes, a.single_calls, a.batch)
        print(f"\n| cell | {trees[0].name} ms | {trees[1].name} ms | {trees[1].name} / {trees[0].name}, paired |")
        print("|---|--:|--:|--:|")
        for c in calls:
            print(f"| {c['cell']} | {c['ms'][0]:.2f} | {c['ms'][1]:.2f} | {c['ratio']:.2f}x |")
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "tree_ab_calls.json").write_text(json.dumps({"trees": [str(t) for t in trees], "cells": calls}))
        return 0
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
