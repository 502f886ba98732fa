"""What oversized requests cost a secured node in memory, with and without credentials (DESIGN.md §8.5).

One real node with a read-write and a read-only token (DRAM only, loopback). Each scenario sends
`--calls` concurrent Lookups, raw bytes on a plain gRPC channel (no client-side checks), and reads the
node's RSS (VmRSS) and peak RSS (VmHWM) from /proc before and after:

    no-token 8MiB      well-formed 8 MiB Lookups of 2-byte hashes, no token (SECURITY.md round 3's experiment)
    read-token 8MiB    the same with a read-only token (refused by the per-method size limit)
    read-token max     legitimate Lookups of 65,536 32-byte hashes (the largest allowed), read token
    no-token flood     `--flood` rounds of the first scenario back to back (4,800 Lookups by default), then
                       RSS again `--settle` seconds later: what the node keeps after a flood (the node
                       caps its malloc arenas and trims freed memory, kvstore/memtune.py)

The reference is the request bytes themselves (calls x size): a node that buffers every request once
grows by about that much; one that parses them into Python objects by several times more. The same
script run in a checkout of 3965773 (before the fix) gives the "before" column of RESULTS.md. Writes
benchmarks/out/auth_memory_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import grpc
from machine import machine_line, save_results

from kvstore.cli.launch import NodeProcess

NS = b"bench/auth-memory"
READ = "ro-bench-" + "r" * 24
WRITE = "rw-bench-" + "w" * 24
MiB = 1 << 20


def lookup(count: int, hash_bytes: int) -> bytes:
    """A well-formed LookupRequest: the namespace, then `count` hashes of `hash_bytes` bytes each."""
    return b"\x0a" + bytes([len(NS)]) + NS + (b"\x12" + bytes([hash_bytes]) + b"\x00" * hash_bytes) * count


def status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=8, help="concurrent Lookups per scenario (default 8)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 calls of 2 MiB, 2 flood rounds, 1 s settle")
    ap.add_argument("--flood", type=int, default=600, help="rounds of --calls Lookups in the flood (default 600)")
    ap.add_argument("--settle", type=float, help="seconds to wait after the flood (default 20; --quick: 1)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    if args.settle is None:
        # NOTE: a smoke run's flood is 2 rounds of 2 MiB: nothing to settle that 20 s would show and 1 s not.
        args.settle = 1.0 if args.quick else 20.0
    tiny = (2 * MiB if args.quick else 8 * MiB - 4096) // 4  # 2-byte hashes: 4 bytes each on the wire
    calls = 2 if args.quick else args.calls
    scenarios = [
        ("no-token 8MiB", lookup(tiny, 2), None),
        ("read-token 8MiB", lookup(tiny, 2), READ),
        ("read-token max", lookup(65536, 32), READ),
        ("no-token flood", lookup(tiny, 2), None),
    ]
    flood = 2 if args.quick else args.flood
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvstore-auth-mem-") as tmp:
        files = []
        for name, tok in (("rw.tokens", WRITE), ("ro.tokens", READ)):
            f = Path(tmp) / name
            f.write_text(tok + "\n")
            f.chmod(0o600)
            files.append(str(f))
        node = NodeProcess(dram_bytes="64MiB", node_id="bench", extra_args=["--auth-tokens-file", files[0],
                                                                            "--auth-read-tokens-file", files[1]])  # fmt: skip
        node.start()
        try:
            pid = node.proc.pid  # type: ignore[union-attr]
            with grpc.insecure_channel(node.addr, options=[("grpc.max_send_message_length", -1)]) as ch:
                call = ch.unary_unary("/kvstore.v1.KVStore/Lookup", request_serializer=None, response_deserializer=None)
                for label, body, token in scenarios:
                    md = (("authorization", f"Bearer {token}"),) if token else None
                    time.sleep(0.5)
                    before = status(pid)
                    t0 = time.perf_counter()
                    rounds = flood if label.endswith("flood") else 1
                    codes: dict[str, int] = {}
                    for _ in range(rounds):
                        futures = [call.future(body, timeout=300, metadata=md) for _ in range(calls)]
                        for f in futures:
                            try:
                                f.result()
                                code = "OK"
                            except grpc.RpcError as exc:
                                code = exc.code().name
                            codes[code] = codes.get(code, 0) + 1
                    seconds = time.perf_counter() - t0
                    time.sleep(1.0)
                    after = status(pid)
                    settled = None
                    if rounds > 1:
                        time.sleep(args.settle)
                        settled = status(pid)["VmRSS"]
                    sent = rounds * calls * len(body)
                    rows.append({"scenario": label, "calls": rounds * calls, "request_bytes": len(body), "sent_bytes": sent,
                                 "rss_before": before["VmRSS"], "rss_after": after["VmRSS"],
                                 "peak_before": before["VmHWM"], "peak_after": after["VmHWM"],
                                 "codes": codes, "seconds": seconds, "rss_settled": settled})  # fmt: skip
        finally:
            node.close()
    lines = [machine_line(), "",
             "| scenario | calls x MiB | status | RSS before → after MiB | growth / bytes sent | peak growth MiB | s "
             f"| RSS {args.settle:.0f} s later MiB |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        grew = r["rss_after"] - r["rss_before"]
        lines.append(
            f"| {r['scenario']} | {r['calls']} x {r['request_bytes'] / MiB:.1f} | "
            f"{', '.join(f'{k} {v}' for k, v in r['codes'].items())} | {r['rss_before'] / MiB:.0f} → "
            f"{r['rss_after'] / MiB:.0f} | {grew / r['sent_bytes']:.2f}x | "
            f"{(r['peak_after'] - r['peak_before']) / MiB:.0f} | {r['seconds']:.2f} | "
            f"{'-' if r['rss_settled'] is None else round(r['rss_settled'] / MiB)} |"
        )
    save_results(args.out, "auth_memory_bench", "\n".join(lines), args, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
