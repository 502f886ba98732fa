"""A real engine on loopback, for tests, benchmarks and the engine demo: vLLM (CPU build) through
LMCache's multiprocess connector to an `lmcache server` whose L2 is a kvstore node (or a peer).

Everything engine-side runs in the engine venv `.engines/vllm` (made by tools/vllm_venv.sh: vLLM's
CPU build, LMCache 0.5.6 and this checkout of kvstore); this module only starts and stops processes,
so it runs under the project's own interpreter. Every process starts in a session of its own and is
stopped with its whole process group (vLLM's workers outlive a killed parent otherwise), every wait is
bounded, and every port is a free loopback port.

Facts this relies on (/work/shared/engines/README.md): PYTHONHASHSEED=0 in every engine process (vLLM
hashes prompt blocks with Python's hash in its scheduler and workers); a random Llama without a
tokenizer (prompts as token ids); INIT_RANGE 0.3 so that a wrong KV cache changes the outputs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.cli.engines import DEFAULT_ENGINE_PYTHON
from kvstore.cli.waits import free_port, wait_port

REPO = Path(__file__).resolve().parents[1]
ENGINE_VENV = DEFAULT_ENGINE_PYTHON.parents[1]  # .engines/vllm of this checkout: one definition
VENV_SCRIPT = REPO / "tools" / "vllm_venv.sh"
DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"
CHUNK = 256  # LMCache's chunk size (tokens) in these runs: LMCache's default


ENGINE_STAMP = ENGINE_VENV / ".kvstore-engine-installed"  # tools/vllm_venv.sh writes it once all of it works
# tools/vllm_venv.sh holds this lock (flock) while it installs; `./dev test` runs it in the background.
ENGINE_LOCK = ENGINE_VENV.parent / f".{ENGINE_VENV.name}.lock"


SGLANG_VENV = REPO / ".engines" / "sglang"  # tools/sglang_venv.sh: SGLang 0.5.23 (no CUDA packages), CPU torch
SGLANG_STAMP = SGLANG_VENV / ".kvstore-sglang-installed"
SGLANG_LOCK = SGLANG_VENV.parent / f".{SGLANG_VENV.name}.lock"
SGLANG_SCRIPT = REPO / "tools" / "sglang_venv.sh"
# `./dev test` builds the SGLang venv after the vLLM one; this file says it is queued or running (removed after).
SGLANG_PENDING = SGLANG_VENV.parent / ".sglang.pending"


def sglang_python() -> Path:
    """The SGLang venv's python (it may not exist yet: `./dev test` builds it in the background)."""
    return SGLANG_VENV / "bin" / "python"


def sglang_venv_ready(wait_s: float = 1800.0) -> bool:
    """Whether the SGLang venv is complete, after waiting (at most `wait_s`) for an install running now."""
    deadline = time.monotonic() + wait_s
    while SGLANG_PENDING.exists() and time.monotonic() < deadline:
        time.sleep(1.0)  # queued behind the vLLM venv's build, or building
    return _venv_ready(SGLANG_LOCK, sglang_python(), SGLANG_STAMP, max(0.0, deadline - time.monotonic()))


def engine_python() -> Path:
    """The engine venv's python (it may not exist yet: see ensure_engine_venv)."""
    return ENGINE_VENV / "bin" / "python"


def engine_venv_ready(wait_s: float = 1800.0) -> bool:
    """Whether the engine venv is complete, after waiting (at most `wait_s`) for an install that is running
    now (`./dev test` builds it in the background while the other tests run) to finish."""
    return _venv_ready(ENGINE_LOCK, engine_python(), ENGINE_STAMP, wait_s)


def _venv_ready(lock_path: Path, python: Path, stamp: Path, wait_s: float) -> bool:
    """A venv script's venv is complete (its stamp written), once no install holds its lock (bounded wait)."""
    if lock_path.exists():
        import fcntl

        with open(lock_path, "rb") as lock:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)  # free once no install holds it
                    fcntl.flock(lock, fcntl.LOCK_UN)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(1.0)
    return python.exists() and stamp.exists()


def ensure_engine_venv(log: Path | None = None) -> Path:
    """Create the engine venv if needed (tools/vllm_venv.sh: minutes the first time, then instant)."""
    out = open(log, "ab") if log else None  # noqa: SIM115 - closed below
    try:
        subprocess.run(["bash", str(VENV_SCRIPT)], check=True, stdout=subprocess.DEVNULL,
                       stderr=out or None, timeout=1800)  # fmt: skip
    finally:
        if out:
            out.close()
    return engine_python()


def engine_env(**extra: str) -> dict[str, str]:
    """The environment of every engine-side process."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "LMCACHE_TRACK_USAGE": "false",
           "TOKENIZERS_PARALLELISM": "false", **extra}  # fmt: skip
    env.pop("VIRTUAL_ENV", None)
    return env


class GroupProcess:
    """A child in a session of its own, its output in a log file; stop() ends its whole process group."""

    def __init__(self, args: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args = [str(a) for a in args]
        self.log = log
        self._out = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.args, stdout=self._out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=REPO)  # fmt: skip

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM to the group, then SIGKILL to whatever of it is left after `grace` seconds."""
        if self.alive():
            self.signal(signal.SIGTERM)
            self.wait(grace)
        self.signal(signal.SIGKILL)  # the group's other members too, even if the leader already exited
        code = self.wait(10)
        if not self._out.closed:
            self._out.close()
        return code

    def __enter__(self) -> GroupProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def make_model(python: Path, out: Path, *, hidden: int = 256, layers: int = 4, intermediate: int = 512,
               init_range: float = 0.3, vocab: int = 4096, timeout: float = 300) -> Path:  # fmt: skip
    """A random-weight Llama in Hugging Face format (seed 0), made by the engine venv's transformers."""
    if (out / "config.json").exists():
        return out
    code = (
        "import sys, torch\nfrom transformers import LlamaConfig, LlamaForCausalLM\n"
        "torch.manual_seed(0)\n"
        f"cfg = LlamaConfig(vocab_size={vocab}, hidden_size={hidden}, intermediate_size={intermediate}, "
        f"num_hidden_layers={layers}, num_attention_heads={max(1, hidden // 64)}, "
        f"num_key_value_heads={max(2, hidden // 256)}, head_dim=64, max_position_embeddings=8192, "
        f"initializer_range={init_range}, torch_dtype='bfloat16', tie_word_embeddings=False)\n"
        "LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])\n"
    )
    subprocess.run([str(python), "-c", code, str(out)], check=True, env=engine_env(), timeout=timeout,
                   capture_output=True)  # fmt: skip
    return out


def kvstore_l2(addr: str | None = None, *, redis_url: str | None = None, **params: object) -> dict[str, object]:
    """The `--l2-adapter` spec of kvstore's adapter (see kvstore/integrations/lmcache_l2.py)."""
    where: dict[str, object] = {"target": addr} if addr else {"redis_url": redis_url}
    return {"type": "plugin", "module_path": "kvstore.integrations.lmcache_l2", "class_name": "KVStoreL2Adapter",
            "adapter_params": {**where, **params}}  # fmt: skip


class LMCacheServer(GroupProcess):
    """`lmcache server` (LMCache's multiprocess mode) on a free loopback port, with the given L2 adapters."""

    def __init__(self, python: Path, log: Path, l2: Sequence[dict[str, object]] = (), *, chunk_size: int = CHUNK,
                 l1_size_gb: float = 1.0, extra: Sequence[str] = (), env: dict[str, str] | None = None,
                 timeout: float = 120) -> None:  # fmt: skip
        self.port = free_port()
        self.http_port = free_port()
        lmcache = python.parent / "lmcache"
        args = [str(lmcache), "server", "--host", "127.0.0.1", "--port", str(self.port), "--chunk-size",
                str(chunk_size), "--l1-size-gb", str(l1_size_gb), "--no-l1-use-lazy", "--supported-transfer-mode",
                "auto", "--shm-name", f"kvstore-test-{self.port}", "--http-port", str(self.http_port),
                "--eviction-policy", "LRU", "--disable-metrics", *extra]  # fmt: skip
        for spec in l2:
            args += ["--l2-adapter", json.dumps(spec)]
        super().__init__(args, log, env or engine_env())
        try:
            wait_port("127.0.0.1", self.port, timeout, self.proc, self.log, what="lmcache server", poll=0.1)
        except BaseException:
            self.stop()
            raise


@dataclass
class EngineRun:
    """What one engine process reported: its start time and each request's result, by name."""

    up_s: float | None = None
    results: dict[str, dict] = field(default_factory=dict)
    log: str = ""


class Engine(GroupProcess):
    """One fresh vLLM engine serving `requests` in order (devkit/vllm_driver.py). A request given
    `pause=True` waits for `go(name)`, so the caller can change things between two requests."""

    def __init__(self, python: Path, model: Path, requests: Sequence[dict], log: Path, *,
                 connector_port: int | None = None, hold_s: float = 0.0, dtype: str = "bfloat16") -> None:  # fmt: skip
        self.dir = Path(tempfile.mkdtemp(prefix="engine-", dir=log.parent))
        reqs = []
        for req in requests:
            r = dict(req)
            if r.pop("pause", False):
                r["wait_file"] = str(self.dir / f"go-{r['name']}")
            reqs.append(r)
        cfg = {"model": str(model), "requests": reqs, "hold_s": hold_s, "dtype": dtype,
               "connector": {"host": "127.0.0.1", "port": connector_port} if connector_port else None}  # fmt: skip
        (self.dir / "config.json").write_text(json.dumps(cfg))
        super().__init__([str(python), str(DRIVER), str(self.dir / "config.json")], log, engine_env())

    def run(self) -> EngineRun:
        """What the engine has reported so far."""
        run = EngineRun(log=self.log.read_text(errors="replace"))
        for line in run.log.splitlines():
            if line.startswith("ENGINE_UP "):
                run.up_s = float(line.split()[1])
            elif line.startswith("RESULT "):
                res = json.loads(line[len("RESULT ") :])
                run.results[res["name"]] = res
        return run

    def result(self, name: str, timeout: float = 600) -> dict:
        """The result of request `name`, waiting for it (bounded); RuntimeError if the engine dies first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.run().results.get(name)
            if got is not None:
                return got
            if not self.alive():
                raise RuntimeError(f"engine exited with {self.proc.returncode} before request {name}:\n{self.tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"engine gave no result for {name} in {timeout:g}s:\n{self.tail()}")

    def stop(self, grace: float = 10.0) -> int | None:
        code = super().stop(grace)
        shutil.rmtree(self.dir, ignore_errors=True)
        return code

    def go(self, name: str) -> None:
        (self.dir / f"go-{name}").touch()

    def finish(self, timeout: float = 600) -> EngineRun:
        """Wait for the engine to exit (bounded); RuntimeError with the log tail if it failed."""
        code = self.wait(timeout)
        if code is None:
            raise TimeoutError(f"engine did not finish in {timeout:g}s:\n{self.tail()}")
        if code != 0:
            raise RuntimeError(f"engine exited with {code}:\n{self.tail()}")
        return self.run()


def run_engine(python: Path, model: Path, requests: Sequence[dict], log: Path, *, connector_port: int | None = None,
               timeout: float = 600, hold_s: float = 0.0, dtype: str = "bfloat16") -> EngineRun:  # fmt: skip
    """One fresh engine serving `requests` in order, then stopped with its whole process group."""
    engine = Engine(python, model, requests, log, connector_port=connector_port, hold_s=hold_s, dtype=dtype)
    try:
        return engine.finish(timeout)
    finally:
        engine.stop()


def prompt(n: int, salt: int = 7919) -> list[int]:
    """n deterministic token ids in [10, 4010): a prompt of a vocab-4096 test model."""
    return [(i * salt) % 4000 + 10 for i in range(n)]
