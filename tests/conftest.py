"""What every test directory shares.

- `vllm_python`: the engine venv's python (vLLM's CPU build, LMCache 0.5.6 and this checkout; made by
  tools/vllm_venv.sh). `./dev test` builds it in the background while the other tests run, so a test that
  asks for it waits (bounded) for that build. Missing under `./dev test` (KVSTORE_REQUIRE_ENGINES=1) it is a
  failure naming the command that makes it; under a bare pytest, a skip with that reason.
- Tests that use it run last (collection order), so that the build overlaps everything else.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devkit.engines import ENGINE_VENV, engine_python, engine_venv_ready

REQUIRED = os.environ.get("KVSTORE_REQUIRE_ENGINES") == "1"  # set by ./dev test


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if not engine_venv_ready():
        msg = (f"the engine venv {ENGINE_VENV} is missing or incomplete: run tools/vllm_venv.sh "
               "(./dev test does, in the background; about 1-4 minutes and 3.5 GB the first time; its output "
               f"is in {ENGINE_VENV.parent / 'setup.log'} under ./dev test)")  # fmt: skip
        if REQUIRED:
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return engine_python()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on the engine venv last (a stable sort: every other order is kept)."""
    items.sort(key=lambda item: "vllm_python" in getattr(item, "fixturenames", ()))
