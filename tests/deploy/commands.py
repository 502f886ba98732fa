"""Container command lines of rendered manifests, parsed by our own CLI parsers (typer/click), so a
renamed or retyped flag fails the build instead of a rollout."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import typer

from kvstore.config import parse_size

# Programs in the chart that are not ours: what may run them, and why the test leaves them alone.
FOREIGN = {
    "sh": "shell one-liners: the Redis pod's auth include and probe, the socket directory's owner, the memlock check",
    "chown": "the NVMe hostPath permission init container",
    "redis-server": "checked by starting a real redis-server on the rendered redis.conf",
    "lmcache": "the engines' LMCache sidecar: parsed by LMCache's own parser (tests/deploy/test_chart_engines.py)",
    "python3": "vLLM's OpenAI server (parsed by vLLM's parser where vLLM is installed) and the sidecar's probe",
}
# Flags the chart renders ahead of the code that takes them (a contract with work on another branch):
# dropped before parsing only while the command lacks them, so once the option lands it is parsed for real.
PENDING_FLAGS: dict[tuple[str, str], dict[str, str]] = {
    ("kvstore", "serve"): {"--local-socket": "the same-host plane's socket (DESIGN.md §8.1)"},
}
_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def pod_specs(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every pod template in a manifest, RayCluster groups included."""
    kind, name = doc["kind"], doc["metadata"]["name"]
    spec = doc.get("spec", {})
    if kind == "Pod":
        yield f"Pod/{name}", spec
    elif kind in ("DaemonSet", "StatefulSet", "Deployment", "Job"):
        yield f"{kind}/{name}", spec["template"]["spec"]
    elif kind == "RayCluster":
        yield f"RayCluster/{name}/head", spec["headGroupSpec"]["template"]["spec"]
        for g in spec.get("workerGroupSpecs", []):
            yield f"RayCluster/{name}/{g['groupName']}", g["template"]["spec"]


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: valueFrom becomes a placeholder, and
    $(VAR) references to variables defined earlier are expanded."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        raw = e.get("value", f"<{e['name'].lower()}-from-cluster>" if "valueFrom" in e else "")
        env[e["name"]] = _REF.sub(lambda m: env.get(m.group(1), m.group(0)), raw)
    return env


def argvs(container: dict[str, Any]) -> Iterator[tuple[str, list[str]]]:
    """(what, argv) of the container's command and of its exec probes, $(VAR) expanded."""
    env = container_env(container)

    def expand(items: list[str]) -> list[str]:
        return [_REF.sub(lambda m: env.get(m.group(1), m.group(0)), str(a)) for a in items]

    cmd = container.get("command", []) + container.get("args", [])
    if cmd:
        yield "command", expand(cmd)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        exec_ = container.get(probe, {}).get("exec")
        if exec_:
            yield probe, expand(exec_["command"])


def parse(argv: list[str], env: dict[str, str], monkeypatch: Any) -> dict[str, Any]:
    """Parse `argv` with the kvstore/kvctl parsers (options from `env` as the container would have
    them); returns the parsed parameters. Raises the parser's UsageError on a bad flag or value."""
    from kvstore.cli.kvctl import app as kvctl_app
    from kvstore.cli.main import app as kvstore_app

    prog, sub, *rest = argv
    group = typer.main.get_command({"kvstore": kvstore_app, "kvctl": kvctl_app}[prog])
    root = group.context_class(group, info_name=prog)
    cmd = group.get_command(root, sub)
    if cmd is None:
        raise AssertionError(f"{prog} has no command {sub!r} (have {sorted(group.list_commands(root))})")
    known = {opt for p in cmd.params for opt in p.opts}
    pending = {f for f in PENDING_FLAGS.get((prog, sub), {}) if f not in known}
    rest = [a for a in rest if a.split("=", 1)[0] not in pending]
    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        params = cmd.make_context(sub, rest, parent=root).params
    if (prog, sub) == ("kvstore", "serve"):  # sizes are parsed by the command itself: check them too
        for k in ("dram_bytes", "nvme_bytes", "hbm_bytes", "max_page_bytes"):
            if params.get(k) is not None:
                parse_size(params[k])
    return params
