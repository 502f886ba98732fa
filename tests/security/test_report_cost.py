"""What a client's reports of damaged pages (the Report RPC) may cost the node, against a real node.

The outside probe: one reader's Report of 65,536 hashes naming the same 64 pages 1,024 times cost 44-58 s
of node work (every hash re-read and re-verified, 2 GiB of NVMe reads) and counted 65,536 "corrupt
reports" with none confirmed. Now a report's hashes are deduplicated before anything is read, each caller
has a rate of pages it may have verified (past it a page is counted, not read), and Stats, /metrics and
`kvctl stats` tell confirmed reports from unconfirmed ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.client import KVStoreClient
from kvstore.node.report_budget import REPORT_BURST, REPORT_PAGES_PER_SECOND
from kvstore.security import ClientSecurity
from tests.integration.conftest import LAYOUT, NS, key, page, start_node
from tests.security.conftest import READ, WRITE, token_args


def report(kv: KVStoreClient, hashes: list[bytes]) -> pb.ReportResponse:
    return kv._run(kv._core.report_corrupt(NS, hashes))


def test_a_readers_repeated_hashes_are_checked_once_and_its_reports_are_rate_limited(tmp_path: Path) -> None:
    node = start_node(tmp_path, dram_pages=8, nvme_pages=96, name="report",
                      extra_args=[*token_args(tmp_path), "--metrics-port", "0"])  # fmt: skip
    try:
        pages = [key(i, "reported") for i in range(64)]
        with KVStoreClient(node.addr, timeout=120, security=ClientSecurity(token=WRITE)) as writer:
            writer.put(NS, LAYOUT, pages, [page(h) for h in pages])  # most of them demoted to NVMe
            held = sum(1 for h in pages if writer.lookup(NS, [h]))
            assert held >= 48
        with KVStoreClient(node.addr, timeout=120, security=ClientSecurity(token=READ)) as reader:
            # The probe's report: 64 pages, each named 1,024 times. Checked once each.
            reply = report(reader, pages * 1024)
            assert (reply.dropped, reply.intact) == (0, held), "each distinct page is verified once"
            s = reader.stats()
            assert (s.corrupt_reports, s.corrupt_confirmed, s.corrupt_unconfirmed) == (64, 0, 64)
            assert s.corrupt_unchecked == 0
            # The same reader reports the same pages again and again: past its burst, at its rate.
            t0 = time.monotonic()
            checked = sum(report(reader, pages).intact for _ in range(20))
            elapsed = time.monotonic() - t0
            allowed = REPORT_BURST - 64 + REPORT_PAGES_PER_SECOND * (elapsed + 1)
            assert checked <= allowed < 20 * held, f"{checked} pages verified in {elapsed:.1f}s"
            s = reader.stats()
            assert s.corrupt_reports == 64 * 21 and s.corrupt_confirmed == 0
            assert s.corrupt_unconfirmed == s.corrupt_reports  # nothing was found damaged
            assert s.corrupt_unchecked >= 20 * 64 - allowed
        # The rate is the reader's own: another caller's report is still verified.
        with KVStoreClient(node.addr, timeout=120, security=ClientSecurity(token=WRITE)) as writer:
            assert report(writer, pages[:1] * 4).intact == 1
        shown = subprocess.run([sys.executable, "-m", "kvstore.cli.kvctl", "stats", "--addr", node.addr],
                               capture_output=True, text=True, timeout=60, check=True,
                               env={**os.environ, "KVSTORE_TOKEN": READ}).stdout  # fmt: skip
        flat = " ".join(shown.split())
        assert f"confirmed here and dropped 0, unconfirmed {s.corrupt_unconfirmed + 1}" in flat, shown
        text = urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10).read().decode()
        assert "kvstore_corrupt_unconfirmed_total" in text and "kvstore_corrupt_unchecked_total" in text
    finally:
        node.close()
