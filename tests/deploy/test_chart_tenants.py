"""The chart's tenancy (auth.tenants, SECURITY.md): token Secrets that carry tenants, the tenants file,
per-tenant Redis index users; rendered over the production profile, validated like every profile, and the
index users tried on a real redis-server."""

from __future__ import annotations

import base64
from pathlib import Path

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
    from kvstore.node.tenancy import load_tenants_file
    from kvstore.security import read_token_entries

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


def test_each_tenant_gets_an_index_user_with_acl_py_rules(files: list[Path]) -> None:
    """The users the chart's Redis gets per tenant, and how its auth-config fills in their passwords
    (tried on a real redis-server in test_chart.py)."""
    from kvstore.index.acl import tenant_client_rules

    docs = render(files)
    (cm,) = by_kind(docs, "ConfigMap", "-redis")
    (sts,) = by_kind(docs, "StatefulSet", "-redis")
    init = sts["spec"]["template"]["spec"]["initContainers"][0]
    assert '"s/ #TENANT0 / #$(h "$REDIS_TENANT0_PASSWORD") /"' in init["command"][2]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in init["env"]}
    assert (env["REDIS_TENANT0_PASSWORD"], env["REDIS_TENANT1_PASSWORD"]) == (
        "tenant-alice-password",
        "tenant-bob.team-password",
    )
    users = {ln.split()[1]: ln.split(" ", 4)[4] for ln in cm["data"]["users.acl.in"].splitlines()}
    assert users["kvclient-alice"] == tenant_client_rules("alice")
    assert users["kvclient-bob.team"] == tenant_client_rules("bob.team")
