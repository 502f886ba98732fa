"""Which server model the TCP plane's node side uses: asyncio on raw sockets vs a thread per connection.

Both serve the same Get work to a client process (batch `--batch` pages of `--page-mib` MiB, one TCP
connection, the client receives with recv_into/MSG_WAITALL and checksums each page as the real client
does). Per page the server does what a node does: the tier read's XXH3 on the event loop (the
TierManager lives there), then sends a 57-byte frame header and the page. "asyncio": the loop sends
too (node_io.PlainChannel: sendmsg, then sock_sendall for any rest). "thread": a thread per
connection sends with blocking sendall and asks the loop for each page (run_coroutine_threadsafe),
as a thread-per-connection node would. GB/s (10^9) median of `--runs`; the models alternate.
Writes benchmarks/out/tcp_server_models.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import time
from multiprocessing.queues import Queue
from pathlib import Path

import xxhash
from machine import machine_line, save_results

from kvstore.memtune import tune_malloc_for_bulk_io
from kvstore.node.planes.tcp_io import PlainChannel, listen_socket, tune

HEADER = 57  # a PAGE frame's header and metadata
BUFFER = 4 << 20


def client(port: int, size: int, batch: int, calls: int, out: Queue) -> None:
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    s.settimeout(None)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        s.setsockopt(socket.SOL_SOCKET, opt, BUFFER)
    head = memoryview(bytearray(HEADER))
    t0 = time.perf_counter()
    for _ in range(calls):
        s.sendall(b"g")
        for _ in range(batch):
            s.recv_into(head, HEADER, socket.MSG_WAITALL)
            page, got = memoryview(bytearray(size)), 0
            while got < size:
                k = s.recv_into(page[got:], size - got, socket.MSG_WAITALL)
                if not k:
                    raise ConnectionError("server closed")
                got += k
            xxhash.xxh3_64_intdigest(page)
    out.put(calls * batch * size / (time.perf_counter() - t0) / 1e9)
    s.sendall(b"q")
    s.close()


async def serve(model: str, pages: list[bytearray], calls: int) -> float:
    loop = asyncio.get_running_loop()
    listener = listen_socket("127.0.0.1", 0)
    q: Queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=client, args=(listener.getsockname()[1], len(pages[0]), len(pages),
                                                                calls, q))  # fmt: skip
    proc.start()
    sock, _ = await loop.sock_accept(listener)
    listener.close()
    tune(sock, BUFFER)

    async def lease(i: int) -> bytearray:  # what a Get does on the loop per page: the tier read's checksum
        xxhash.xxh3_64_intdigest(pages[i])
        return pages[i]

    try:
        if model == "asyncio":
            sock.setblocking(False)
            chan = PlainChannel(loop, sock)
            while (await chan.read(1)) == b"g":
                for i in range(len(pages)):
                    await chan.send(b"h" * HEADER, await lease(i))
        else:
            sock.setblocking(True)

            def per_connection_thread() -> None:
                while sock.recv(1) == b"g":
                    for i in range(len(pages)):
                        page = asyncio.run_coroutine_threadsafe(lease(i), loop).result()
                        sock.sendall(b"h" * HEADER)
                        sock.sendall(page)

            await asyncio.to_thread(per_connection_thread)
        return float(q.get(timeout=120))
    finally:
        sock.close()
        proc.join(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page-mib", default="1,4", help="page sizes in MiB (default 1,4)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--calls", type=int, default=6, help="Get calls per measurement (default 6)")
    ap.add_argument("--runs", type=int, default=5, help="measurements per model; the median is reported")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    tune_malloc_for_bulk_io()
    rows = []
    for mib in (int(m) for m in args.page_mib.split(",")):
        pages = [bytearray(os.urandom(mib << 20)) for _ in range(args.batch)]
        res: dict[str, list[float]] = {"asyncio": [], "thread": []}
        for run in range(args.runs):
            for model in ("asyncio", "thread") if run % 2 == 0 else ("thread", "asyncio"):
                res[model].append(asyncio.run(serve(model, pages, args.calls)))
        rows.append({"page_mib": mib, **{m: statistics.median(v) for m, v in res.items()}, "runs": res})
    lines = [machine_line(), f"- Get of {args.batch} pages x {args.calls} calls, median of {args.runs} runs", "",
             "| page | asyncio, raw sockets GB/s | thread per connection GB/s | thread / asyncio |", "|--:|--:|--:|--:|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['page_mib']} MiB | {r['asyncio']:.2f} | {r['thread']:.2f} | {r['thread'] / r['asyncio']:.2f} |"
        )
    save_results(args.out, "tcp_server_models", "\n".join(lines), args, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
