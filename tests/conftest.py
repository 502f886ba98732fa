"""What every test directory shares.

- `vllm_python`: the engine venv's python (vLLM's CPU build, LMCache 0.5.6 and this checkout; made by
  tools/vllm_venv.sh). `./dev test` builds it in the background while the other tests run, so a test that
  asks for it waits (bounded) for that build. Missing under `./dev test` (KVSTORE_REQUIRE_ENGINES=1) it is a
  failure naming the command that makes it; under a bare pytest, a skip with that reason.
- `sglang_python`: the SGLang venv's python (SGLang 0.5.23 without its CUDA packages, the CPU torch and this
  checkout; made by tools/sglang_venv.sh), built and waited for the same way.
- Tests that use either (and every test under tests/engines) are marked `engine` and run last (collection
  order), so that the builds overlap everything else; `./dev test` runs them in a pytest session of their own
  beside the others (`-m engine`).

Tiers (DESIGN.md §13): `./dev test` (CI) runs every test. The `fast` marker is the iteration tier
(`./dev test --fast`, or `pytest -m fast`): every test under FAST_DIRS (unit tests and pure logic: no node,
Redis, Ray, engine, fuzzing or benchmark run) plus the modules elsewhere that opt in with
`pytestmark = pytest.mark.fast` because they are pure too (not the transformers oracle of tests/workers: half
the tier's time on its own). It must stay under 3 minutes on a busy 2-vCPU box.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devkit.engines import ENGINE_VENV, SGLANG_VENV, engine_python, engine_venv_ready, sglang_venv_ready
from devkit.engines import sglang_python as sglang_python_path

REQUIRED = os.environ.get("KVSTORE_REQUIRE_ENGINES") == "1"  # set by ./dev test
TESTS = Path(__file__).resolve().parent
FAST_DIRS = frozenset({"unit", "kernels"})  # the fast tier, whole directories (see above)
ENGINE_FIXTURES = frozenset({"vllm_python", "sglang_python"})  # tests on a side venv: run last


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


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    if not sglang_venv_ready():
        msg = (f"the SGLang venv {SGLANG_VENV} is missing or incomplete: run tools/sglang_venv.sh (./dev test does, "
               "in the background; about 7 minutes and 2.6 GB the first time; its output is in "
               f"{SGLANG_VENV.parent / 'sglang-setup.log'} under ./dev test)")  # fmt: skip
        if REQUIRED:
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return sglang_python_path()


def in_fast_dir(path: Path) -> bool:
    """Whether a test file lies in a directory whose every test is in the fast tier."""
    rel = path.resolve().relative_to(TESTS)
    return len(rel.parts) > 1 and rel.parts[0] in FAST_DIRS


def in_dir(path: Path, top: str) -> bool:
    """Whether a test file lies under tests/`top`/."""
    rel = path.resolve().relative_to(TESTS)
    return len(rel.parts) > 1 and rel.parts[0] == top


@pytest.hookimpl(tryfirst=True)  # NOTE: before `-m` deselects, so `-m fast` sees the marks added here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast tier marked; tests on the engine venv marked `engine` and last (a stable sort: every other order is kept)."""
    for item in items:
        if in_fast_dir(item.path):
            item.add_marker(pytest.mark.fast)
        # NOTE: the rest of tests/engines too (the conformance table's Ray rows, the engines' README commands):
        # engine work, and the engine session has time to spare while the other waits on its processes.
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) or in_dir(item.path, "engines"):
            item.add_marker(pytest.mark.engine)
    items.sort(key=lambda item: bool(ENGINE_FIXTURES & set(getattr(item, "fixturenames", ()))))
