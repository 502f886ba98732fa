"""The generated code in kvstore/_proto must match proto/ (run `make proto` after editing the proto)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools not installed")
def test_generated_code_is_fresh(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gen_proto
    finally:
        sys.path.pop(0)
    written = gen_proto.generate(tmp_path)
    assert written
    for path in written:
        rel = path.relative_to(tmp_path)
        committed = ROOT / "kvstore" / "_proto" / rel
        assert committed.exists(), f"{rel} missing: run `make proto`"
        assert committed.read_text() == path.read_text(), f"{rel} is stale: run `make proto`"
