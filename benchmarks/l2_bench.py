"""LMCache's multiprocess server storage (L2 adapters): kvstore's adapter beside LMCache's own mooncake_store,
resp (Redis) and fs adapters, in one harness and one run.

Part 1, the adapters (benchmarks/l2_driver.py, one process per adapter): each adapter is built from its
`--l2-adapter` JSON by LMCache 0.5.6's own parser and factory, exactly as `lmcache server` does, and
driven through LMCache's L2 interface: store, lookup-and-lock and load tasks of `--batch` objects (16)
at each size (1, 4, 16 MiB), timed from submit to the event fd; GB/s (10^9) = medians of `--rounds`,
lookup latency p50/p99 per task (all hits). Loads are checked byte for byte.

    kvstore         our adapter -> a real `kvstore serve` node on loopback (DRAM; adapter defaults: stores
                    on the same-host plane, loads straight into LMCache's objects over the TCP plane;
                    lookups pin what they find until unlock)
    kvstore-shm     (info) the same with transport "shm": loads arrive in kvstore's own segment and are
                    copied into LMCache's objects (two copies; not a default, shows the same-host plane)
    kvstore-window  (info) the default adapter, LMCache's objects carved from memory registered with its node
                    client (a SharedBuffer): the node copies each page straight into the object, one copy. What
                    LMCache's real arena cannot have: it is anonymous (pinned) memory, or with `shm_name` a POSIX
                    shm file, and the node maps only sealed memfds (kvstore/node/planes/shm.py)
    resp            LMCache's C++ RESP connector -> a real redis-server on loopback (persistence off)
    fs              LMCache's Python fs adapter -> files in a temp directory (the page cache: reads after
                    writes come from RAM, as they do for a user with defaults)
    mooncake_store  LMCache's native Mooncake adapter: needs LMCache's `lmcache_mooncake` extension,
                    which the PyPI wheel of 0.5.6 does not ship (reported as such when it fails)
    mooncake_py     so Mooncake Store still has a row: what that adapter does, written in Python for this
                    benchmark (l2_driver.MooncakePyAdapter: zero-copy batch_put_from / batch_get_into on
                    registered memory, batch_is_exist) against mooncake_master + a mooncake_client
                    storage process over Mooncake's TCP transport (its "remote" setup, as peer_bench runs it)

LMCache's own adapters run in the peers' venv (benchmarks/.peers-venv, made on first use by
peer_bench.ensure_peers_venv, never the project's); ours in this interpreter's venv (LMCache 0.5.6 too).

Part 2, TTFT through vLLM (`--ttft`, needs the engine venv, tools/vllm_venv.sh): per backend, one
`lmcache server` with that L2 adapter and one vLLM engine (CPU build, LMCacheMPConnector): request A
stores a 2,048-token prefix; once the backend holds its 8 chunks, LMCache's memory is cleared (its admin
API) before each request B (the prefix + 3 tokens), so B's prefix comes from L2: TTFT is vLLM's own first
token latency, the median of `--ttft-samples`. Rows for reference, same engine and model: no L2 (B
recomputed) and B served from LMCache's own memory (L1). Writes benchmarks/out/l2_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from machine import LoadLog, machine_line, memcpy_gbs, save_results
from peer_bench import ensure_peers_venv

from devkit.engines import (
    CHUNK,
    Engine,
    GroupProcess,
    LMCacheServer,
    engine_env,
    ensure_engine_venv,
    kvstore_l2,
    make_model,
    prompt,
    wait_port,
)
from kvstore.cli.launch import NodeProcess
from kvstore.cli.redis_procs import RedisProcess
from kvstore.cli.waits import free_port
from kvstore.client import KVStoreClient
from kvstore.pageformat import slot_bytes_for

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
BACKENDS = ("kvstore", "kvstore-shm", "kvstore-window", "resp", "fs", "mooncake_store", "mooncake_py")
LABELS = {"kvstore": "kvstore (our L2 adapter)", "kvstore-shm": "(info) kvstore, transport shm: loads copy twice",
          "kvstore-window": "(info) kvstore, objects in registered memory: in place", "resp": "LMCache resp (Redis)", "fs": "LMCache fs",
          "mooncake_store": "LMCache mooncake_store", "mooncake_py": "Mooncake Store (Python adapter, see notes)",
          "none": "no L2: B recomputed",
          "l1": "LMCache's own memory (L1 hit)"}  # fmt: skip


@contextlib.contextmanager
def backend(name: str, work: Path, max_page: int, batch: int,
            peers_py: Path | None = None) -> Iterator[tuple[dict, Callable[[], int]]]:  # fmt: skip
    """(the adapter's --l2-adapter spec, how many objects it holds now) with its server started."""
    if name.startswith("kvstore"):
        slot = slot_bytes_for(max_page)
        with NodeProcess(dram_bytes=(2 * batch + 4) * slot, max_page_bytes=max_page, node_id="l2-bench",
                         log_path=work / "node.log") as node:  # fmt: skip

            def held() -> int:
                with KVStoreClient(node.addr, timeout=10, transport="grpc") as kv:
                    return sum(n for ns, _, n in kv.stats().namespaces)

            yield kvstore_l2(node.addr, **({"transport": "shm"} if name == "kvstore-shm" else {})), held
    elif name == "resp":
        r = RedisProcess().start()
        try:
            import redis

            def held() -> int:
                with redis.Redis(host="127.0.0.1", port=r.port) as c:
                    return int(c.dbsize())

            yield {"type": "resp", "host": "127.0.0.1", "port": r.port}, held
        finally:
            r.close()
    elif name == "fs":
        path = Path(tempfile.mkdtemp(prefix="l2-fs-", dir=work))
        yield {"type": "fs", "base_path": str(path)}, lambda: sum(1 for _ in path.rglob("*.data"))
    elif name == "mooncake_store":
        # What LMCache's docs give for a TCP Mooncake setup; the adapter fails before it dials anything
        # when the extension is missing, which is what this reports.
        yield {"type": "mooncake_store", "local_hostname": "127.0.0.1", "protocol": "tcp",
               "metadata_server": "P2PHANDSHAKE", "master_server_address": "127.0.0.1:50051",
               "global_segment_size": str(512 * MiB), "local_buffer_size": str(512 * MiB)}, lambda: 0  # fmt: skip
    elif name == "mooncake_py":
        assert peers_py is not None
        pkg = subprocess.run([str(peers_py), "-c", "import mooncake, os; print(os.path.dirname(mooncake.__file__))"],
                             check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
        mport, hport, cport = free_port(), free_port(), free_port()
        env = {**engine_env(), "MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_minloglevel": "1"}
        with contextlib.ExitStack() as stack:
            master = stack.enter_context(GroupProcess([f"{pkg}/mooncake_master", "--rpc_address=127.0.0.1",
                f"--rpc_port={mport}", "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={hport}", "--rpc_thread_num=2"], work / "mooncake-master.log", env))  # fmt: skip
            wait_port(mport, master, 30, "mooncake_master")
            wait_port(hport, master, 30, "mooncake_master's metadata server")
            meta = f"http://127.0.0.1:{hport}/metadata"
            seg_gb = max(4, 3 * batch * max_page >> 30)
            client = stack.enter_context(GroupProcess([f"{pkg}/mooncake_client", "--host=127.0.0.1",
                f"--global_segment_size={seg_gb} GB", f"--master_server_address=127.0.0.1:{mport}",
                f"--metadata_server={meta}", f"--port={cport}", "--protocol=tcp"], work / "mooncake-client.log", env))  # fmt: skip
            wait_port(cport, client, 30, "mooncake_client")
            time.sleep(1.0)  # it mounts its segment with the master after listening
            yield {"type": "mooncake_py", "metadata_server": meta, "master": f"127.0.0.1:{mport}"}, lambda: 0
    else:
        raise ValueError(f"unknown backend {name!r}")


DRIVER_TIMEOUT_S = 1800.0  # one adapter's whole driver run; a run that overruns (a busy machine) is tried once more


def adapters(args: argparse.Namespace, peers_py: Path | None, work: Path, load: LoadLog) -> dict[str, dict]:
    """Every backend `--repeat` times, the order alternating between repeats (so drift on a shared machine favours
    none); each cell the median over the repeats that ran, the repeats' own figures kept beside it."""
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeat):
        order = args.backends if rep % 2 == 0 else list(reversed(args.backends))
        for name, res in adapters_once(args, order, peers_py, work, load).items():
            runs.setdefault(name, []).append(res)
    if args.repeat == 1:
        return {name: runs[name][0] for name in args.backends}
    out: dict[str, dict] = {}
    for name in args.backends:
        good = [r for r in runs[name] if "error" not in r]
        if not good:
            out[name] = runs[name][-1]
            continue
        cells = []
        for i, first in enumerate(good[0]["results"]):
            rows = [g["results"][i] for g in good]
            cell = {**first, "repeats": len(rows)}
            for k in ("store_gbs", "load_gbs", "lookup_p50_ms", "lookup_p99_ms"):
                cell[k] = statistics.median(r[k] for r in rows)
                cell[f"{k}_runs"] = [round(r[k], 3) for r in rows]
            cell["bit_exact"] = all(r["bit_exact"] for r in rows)
            cells.append(cell)
        spans = [g["load_average"] for g in good]
        out[name] = {"results": cells, "seconds": sum(g["seconds"] for g in good), "runs": runs[name],
                     "load_average": [min(a for a, _ in spans), max(b for _, b in spans)]}  # fmt: skip
    return out


def adapters_once(
    args: argparse.Namespace, order: list[str], peers_py: Path | None, work: Path, load: LoadLog
) -> dict[str, dict]:
    """Per backend, the driver's results; a backend that cannot be started or whose driver fails twice gets an
    "error" (reported as skipped, with why) and the others are still measured."""
    out: dict[str, dict] = {}
    for name in order:
        py = Path(sys.executable) if name.startswith("kvstore") else peers_py
        if py is None:
            out[name] = {"error": "the peers' venv could not be made (see the log)"}
            continue
        load0 = load.note()
        res = _one_adapter(name, py, args, peers_py, work)
        if "error" in res and res.get("retry"):
            print(f"{name}: {res['error'].splitlines()[-1][:200]}; trying once more", flush=True)
            res = _one_adapter(name, py, args, peers_py, work)
        res["load_average"] = [load0, load.note()]
        res.pop("retry", None)
        out[name] = res
        print(f"{name}: {json.dumps(res)[:300]}", flush=True)
    return out


def _one_adapter(name: str, py: Path, args: argparse.Namespace, peers_py: Path | None, work: Path) -> dict:
    """One driver run against a freshly started backend. An error that a second try may not repeat (a time-out,
    a backend that did not start in time) is marked "retry"."""
    t0 = time.monotonic()
    try:
        with backend(name, work, max(args.sizes), args.batch, peers_py) as (spec, _):
            cmd = [str(py), str(HERE / "l2_driver.py"), "--spec", json.dumps(spec), "--sizes", *map(str, args.sizes),
                   "--batch", str(args.batch), "--rounds", str(args.rounds),
                   *(["--registered"] if name == "kvstore-window" else [])]  # fmt: skip
            try:
                proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.driver_timeout,
                                      env=engine_env(MC_TCP_BIND_ADDRESS="127.0.0.1", GLOG_minloglevel="1"))  # fmt: skip
            except subprocess.TimeoutExpired as exc:
                log = (exc.stdout or b"") + (exc.stderr or b"")
                (work / f"driver-{name}.log").write_bytes(log if isinstance(log, bytes) else log.encode())
                return {"error": f"its driver did not finish within {args.driver_timeout:.0f} s", "retry": True}
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:  # TimeoutError is an OSError
        return {"error": f"its server did not start ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
                "retry": isinstance(exc, TimeoutError)}  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("L2RESULT ")]
    res = json.loads(lines[-1][len("L2RESULT ") :]) if lines else {"error": proc.stderr[-2000:] or "no result"}
    (work / f"driver-{name}.log").write_text(proc.stdout + proc.stderr)
    res["seconds"] = time.monotonic() - t0
    return res


def clear_l1(server: LMCacheServer) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/cache/clear", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30):
        pass


def ttft(args: argparse.Namespace, peers_py: Path | None, work: Path, load: LoadLog) -> dict[str, dict]:
    """Per backend: TTFT (ms) of request B with its prefix from L2; plus no-L2 and L1 references. A backend whose
    run fails is reported as skipped, with why; the others are still measured."""
    vllm_py = ensure_engine_venv(work / "engine-venv.log")
    model = make_model(vllm_py, work / "ttft-model", hidden=512, layers=16, intermediate=1536, init_range=0.02)
    out: dict[str, dict] = {}
    for name in [
        "none",
        *[b for b in args.backends if not b.startswith("mooncake") and b not in ("kvstore-shm", "kvstore-window")],
    ]:
        py = vllm_py if name in ("none", "kvstore") else peers_py
        if py is None:
            continue
        load0 = load.note()
        try:
            out[name] = _one_ttft(name, py, vllm_py, model, args, work)
        except Exception as exc:  # an engine or server that broke: this backend's row says so
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
        out[name]["load_average"] = [load0, load.note()]
        print(f"ttft {name}: {json.dumps(out[name])}", flush=True)
    return out


def _one_ttft(name: str, py: Path, vllm_py: Path, model: Path, args: argparse.Namespace, work: Path) -> dict:
    prefix = prompt(args.prefix_tokens)
    chunks = args.prefix_tokens // CHUNK
    page = CHUNK * 16 * 2 * 2 * 64 * 2  # layers x (K, V) x KV heads x head dim x bf16, per chunk
    with contextlib.ExitStack() as stack:
        spec, held = (None, lambda: chunks) if name == "none" else stack.enter_context(backend(name, work, page, 16))
        server = LMCacheServer(py, work / f"ttft-server-{name}.log", [spec] if spec else [], l1_size_gb=0.5)
        stack.callback(server.stop)
        reqs = [{"name": "W", "tokens": prompt(32, 104729), "max_tokens": 1, "logprobs": 0},
                {"name": "A", "tokens": [*prefix, 11, 12, 13], "max_tokens": 1, "logprobs": 0}]  # fmt: skip
        reqs += [{"name": f"B{i}", "tokens": [*prefix, 21 + i, 22, 23], "max_tokens": 1, "logprobs": 0,
                  "pause": True} for i in range(args.ttft_samples)]  # fmt: skip
        reqs.append({"name": "B-L1", "tokens": [*prefix, 21, 22, 23], "max_tokens": 1, "logprobs": 0, "pause": True})
        engine = Engine(vllm_py, model, reqs, work / f"ttft-engine-{name}.log", connector_port=server.port)
        stack.callback(engine.stop)
        engine.result("A")
        deadline = time.monotonic() + 120
        while held() < chunks and time.monotonic() < deadline:
            time.sleep(0.2)
        stored = held()
        samples, cached = [], []
        for i in range(args.ttft_samples):
            clear_l1(server)
            engine.go(f"B{i}")
            res = engine.result(f"B{i}")
            samples.append(res["ttft_ms"] or res["wall_ms"])
            cached.append(res["num_cached_tokens"])
        engine.go("B-L1")  # not cleared: B{last}'s prefix is in LMCache's memory
        l1 = engine.result("B-L1")
        engine.finish(120)
    return {"ttft_ms": statistics.median(samples), "samples_ms": samples, "cached_tokens": cached,
            "objects_held": stored, "l1_ttft_ms": l1["ttft_ms"], "l1_cached": l1["num_cached_tokens"]}  # fmt: skip


def _load(res: dict) -> str:
    pair = res.get("load_average")
    return f"{pair[0]:.1f}-{pair[1]:.1f}" if pair else "—"


def table(args: argparse.Namespace, micro: dict[str, dict], ttfts: dict[str, dict], limit: float, load: LoadLog) -> str:
    lines = [f"### l2_bench: LMCache multiprocess server storage (L2 adapters), batch {args.batch}", machine_line(),
             f"- {load.span()}; each row's own in its last column; medians of {args.repeat} alternated run(s) of "
             f"{args.rounds} rounds",
             f"- memcpy of one batch of the largest size on this machine: {limit:.2f} GB/s", "",
             "| L2 adapter | chunk | store GB/s | load GB/s | lookup p50 ms | lookup p99 ms | bit-exact | load avg |",
             "|---|--:|--:|--:|--:|--:|:-:|--:|"]  # fmt: skip
    notes = []
    for name, res in micro.items():
        if "error" in res:
            why = res["error"].strip().splitlines()[-1][:300] if res["error"].strip() else "no result"
            lines.append(f"| {LABELS[name]} | skipped: {why} | | | | | | {_load(res)} |")
            notes.append(f"- {LABELS[name]}: not measured: {why}")
            continue
        for r in res["results"]:
            lines.append(f"| {LABELS[name]} | {r['size'] // MiB} MiB | {r['store_gbs']:.2f} | {r['load_gbs']:.2f} | "
                         f"{r['lookup_p50_ms']:.2f} | {r['lookup_p99_ms']:.2f} | {'yes' if r['bit_exact'] else 'NO'} | "
                         f"{_load(res)} |")  # fmt: skip
    if ttfts:
        lines += ["", f"TTFT of request B ({args.prefix_tokens}-token prefix from L2 + 3 tokens; vLLM CPU build, "
                  f"16-layer test Llama; median of {args.ttft_samples}):", "",
                  "| backend | TTFT ms | cached tokens | L1-hit TTFT ms (same engine) | load avg |", "|---|--:|--:|--:|--:|"]  # fmt: skip
        for name, r in ttfts.items():
            if "error" in r:
                lines.append(f"| {LABELS[name]} | skipped: {r['error']} | | | {_load(r)} |")
                continue
            lines.append(f"| {LABELS[name]} | {r['ttft_ms']:.1f} | {min(r['cached_tokens'])} | {r['l1_ttft_ms']:.1f} | "
                         f"{_load(r)} |")  # fmt: skip
    return "\n".join(lines + (["", *notes] if notes else []))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 * MiB, 4 * MiB, 16 * MiB])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1, help="runs of every backend, alternating their order (medians)")
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--ttft", action="store_true", help="also TTFT through vLLM with each backend (minutes)")
    ap.add_argument("--ttft-samples", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--peers-venv", type=Path, default=HERE / ".peers-venv")
    ap.add_argument("--driver-timeout", type=float, default=DRIVER_TIMEOUT_S,
                    help=f"seconds one adapter's driver may run before it is tried once more (default {DRIVER_TIMEOUT_S:.0f})")  # fmt: skip
    ap.add_argument("--out", type=Path, default=HERE / "out")
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 1 MiB, 2 rounds, kvstore only (no peers venv), no TTFT"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.rounds, args.backends, args.ttft = [MiB], 2, ["kvstore"], False
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="l2-bench-", dir=args.out))
    peers_py = None
    if any(not b.startswith("kvstore") for b in args.backends):
        try:
            peers_py = ensure_peers_venv(args.peers_venv, work / "peers-venv.log")
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"peers skipped: their venv could not be made ({exc})", flush=True)
    load = LoadLog()
    limit = memcpy_gbs(args.batch * max(args.sizes), 3)
    t0 = time.monotonic()
    micro = adapters(args, peers_py, work, load)
    ttfts = ttft(args, peers_py, work, load) if args.ttft else {}
    save_results(args.out, "l2_bench", table(args, micro, ttfts, limit, load), args, adapters=micro, ttft=ttfts,
                 memcpy_gbs=limit, wall_s=time.monotonic() - t0, work=str(work), load_average=load.samples)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
