"""The chart's engine roles (engines: vLLM + an LMCache multiprocess server with kvstore's L2 adapter):
the sidecar's command line parsed by LMCache's own parser and its --l2-adapter by LMCache's own adapter
config loader; vLLM's kv_transfer_config aimed at that sidecar; the pod's shared pieces; and the chart and
`kvstore up --values` building the same wiring (kvstore/cli/engines.py). vLLM's own parser checks the vLLM
command line where vLLM's CPU build is installed (.engines/vllm, as tests/engines install it)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstore.cli.engines import adapter_params, kv_transfer_config, l2_adapter_spec, plan_engines
from tests.deploy.commands import container_env
from tests.deploy.conftest import CHART, ROOT, render

PRODUCTION = ROOT / "deploy" / "values" / "production.yaml"
ENGINES = ["engines.enabled=true"]


def engine_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-engine")]
    return dep["spec"]["template"]["spec"]


def sidecar(spec: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in spec["initContainers"] if c["name"] == "lmcache")


def vllm(spec: dict[str, Any]) -> dict[str, Any]:
    (c,) = spec["containers"]
    return c


def flags(argv: list[str]) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def lmcache_parse(argv: list[str]) -> argparse.Namespace:
    """`lmcache ARGV...` through LMCache's own CLI parser (what its `main` builds), without running it."""
    pytest.importorskip("lmcache", reason="LMCache is installed by ./dev test (setup_lmcache)")
    from lmcache.cli.commands import register_commands

    parser = argparse.ArgumentParser(prog="lmcache")
    register_commands(parser.add_subparsers(dest="command"), argv)
    return parser.parse_args(argv)


def adapter_configs(args: argparse.Namespace) -> list[Any]:
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    return list(parse_args_to_l2_adapters_config(args).adapters)


CPU_TENANT = {"engines": {"enabled": True, "gpu": {"count": 0},
                          "lmcache": {"tenant": "alice", "namespace": "chat", "transport": "tcp", "timeoutS": 2.5}},
              "auth": {"enabled": True, "allowPlaintextTokens": True, "tenants": [{"name": "alice"}]}}  # fmt: skip


@pytest.mark.parametrize(("profile", "extra"), [(PRODUCTION, {}), (None, {"engines": {"enabled": True}}),
                                                (None, CPU_TENANT)], ids=["production", "defaults", "cpu-tenant"])  # fmt: skip
def test_sidecar_parses_with_lmcache_and_loads_kvstores_adapter_aimed_at_the_local_node(
    profile: Path | None, extra: dict, tmp_path: Path
) -> None:
    (f := tmp_path / "extra.yaml").write_text(yaml.safe_dump(extra))
    docs = render([*([profile] if profile else []), f])
    spec = engine_pod(docs)
    lm = sidecar(spec)
    argv = [*lm["command"], *lm["args"]]
    assert argv[:2] == ["lmcache", "server"]
    args = lmcache_parse(argv[1:])
    assert args.host == "127.0.0.1"  # LMCache's ZMQ server has no authentication
    (cfg,) = adapter_configs(args)
    assert (cfg.module_path, cfg.class_name) == ("kvstore.integrations.lmcache_l2", "KVStoreL2Adapter")
    params = cfg.adapter_params
    # The node on the engine's own host: a Service that routes only to node pods on the caller's host.
    host, port = params["target"].rsplit(":", 1)
    (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == host]
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "node"
    assert svc["spec"]["ports"] == [{"name": "grpc", "port": int(port), "targetPort": "grpc", "appProtocol": "grpc"}]
    env = container_env(lm)
    assert env["PYTHONHASHSEED"] == "0" and env["KVSTORE_LOCAL_SOCKET"] == "/var/run/kvstore/node.sock"
    gpus = int(vllm(spec)["resources"]["limits"].get("nvidia.com/gpu", 0))
    assert (env.get("NVIDIA_VISIBLE_DEVICES") == "all") == (gpus > 0)  # CUDA IPC: the sidecar sees vLLM's GPUs
    assert ("--shm-name=kv-kvstore-engine" in lm["args"]) == (gpus == 0)
    if extra is CPU_TENANT:
        assert params == {"target": params["target"], "namespace": "chat", "transport": "tcp", "timeout_s": 2.5,
                          "token_file": "/etc/kvstore/token/engine.token"}  # fmt: skip
        assert env["KVSTORE_TOKEN_FILE"] == "/etc/kvstore/token/engine.token"
        token = next(v for v in spec["volumes"] if v["name"] == "kvstore-token")["secret"]
        assert token["items"] == [{"key": "tenant-alice.token", "path": "engine.token"}]  # its tenant's, alone
    # A native sidecar, ready before vLLM starts; vLLM gets the GPUs and the same /dev/shm.
    assert lm["restartPolicy"] == "Always" and "python3" in lm["startupProbe"]["exec"]["command"]
    assert spec["shareProcessNamespace"] is True
    dshm = {"name": "dshm", "mountPath": "/dev/shm"}
    assert dshm in lm["volumeMounts"] and dshm in vllm(spec)["volumeMounts"]


def test_vllm_connector_points_at_the_sidecar() -> None:
    for files, sets in (([PRODUCTION], []), ([], [*ENGINES, "engines.lmcache.port=6000"])):
        spec = engine_pod(render(files, sets))
        v, lm = vllm(spec), sidecar(spec)
        assert v["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        ktc = json.loads(flags(v["args"])["kv-transfer-config"])
        assert ktc == kv_transfer_config(int(flags(lm["args"])["port"]))  # the one the local run builds
        assert container_env(v)["PYTHONHASHSEED"] == "0"
        assert v["ports"] == [{"name": "http", "containerPort": int(flags(v["args"])["port"])}]
    prod = engine_pod(render([PRODUCTION]))
    assert "--tensor-parallel-size=4" in vllm(prod)["args"] and vllm(prod)["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_cluster_target_names_the_index_without_credentials_and_no_local_service() -> None:
    docs = render(sets=[*ENGINES, "engines.lmcache.target=cluster", "redis.auth.enabled=false"])
    (cfg,) = adapter_configs(lmcache_parse(["server", *sidecar(engine_pod(docs))["args"]]))
    assert cfg.adapter_params == {"redis_url": "redis://kv-kvstore-redis:6379/0"}
    assert not [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-node-local")]


def test_chart_and_local_run_build_the_same_adapter_spec(tmp_path: Path) -> None:
    """templates/_helpers.tpl and kvstore/cli/engines.py write one wiring: the chart's --l2-adapter equals
    the local builder's for the same values, and the local `lmcache server` argv parses with LMCache."""
    from kvstore.cli.values import load_values

    sets = [*ENGINES, "auth.enabled=true", "auth.allowPlaintextTokens=true", "engines.lmcache.namespace=ns1",
            "engines.lmcache.transport=ucx", "engines.lmcache.timeoutS=3"]  # fmt: skip
    chart_spec = json.loads(flags(sidecar(engine_pod(render(sets=sets)))["args"])["l2-adapter"])
    values = {"engines": {"enabled": True, "lmcache": {"namespace": "ns1", "transport": "ucx", "timeoutS": 3}},
              "auth": {"enabled": True, "allowPlaintextTokens": True},
              "local": {"engines": {"modelPath": str(tmp_path)}}}  # fmt: skip
    (tmp_path / "config.json").write_text("{}")
    (f := tmp_path / "v.yaml").write_text(yaml.safe_dump(values))
    plan = plan_engines(load_values([f], CHART), Path(sys.executable), missing=[])
    assert plan is not None and plan.skip_tokenizer  # no tokenizer files: prompts as token ids
    target = chart_spec["adapter_params"]["target"]
    local_argv = plan.lmcache_argv(7777, target, "/etc/kvstore/token/engine.token", "shm0")
    assert local_argv[1:4] == ["-m", "lmcache.cli.main", "server"]
    local_spec = json.loads(flags(local_argv)["l2-adapter"])
    assert local_spec == chart_spec
    assert local_spec == l2_adapter_spec(adapter_params(target=target, namespace="ns1", transport="ucx",
                                                        timeout_s=3, token_file="/etc/kvstore/token/engine.token"))  # fmt: skip
    (cfg,) = adapter_configs(lmcache_parse(local_argv[3:]))
    assert cfg.adapter_params["target"] == target
    ktc = json.loads(flags(plan.vllm_argv(8001, 7777))["kv-transfer-config"])
    assert ktc["kv_connector_extra_config"]["lmcache.mp.port"] == 7777


def test_adapter_params_take_one_target() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        adapter_params(target="h:1", redis_url="redis://h:6379/0")
    with pytest.raises(ValueError, match="exactly one"):
        adapter_params()


def test_vllm_command_line_parses_with_vllms_own_parser(vllm_python: Path) -> None:
    """Where vLLM is installed: its OpenAI server's parser takes the rendered flags, and its
    KVTransferConfig takes the connector config."""
    v = vllm(engine_pod(render([PRODUCTION])))
    probe = """
import json, sys
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
from vllm.config import KVTransferConfig
try:  # vLLM 0.32 moved the OpenAI server's parser; the module the chart runs is still there
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
ktc = args.kv_transfer_config
cfg = ktc if isinstance(ktc, KVTransferConfig) else KVTransferConfig(**json.loads(ktc))
print(json.dumps({"connector": cfg.kv_connector, "port": args.port, "model": args.model}))
"""
    r = subprocess.run([str(vllm_python), "-c", probe, *v["args"]], capture_output=True, text=True,
                       timeout=300, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"connector": "LMCacheMPConnector", "port": 8000, "model": "/models/llama-3-70b"}
