"""Every command in the README's fenced blocks is checked here or names the test that runs it.

Commands are read from the README itself (devkit/readme.py), so a new or edited command is checked the day
it is written. What each kind gets:
- `kvstore ...`, `kvctl ...` (also inside `kubectl exec ... --`): parsed by our own CLI parsers with every
  `[optional]` flag and `a|b` value the README shows, and sizes parsed as the node parses them; what the
  commands do is the subject of tests/integration (serve, up, nvme, stats, nodes, top, tenants, TLS, tokens);
- `./dev demo`: runs `kvstore pd-demo`, which tests/integration/test_readme_demos.py runs; `./dev test` is
  what CI runs; `./dev demo --engine vllm` (prose) runs the module tests/engines/test_engine_demo.py runs;
- `printf ... > tenants.toml`: run by bash, and the file it writes loaded by the node's tenants loader; the
  KV-event feed's CURVE key setup (`mkdir`, `python -c ...`, `chmod`, `grep | cut > subscribers`) likewise, its files
  loaded by the node's own checks and its Python subscriber lines run on them;
- `curl .../metrics | grep NAME`: the metric is scraped from a real node by tests/integration/test_metrics.py;
- `helm install`: the same values and `--set`s rendered offline by `helm template`, and the names the next
  lines use (`ds/kv-kvstore-node`, container `node`) found in the render; `helm test`: the chart's test hook
  exists (a cluster runs it: tests/deploy renders and parses it);
- `python devkit/kv_events_sub.py`: parsed by its own parser; `python -m sglang.launch_server`: SGLang does
  not install here, so its kvstore part (the HiCache extra config) goes through the backend's own parser;
- `vllm serve`, `lmcache server`: parsed by vLLM's and LMCache's own parsers in the engine venv
  (tests/engines/test_readme_engine_commands.py);
- the Python block runs against a real node (tests/integration/test_readme_demos.py); the YAML block is
  loaded by LMCache's loader (tests/lmcache/test_plugin.py::test_the_readme_yaml_is_a_working_lmcache_config).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from devkit.readme import README, Command, all_commands, blocks, commands
from tests.deploy.commands import parse

REPO = README.parent
COMMANDS = all_commands()
# Programs whose commands are checked by a test elsewhere, and where.
ELSEWHERE = {
    "vllm": "tests/engines/test_readme_engine_commands.py",
    "lmcache": "tests/engines/test_readme_engine_commands.py",
}


def ids(c: Command) -> str:
    return f"L{c.line}-{' '.join(c.argv[:3])}"[:60]


def by_program(*names: str) -> list[Command]:
    return [c for c in COMMANDS if c.program in names]


def test_the_readme_has_the_commands_this_file_checks() -> None:
    """Every command's program is one this file knows how to check; nothing is left out by a parse slip."""
    known = {
        "./dev",
        "kvstore",
        "kvctl",
        "printf",
        "mkdir",
        "chmod",
        "grep",
        "curl",
        "helm",
        "kubectl",
        "python",
        *ELSEWHERE,
    }
    assert not [c.text for c in COMMANDS if c.program not in known]
    assert len(by_program("kvstore", "kvctl")) >= 10 and by_program("./dev") and by_program("helm")
    assert {b.lang for b in blocks()} <= {"bash", "python", "yaml"}
    for program, test in ELSEWHERE.items():
        assert (REPO / test).exists() and by_program(program), (program, test)


@pytest.mark.parametrize("cmd", by_program("kvstore", "kvctl"), ids=ids)
def test_kvstore_and_kvctl_commands_parse(cmd: Command, monkeypatch: pytest.MonkeyPatch) -> None:
    for argv in cmd.variants():
        parse([cmd.program, *argv[1:]], cmd.env, monkeypatch)


@pytest.mark.parametrize("cmd", by_program("./dev"), ids=ids)
def test_dev_commands_exist(cmd: Command) -> None:
    script = (REPO / "dev").read_text()
    branches = re.findall(r"^  (\w+)\)", script, re.M)
    assert cmd.argv[1] in branches, f"./dev has no '{cmd.argv[1]}' (it has {branches})"
    if cmd.argv[1:] == ["demo"]:  # what tests/integration/test_readme_demos.py runs
        assert '"$VENV/bin/kvstore" pd-demo "$@"' in script


def test_the_tenants_file_the_readme_writes_loads(tmp_path: Path) -> None:
    (cmd,) = by_program("printf")
    subprocess.run(["bash", "-c", cmd.text], cwd=tmp_path, check=True, timeout=30)
    from kvstore.names import TierKind
    from kvstore.node.tenancy import load_tenants_file

    alice = load_tenants_file(tmp_path / "tenants.toml")["alice"]
    assert alice.shares == {TierKind.DRAM: 2 << 30, TierKind.NVME: 50 << 30}
    serve = next(c for c in by_program("kvstore") if "--tenants-file" in c.argv)
    assert serve.argv[serve.argv.index("--tenants-file") + 1] == "tenants.toml"


def test_the_metric_the_readme_greps_is_scraped_by_a_test() -> None:
    (cmd,) = [c for c in by_program("curl") if "/metrics" in c.text]
    metric = cmd.argv[-1]
    assert cmd.argv[2].endswith("/metrics") and metric.startswith("kvstore_")
    assert f'"{metric}"' in (REPO / "tests" / "integration" / "test_metrics.py").read_text()


def _helm_render(argv: list[str]) -> list[dict[str, Any]]:
    from tests.deploy.conftest import helm

    assert argv[:2] == ["helm", "install"]
    release, chart, *rest = argv[2:]
    out = helm("template", release, str(REPO / chart), *[str(REPO / a) if a.endswith(".yaml") else a for a in rest])
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_the_helm_install_renders_and_names_what_the_next_lines_use(monkeypatch: pytest.MonkeyPatch) -> None:
    install, test_hook = by_program("helm")
    docs = _helm_render(install.argv)
    release = install.argv[2]
    assert test_hook.argv == ["helm", "test", release]
    assert any(d.get("metadata", {}).get("annotations", {}).get("helm.sh/hook") == "test" for d in docs)
    (kubectl,) = by_program("kubectl")
    target = kubectl.argv[kubectl.argv.index("-it") + 1]
    kind, name = target.split("/")
    container = kubectl.argv[kubectl.argv.index("-c") + 1]
    workload = [d for d in docs if d["kind"] == {"ds": "DaemonSet", "sts": "StatefulSet"}[kind]
                and d["metadata"]["name"] == name]  # fmt: skip
    assert workload, f"{target}: not in the render of {' '.join(install.argv)}"
    containers = {c["name"] for c in workload[0]["spec"]["template"]["spec"]["containers"]}
    assert container in containers, (container, containers)
    inner = kubectl.argv[kubectl.argv.index("--") + 1 :]
    parse(inner, {}, monkeypatch)


def test_kv_events_sub_command_parses() -> None:
    from devkit.kv_events_sub import parser

    (cmd,) = [c for c in by_program("python") if "devkit/kv_events_sub.py" in c.argv]
    args = parser().parse_args(cmd.argv[2:])
    assert args.endpoints == ["tcp://127.0.0.1:5557"]
    serve = next(c for c in by_program("kvstore") if "--kv-events-endpoint" in c.argv)
    assert serve.argv[serve.argv.index("--kv-events-endpoint") + 1] == "5557"  # a bare port: the gRPC host


def test_the_kv_events_curve_setup_works_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key commands run by bash (`python` being this interpreter), then: the node accepts the files its
    command line names, and the README's pyzmq subscriber lines load the keys."""
    import sys

    import zmq
    import zmq.auth  # noqa: F401  # the README lines call zmq.auth.load_certificate (the submodule loaded)

    from kvstore.config import check_events_access
    from kvstore.node.kv_events import read_subscribers_file
    from kvstore.scoping import DEFAULT_TENANT

    (block,) = [b for b in blocks() if b.lang == "bash" and "create_certificates" in b.text]
    setup = [c for c in commands(block) if c.program != "kvstore"]
    assert [c.program for c in setup] == ["mkdir", "python", "chmod", "grep"]
    for c in setup:
        line = re.sub(r"^python ", f"{sys.executable} ", c.text.split("    #")[0])
        subprocess.run(["bash", "-c", line], cwd=tmp_path, check=True, timeout=60)
    (serve,) = [c for c in commands(block) if c.program == "kvstore"]
    parse([serve.program, *serve.argv[1:]], serve.env, monkeypatch)
    opt = {a: serve.argv[i + 1] for i, a in enumerate(serve.argv) if a.startswith("--kv-events-")}
    secret, subscribers = (tmp_path / opt[k] for k in ("--kv-events-curve-secret-file", "--kv-events-subscribers-file"))
    check_events_access(f"tcp://0.0.0.0:{opt['--kv-events-endpoint']}", str(secret), str(subscribers), False)
    assert list(read_subscribers_file(str(subscribers)).values()) == [DEFAULT_TENANT]  # the indexer: every topic
    (sub_lines,) = [b.text for b in blocks() if b.lang == "python" and "curve_serverkey" in b.text]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        monkeypatch.chdir(tmp_path)
        exec(compile(sub_lines, "README.md", "exec"), {"sub": sub, "zmq": zmq})  # loads both keys, sets them
    finally:
        sub.close(0)
        ctx.term()


def test_sglang_hicache_extra_config_is_one_the_backend_takes() -> None:
    """SGLang itself does not install here; the part of its command line that is kvstore's is checked."""
    import importlib

    from kvstore.integrations.sglang_hicache import parse_extra_config

    (cmd,) = [c for c in by_program("python") if "--hicache-storage-backend-extra-config" in c.argv]
    extra = json.loads(cmd.argv[cmd.argv.index("--hicache-storage-backend-extra-config") + 1])
    settings = parse_extra_config(extra)
    assert settings.target.addr == "127.0.0.1:50051"
    assert hasattr(importlib.import_module(extra["module_path"]), extra["class_name"])


def test_python_and_yaml_blocks_are_well_formed() -> None:
    py = [b for b in blocks() if b.lang == "python"]
    ya = [b for b in blocks() if b.lang == "yaml"]
    assert py and ya
    for b in py:
        compile(b.text, f"README.md:{b.line}", "exec")
    for b in ya:
        assert isinstance(yaml.safe_load(b.text), dict)


def test_the_retention_curls_carry_hints_each_door_reads() -> None:
    """The README's curl bodies for vLLM's server: LMCache's request configs and the vLLM tier's
    kv_transfer_params each parse to the session they name, through the parser of their door."""
    from kvstore.integrations.hints import from_lmcache, from_vllm

    bodies = [json.loads(c.argv[c.argv.index("-d") + 1]) for c in by_program("curl") if "/v1/completions" in c.text]
    assert len(bodies) == 2, bodies
    got = [from_lmcache(bodies[0]["kv_transfer_params"]), from_vllm(bodies[1]["kv_transfer_params"])]
    assert [h.session if h else None for h in got] == ["conv-42", "conv-42"]
    assert got[0] is not None and got[0].ttl_s == 600 and got[0].mode is not None
    assert got[1] is not None and got[1].priority == 80 and not got[1].end
