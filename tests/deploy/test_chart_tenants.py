"""The chart's tenancy (auth.tenants, SECURITY.md): token Secrets that carry tenants, the tenants file,
per-tenant Redis index users; rendered over the production profile, validated like every profile, and the
index users tried on a real redis-server."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvstore.names import TierKind
from tests.deploy.commands import argvs, container_env, parse, pod_specs
from tests.deploy.conftest import ROOT, helm, render
from tests.deploy.test_chart import CHART, K8S_VERSIONS, by_kind, containers, values_of

TENANTS = {"auth": {"tenants": [
    {"name": "alice", "dramBytes": "2Gi", "nvmeBytes": "50Gi", "mtlsSubjects": ["alice-engine.clients.example"]},
    {"name": "bob.team"},
]}}  # fmt: skip


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    f = tmp_path / "tenants.yaml"
    f.write_text(yaml.safe_dump(TENANTS))
    return [ROOT / "deploy" / "values" / "production.yaml", f]


def test_tenants_render_lint_and_validate(files: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["lint", "--strict", str(CHART)]
    for f in files:
        args += ["-f", str(f)]
    assert "0 chart(s) failed" in helm(*args).stdout
    docs = render(files)
    for d in docs:
        if d["apiVersion"].startswith(("v1", "apps/", "networking.k8s.io/")):
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(d, version, strict=True)
    (node,) = by_kind(docs, "StatefulSet", "-node")
    (spec,) = [s for _, s in pod_specs(node)]
    (c,) = [c for c in containers(spec) if c["name"] == "node"]
    (argv,) = [a for _, a in argvs(c) if a[:2] == ["kvstore", "serve"]]
    assert "--tenants-file=/etc/kvstore/tenants.toml" in argv
    parse(argv, container_env(c), monkeypatch)
    assert any(m.get("subPath") == "tenants.toml" for m in c["volumeMounts"])


def test_token_secret_binds_each_tenant_and_the_tenants_file_says_its_shares(files: list[Path], tmp_path: Path) -> None:
    from kvstore.cli.values import tenants_toml
    from kvstore.security import read_token_entries
    from kvstore.tenancy import load_tenants_file

    docs = render(files)
    (secret,) = [s for s in by_kind(docs, "Secret") if s["metadata"]["name"].endswith("-tokens")]
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    rw = tmp_path / "rw.tokens"
    rw.write_text(data["rw.tokens"])
    rw.chmod(0o600)
    entries = read_token_entries(rw)  # the node's own parser
    assert [t for _, t in entries] == [None, "alice", "bob.team"]  # the chart's workers keep the default tenant
    assert entries[1][0] == data["tenant-alice.token"] and entries[2][0] == data["tenant-bob.team.token"]
    assert len({tok for tok, _ in entries}) == 3
    (cm,) = by_kind(docs, "ConfigMap", "-node")
    chart_file, local_file = tmp_path / "chart.toml", tmp_path / "local.toml"
    chart_file.write_text(cm["data"]["tenants.toml"])
    local_file.write_text(tenants_toml(values_of(files)) or "")  # what `kvstore up --values` writes
    chart, local = load_tenants_file(chart_file), load_tenants_file(local_file)
    assert chart == local
    assert chart["alice"].shares == {TierKind.DRAM: 2 << 30, TierKind.NVME: 50 << 30}
    assert chart["alice"].mtls_subjects == ("alice-engine.clients.example",) and chart["bob.team"].shares == {}


def test_rendered_tenant_index_users_read_only_their_tenant_on_a_real_redis(files: list[Path], tmp_path: Path) -> None:
    import subprocess
    import time

    import redis

    from kvstore.index.acl import tenant_client_rules
    from kvstore.index.keys import block_key
    from kvstore.launch import free_port
    from kvstore.tenants import scope

    docs = render(files)
    (cm,) = by_kind(docs, "ConfigMap", "-redis")
    (sts,) = by_kind(docs, "StatefulSet", "-redis")
    script = sts["spec"]["template"]["spec"]["initContainers"][0]["command"][2]
    assert "#TENANT0" in script and "#TENANT1" in script
    env = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in sts["spec"]["template"]["spec"]["initContainers"][0]["env"]}
    assert env["REDIS_TENANT0_PASSWORD"] == "tenant-alice-password"
    lines = {ln.split()[1]: ln for ln in cm["data"]["users.acl.in"].splitlines()}
    assert lines["kvclient-alice"].split(" ", 4)[4] == tenant_client_rules("alice")
    pw = {"ADMIN": "a" * 24, "NODE": "n" * 24, "CLIENT": "c" * 24, "TENANT0": "t0" * 12, "TENANT1": "t1" * 12}
    acl = cm["data"]["users.acl.in"]
    for name, value in pw.items():
        acl = acl.replace(f" #{name} ", f" #{hashlib.sha256(value.encode()).hexdigest()} ")
    (tmp_path / "auth.conf").write_text(acl)
    port = free_port()
    text = cm["data"]["redis.conf"].replace("include /run/redis/auth.conf", f"include {tmp_path / 'auth.conf'}")
    text = text.replace("dir /data", f"dir {tmp_path}").replace("bind 0.0.0.0", "bind 127.0.0.1")
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith(("tls-", "port "))) + f"\nport {port}\n"
    (tmp_path / "redis.conf").write_text(text)
    proc = subprocess.Popen(["redis-server", str(tmp_path / "redis.conf")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)  # fmt: skip
    clients: list[Any] = []
    try:
        admin = redis.Redis(port=port, password=pw["ADMIN"], socket_timeout=5)
        clients.append(admin)
        for _ in range(100):
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, "redis-server refused the rendered config"
                time.sleep(0.05)
        mine, theirs = block_key(scope("ns", "alice"), b"\1" * 32), block_key(scope("ns", "bob.team"), b"\1" * 32)
        admin.hset(mine, "n0", "1:2")
        admin.hset(theirs, "n0", "1:2")
        alice = redis.Redis(port=port, username="kvclient-alice", password=pw["TENANT0"], socket_timeout=5)
        clients.append(alice)
        assert alice.hgetall(mine) == {b"n0": b"1:2"}
        for spy in (lambda: alice.hgetall(theirs), lambda: alice.hset(mine, "n1", "x")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                spy()
    finally:
        for c in clients:
            c.close()
        proc.terminate()
        proc.wait(10)
