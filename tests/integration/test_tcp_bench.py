"""The TCP plane's benchmarks still run end to end on a fresh clone (smoke runs: no figure is asserted;
peer_bench's --quick leaves the peers out, they need their own venv)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, *args: str, timeout: float = 300) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                         timeout=timeout, check=False)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]


def test_peer_bench_quick_run(tmp_path: Path) -> None:
    run("peer_bench.py", "--quick", "--out", str(tmp_path))
    doc = json.loads((tmp_path / "peer_bench.json").read_text())
    labels = [
        "kvstore TCP plane",
        "kvstore TCP plane + TLS",
        "(info) raw TLS socket (Python's ssl, no framing, no checksum)",
        "kvstore gRPC streams",
        "memcpy (same bytes, one core)",
        "kvstore shm (same host)",
        "kvstore zero-copy (same host, put_from/get_into)",
        "kvstore UCX plane",
    ]
    for label in labels:
        for metric in ("gbs", "gb_per_cpu_s"):  # wall time, and CPU time of the client and server processes
            assert set(doc["results"][metric][label]) == {"256/put", "256/get"}, (metric, label)
    assert not [n for n in doc["notes"] if "failed" in n or "wrong bytes" in n], doc["notes"]
    assert "kvstore TCP / kvstore gRPC" in (tmp_path / "peer_bench.md").read_text()


def test_tcp_server_models_quick_run(tmp_path: Path) -> None:
    run(
        "tcp_server_models.py", "--page-mib", "1", "--calls", "1", "--runs", "1", "--batch", "4", "--out", str(tmp_path)
    )
    rows = json.loads((tmp_path / "tcp_server_models.json").read_text())["rows"]
    (row,) = rows
    for model in ("asyncio", "thread"):  # both models served the same Gets, one measurement each here
        assert len(row["runs"][model]) == 1 and row[model] == row["runs"][model][0]


@pytest.mark.parametrize("kind", ["RawTcp", "RawTls"])
def test_peer_bench_raw_tcp_baseline_recovers_when_its_server_dies(kind: str, tmp_path: Path) -> None:
    """On a busy machine the raw-TCP baseline's server can time out while the other systems run (it once took
    peer_bench down with it): the next phase reconnects, restarting the server, and is measured again. The same
    for its TLS twin (a new server, a new handshake)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import peer_bench

    from devkit.pki import make_dev_pki

    peer_bench.RawTls.pki = make_dev_pki(tmp_path / "pki")
    notes: list[str] = []
    raw = getattr(peer_bench, kind)(notes)
    try:
        raw.setup(64 << 10, 2)
        raw.get(1)
        first = raw.server.proc
        first.kill()
        first.join(10)
        secs, ok = raw.get(2)
        assert ok and secs > 0 and raw.server.proc is not first and raw.server.proc.is_alive()
        assert raw.put(2) > 0
        assert len(notes) == 1 and "reconnected" in notes[0], notes
    finally:
        raw.close()
    assert not raw.server.proc.is_alive()
