"""The Helm chart, offline: lint, render every example profile, validate every manifest against the
Kubernetes / KubeRay / Prometheus Operator / cert-manager schemas, parse every container command line
with our own CLI parsers, and refuse bad values at `helm template` with the value named."""

from __future__ import annotations

import base64
import copy
import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvstore.config import NodeConfig, parse_size
from kvstore.policy import POLICIES
from tests.deploy.cases import BAD_VALUES, names_value
from tests.deploy.commands import FOREIGN, argvs, container_env, parse, pod_specs
from tests.deploy.conftest import CHART, PROFILES, ROOT, TOOLS, helm, render, render_args
from tests.deploy.schemas import raycluster_errors

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and a current one.
K8S_VERSIONS = ("1.30.0", "1.35.0")
CRD_GROUPS = ("monitoring.coreos.com/v1", "cert-manager.io/v1")


def crd_errors(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate ServiceMonitor / Certificate manifests with their compiled CRD schemas (node)."""
    modules = TOOLS / "node" / "node_modules"
    node = shutil.which("node")
    if node is None or not (modules / "@kubernetes-models").is_dir():
        pytest.fail("node and .tools/node (the CRD schemas) are needed: run ./dev setup")
    r = subprocess.run([node, str(Path(__file__).with_name("crd_validate.mjs")), str(modules)],
                       input=json.dumps(docs), capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def by_kind(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return spec.get("initContainers", []) + spec.get("containers", [])


def values_of(files: list[Path]) -> dict[str, Any]:
    from kvstore.cli.values import load_values

    return load_values(files, CHART)


# ------------------------------------------------------------------------------------ lint and schemas


def test_lint_strict(profile: list[Path]) -> None:
    args = ["lint", "--strict", str(CHART)]
    for f in profile:
        args += ["-f", str(f)]
    out = helm(*args)
    assert "0 chart(s) failed" in out.stdout


def test_every_rendered_manifest_validates(profile: list[Path]) -> None:
    docs = render(profile)
    kinds = {d["kind"] for d in docs}
    assert {"ConfigMap", "Service", "StatefulSet", "RayCluster", "Secret", "NetworkPolicy", "ServiceMonitor"} <= kinds
    crds = []
    for d in docs:
        if d["kind"] == "RayCluster":
            assert raycluster_errors(d) == [], d["metadata"]["name"]
        elif d["apiVersion"] in CRD_GROUPS:
            crds.append(d)
        else:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(d, version, strict=True)
    results = crd_errors(crds)
    assert [r for r in results if r["error"]] == []
    assert {r["kind"] for r in results} >= {"monitoring.coreos.com/v1/ServiceMonitor"}


def test_the_validators_reject_a_broken_manifest() -> None:
    """The checks above are not vacuous: each validator refuses a manifest with one field wrong."""
    docs = render([ROOT / "deploy" / "values" / "production.yaml"])
    (sts,) = by_kind(docs, "StatefulSet", "-node")
    bad = copy.deepcopy(sts)
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 50051}}  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)
    (ray,) = by_kind(docs, "RayCluster")
    bad = copy.deepcopy(ray)
    bad["spec"]["workerGroupSpecs"][0]["replica"] = 2
    bad["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # must be a string
    errors = raycluster_errors(bad)
    assert any("replica" in e for e in errors) and any("num-cpus" in e for e in errors)
    (sm,) = by_kind(docs, "ServiceMonitor")
    (cert,) = by_kind(docs, "Certificate", "-node")
    sm, cert = copy.deepcopy(sm), copy.deepcopy(cert)
    sm["spec"]["endpoints"][0]["port"] = 9400  # a port *name* is a string
    cert["spec"]["privateKey"]["algorithm"] = "DSA"
    assert all(r["error"] for r in crd_errors([sm, cert]))


# ------------------------------------------------------------------------------------ command lines


def test_every_container_command_line_parses(profile: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(profile)
    ours: set[tuple[str, str]] = set()
    for doc in docs:
        for where, spec in pod_specs(doc):
            for c in containers(spec):
                for what, argv in argvs(c):
                    if argv[0] in ("kvstore", "kvctl"):
                        try:
                            parse(argv, container_env(c), monkeypatch)
                        except Exception as exc:
                            raise AssertionError(f"{where} {c['name']} {what}: {argv}: {exc}") from exc
                        ours.add((argv[0], argv[1]))
                    else:
                        assert argv[0] in FOREIGN, f"{where} {c['name']}: {argv[0]} is neither ours nor known"
    assert {("kvstore", "serve"), ("kvstore", "pd-serve"), ("kvctl", "top")} <= ours


def test_a_renamed_or_missing_flag_fails_the_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer._click.exceptions import UsageError

    with pytest.raises(UsageError, match="--dram-byte"):
        parse(["kvstore", "serve", "--dram-byte=1Gi"], {}, monkeypatch)
    with pytest.raises(UsageError, match="integer"):
        parse(["kvstore", "serve", "--port=fifty"], {}, monkeypatch)
    monkeypatch.delenv("KVSTORE_REDIS_URL", raising=False)
    with pytest.raises(UsageError, match=r"redis.url"):  # the chart must give the driver its index
        parse(["kvstore", "pd-serve", "--ray-address=h:6379", "--model=/m"], {}, monkeypatch)
    with pytest.raises(ValueError, match="not a size"):
        parse(["kvstore", "serve", "--dram-bytes=8 gigs"], {}, monkeypatch)


def test_node_toml_is_a_valid_node_config_and_grace_covers_handoff_drain_and_spill(
    profile: list[Path], tmp_path: Path
) -> None:
    docs = render(profile)
    v = values_of(profile)
    (cm,) = by_kind(docs, "ConfigMap", "-node")
    conf = tmp_path / "node.toml"
    conf.write_text(cm["data"]["node.toml"])
    cfg = NodeConfig.load(conf, env={})
    shutdown = v["node"]["shutdown"]
    assert (cfg.grace_seconds, cfg.spill_seconds) == (shutdown["drainSeconds"], shutdown["spillSeconds"])
    assert cfg.spill_on_shutdown and cfg.policy == v["node"]["policy"]
    (workload,) = [
        d for d in docs if d["kind"] in ("DaemonSet", "StatefulSet") and d["metadata"]["name"].endswith("-node")
    ]
    grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    handoff = math.ceil(cfg.handoff_seconds) if cfg.replication else 0
    assert grace == handoff + math.ceil(cfg.grace_seconds) + math.ceil(cfg.spill_seconds) + 15
    rep = v["node"]["replication"]  # replication as the values say (on by default, with its hand-off)
    assert (cfg.replication, cfg.replication_max_copies, cfg.handoff_seconds) == (
        rep["enabled"],
        rep["maxCopies"],
        shutdown["handoffSeconds"],
    )


def test_node_memory_holds_the_dram_budget(profile: list[Path]) -> None:
    docs = render(profile)
    v = values_of(profile)
    (workload,) = [
        d for d in docs if d["kind"] in ("DaemonSet", "StatefulSet") and d["metadata"]["name"].endswith("-node")
    ]
    node = workload["spec"]["template"]["spec"]["containers"][0]
    need = parse_size(v["node"]["budgets"]["dram"]) + parse_size(v["node"]["memoryOverhead"])
    assert parse_size(node["resources"]["limits"]["memory"]) >= need
    assert parse_size(node["resources"]["requests"]["memory"]) >= min(
        need, parse_size(node["resources"]["limits"]["memory"])
    )
    flags = dict(a.removeprefix("--").split("=", 1) for a in node["args"] if "=" in a)
    assert parse_size(flags["dram-bytes"]) == parse_size(v["node"]["budgets"]["dram"])
    gpus = int(v["node"]["gpu"]["count"])
    assert node["resources"]["limits"].get(v["node"]["gpu"]["resourceName"], 0) == gpus


def test_rendered_redis_conf_runs_on_a_real_redis_server(tmp_path: Path) -> None:
    """The chart's redis.conf (protected mode, no persistence, noeviction) with its ACL users, as the
    auth-config init container fills them in, on a real redis-server: nobody gets in without a
    password, clients only read, nodes publish to the index and nothing else, the admin does anything,
    a tenant's index user (auth.tenants) reads its own tenant's entries and nobody else's."""
    import hashlib

    import redis

    from kvstore.cli.waits import free_port
    from kvstore.index.keys import NODES_KEY, alive_key, entry_of, holder, node_key
    from kvstore.scoping import scope

    docs = render(sets=["auth.enabled=true", "auth.allowPlaintextTokens=true", "auth.tenants[0].name=alice"])
    (cm,) = by_kind(docs, "ConfigMap", "-redis")
    (sts,) = by_kind(docs, "StatefulSet", "-redis")
    script = sts["spec"]["template"]["spec"]["initContainers"][0]["command"][2]
    assert "sha256sum" in script and "/etc/redis/users.acl.in" in script  # what the emulation below does
    pw = {"ADMIN": "admin-password-0123456789", "NODE": "node-password-0123456789", "CLIENT": "client-password-012345",
          "TENANT0": "alice-password-012345"}  # fmt: skip
    acl = cm["data"]["users.acl.in"]
    for name, value in pw.items():
        acl = acl.replace(f" #{name} ", f" #{hashlib.sha256(value.encode()).hexdigest()} ")
    auth = tmp_path / "auth.conf"
    auth.write_text(acl)
    conf = tmp_path / "redis.conf"
    port = free_port()
    text = cm["data"]["redis.conf"].replace("include /run/redis/auth.conf", f"include {auth}")
    text = text.replace("dir /data", f"dir {tmp_path}").replace("bind 0.0.0.0", "bind 127.0.0.1")
    conf.write_text(re.sub(r"^port \d+$", f"port {port}", text, flags=re.M))
    proc = subprocess.Popen(["redis-server", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        admin = redis.Redis(port=port, password=pw["ADMIN"], socket_timeout=5)
        for _ in range(100):
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, "redis-server refused the rendered config"
                time.sleep(0.05)
        assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert admin.config_get("protected-mode") == {"protected-mode": "yes"}
        assert admin.config_get("save") == {"save": ""}
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=5).set("k", "v")
        node = redis.Redis(port=port, username="kvnode", password=pw["NODE"], socket_timeout=5)
        node.set(alive_key("n0"), "1")
        node.hset(node_key("n0"), "addr", "10.0.0.1:50051")
        node.sadd(NODES_KEY, "n0")
        client = redis.Redis(port=port, username="kvclient", password=pw["CLIENT"], socket_timeout=5)
        assert client.smembers(NODES_KEY) == {b"n0"} and client.get(alive_key("n0")) == b"1"
        for write in (lambda: client.set(alive_key("evil"), "1"), lambda: client.hset(node_key("n0"), "addr", "x"),
                      lambda: client.eval("return 1", 0), node.flushall, lambda: node.set("other", "1"),
                      lambda: node.config_set("protected-mode", "no")):  # fmt: skip
            with pytest.raises(redis.exceptions.NoPermissionError):
                write()
        alice = redis.Redis(port=port, username="kvclient-alice", password=pw["TENANT0"], socket_timeout=5)
        mine, default = entry_of(scope("ns", "alice"), b"\1" * 32), entry_of("ns", b"\1" * 32)
        node.hset(*mine, holder("n0", 1, 2))
        node.hset(*default, holder("n0", 1, 2))
        assert alice.hmget(*mine) == [b"n0=1:2"] and client.hmget(*default) == [b"n0=1:2"]
        for spy in (lambda: alice.hmget(*default), lambda: client.hmget(*mine), lambda: alice.hset(*mine, "x")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                spy()
        for c in (admin, node, client, alice):
            c.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_with_tls_redis_serves_tls_only_and_clients_check_it(tmp_path: Path) -> None:
    """production.yaml: Redis gets its own certificate (its pods' names too: Sentinel), closes its plaintext
    port, and every pod's KVSTORE_REDIS_URL is rediss+sentinel:// with the CA; the rendered TLS config runs
    on a real redis-server."""
    import redis

    from devkit.pki import make_dev_pki
    from kvstore.cli.waits import free_port

    docs = render([ROOT / "deploy" / "values" / "production.yaml"])
    (cert,) = by_kind(docs, "Certificate", "-redis")
    assert "kv-kvstore-redis" in cert["spec"]["dnsNames"] and cert["spec"]["usages"][0] == "server auth"
    assert "*.kv-kvstore-redis-headless.kvs.svc" in cert["spec"]["dnsNames"]  # each pod, by its own name
    urls = {e["value"] for d in docs for _, spec in pod_specs(d) for c in containers(spec)
            for e in c.get("env", []) if e["name"] == "KVSTORE_REDIS_URL"}  # fmt: skip
    assert urls and all(u.startswith("rediss+sentinel://") and u.endswith("&ssl_ca_certs=/etc/kvstore/tls/ca.crt")
                        for u in urls)  # fmt: skip
    (cm,) = by_kind(docs, "ConfigMap", "-redis")
    pki = make_dev_pki(tmp_path / "pki")
    tls_dir = tmp_path / "redis-tls"
    tls_dir.mkdir()
    for src, name in ((pki.node_cert, "tls.crt"), (pki.node_key, "tls.key"), (pki.ca, "ca.crt")):
        (tls_dir / name).write_bytes(src.read_bytes())
    port = free_port()
    text = cm["data"]["redis.conf"].replace("include /run/redis/auth.conf", "requirepass admin-password-0123456789")
    text = text.replace("/run/redis-tls", str(tls_dir)).replace("dir /data", f"dir {tmp_path}")
    text = re.sub(r"^tls-port \d+$", f"tls-port {port}", text.replace("bind 0.0.0.0", "bind 127.0.0.1"), flags=re.M)
    assert "port 0" in text.splitlines()
    conf = tmp_path / "redis.conf"
    conf.write_text(text)
    proc = subprocess.Popen(["redis-server", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        url = f"rediss://:admin-password-0123456789@localhost:{port}/0?ssl_ca_certs={pki.ca}"
        client = redis.Redis.from_url(url, socket_timeout=5)
        for _ in range(100):
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, "redis-server refused the rendered TLS config"
                time.sleep(0.05)
        assert client.ping()
        with pytest.raises(redis.ConnectionError):  # plaintext on the TLS port: no answer
            redis.Redis(port=port, password="admin-password-0123456789", socket_timeout=2).ping()
        other = f"rediss://:admin-password-0123456789@localhost:{port}/0?ssl_ca_certs={pki.other_ca}"
        with pytest.raises(redis.ConnectionError):  # a client trusting another CA refuses this server
            redis.Redis.from_url(other, socket_timeout=2).ping()
        client.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_rendered_sentinel_group_fails_over_on_real_redis_and_sentinels(tmp_path: Path) -> None:
    """redis.sentinel: the chart's three Redis pods and their sentinels, from the rendered ConfigMap as the
    auth-config init container fills it in (each pod on loopback, its own ports), run as real redis-server
    and `redis-server --sentinel` processes: a node's rendered KVSTORE_REDIS_URL reaches the master through
    the sentinels, the master is killed, the sentinels promote a replica and the same URL writes there;
    the sentinels' client user cannot reconfigure them."""
    import hashlib
    import signal

    import redis

    from kvstore.cli.waits import free_port
    from kvstore.index.acl import SENTINEL_CLIENT_RULES
    from kvstore.index.connect import sync_client
    from kvstore.index.keys import alive_key

    sets = ["auth.enabled=true", "auth.allowPlaintextTokens=true", "redis.sentinel.enabled=true",
            "redis.sentinel.downAfterMilliseconds=1000", "redis.sentinel.failoverTimeoutMilliseconds=2000"]  # fmt: skip
    docs = render(sets=sets)
    (cm,) = by_kind(docs, "ConfigMap", "-redis")
    (sts,) = by_kind(docs, "StatefulSet", "-redis")
    spec = sts["spec"]["template"]["spec"]
    assert sts["spec"]["replicas"] == 3 and [c["name"] for c in spec["containers"]] == ["redis", "sentinel"]
    assert sts["spec"]["serviceName"] == "kv-kvstore-redis-headless"
    script = spec["initContainers"][0]["command"][2]
    for step in (
        "replica-announce-ip $SELF",
        "masterauth $REDIS_PASSWORD",
        'echo "replicaof $MASTER 6379"',
        "s|@MASTER@|$MASTER|",
        "sentinel get-master-addr-by-name kvstore",
    ):  # what the emulation does
        assert step in script, step
    sentinel_in = cm["data"]["sentinel.conf.in"]
    assert f"user kvsentinel on #SENTINEL_CLIENT {SENTINEL_CLIENT_RULES}" in sentinel_in  # acl.py's rules
    pw = {"ADMIN": "admin-password-0123456789", "NODE": "node-password-0123456789",
          "CLIENT": "client-password-012345", "SENTINEL_ADMIN": "sentinel-admin-0123456789",
          "SENTINEL_CLIENT": "sentinel-client-0123456789"}  # fmt: skip

    def hashed(text: str) -> str:
        for name, value in pw.items():
            text = text.replace(f" #{name} ", f" #{hashlib.sha256(value.encode()).hexdigest()} ")
        return text

    rports, sports = [free_port() for _ in range(3)], [free_port() for _ in range(3)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(3):
            pod = tmp_path / f"pod-{i}"
            pod.mkdir()
            repl = ["replica-announce-ip 127.0.0.1", "masteruser default", f"masterauth {pw['ADMIN']}"]
            repl += [f"replicaof 127.0.0.1 {rports[0]}"] if i else []  # pod 0 starts as the master
            (pod / "auth.conf").write_text(hashed(cm["data"]["users.acl.in"]) + "\n".join(repl) + "\n")
            text = cm["data"]["redis.conf"].replace("include /run/redis/auth.conf", f"include {pod / 'auth.conf'}")
            text = text.replace("dir /data", f"dir {pod}").replace("bind 0.0.0.0", "bind 127.0.0.1")
            (pod / "redis.conf").write_text(re.sub(r"^port \d+$", f"port {rports[i]}", text, flags=re.M))
            conf = sentinel_in.replace("@SELF@", "127.0.0.1").replace("@MASTER@ 6379", f"127.0.0.1 {rports[0]}")
            conf = conf.replace("@ADMIN_PASSWORD@", pw["ADMIN"]).replace("@SENTINEL_PASSWORD@", pw["SENTINEL_ADMIN"])
            conf = hashed(conf).replace("dir /run/redis", f"dir {pod}")
            (pod / "sentinel.conf").write_text(re.sub(r"^port \d+$", f"port {sports[i]}", conf, flags=re.M))
            for argv in (
                ["redis-server", str(pod / "redis.conf")],
                ["redis-server", str(pod / "sentinel.conf"), "--sentinel"],
            ):
                procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        admin = [redis.Redis(port=p, username="default", password=pw["SENTINEL_ADMIN"], socket_timeout=2,
                             decode_responses=True) for p in sports]  # fmt: skip

        def group_known() -> bool:
            try:
                return all(int(a.sentinel_master("kvstore")["num-other-sentinels"]) == 2
                           and len([r for r in a.sentinel_slaves("kvstore") if r["master-link-status"] == "ok"]) == 2
                           for a in admin)  # fmt: skip
            except (redis.RedisError, OSError):
                return False

        def master_port() -> int:
            try:
                return int(admin[1].sentinel_get_master_addr_by_name("kvstore")[1])
            except (redis.RedisError, OSError, TypeError):
                return 0

        deadline = time.monotonic() + 60
        while not group_known():
            assert time.monotonic() < deadline, "the rendered sentinels never learned their group"
            assert all(p.poll() is None for p in procs), "a process refused its rendered config"
            time.sleep(0.2)
        (raw,) = {e["value"] for d in docs for _, ps in pod_specs(d) for c in containers(ps) for e in c.get("env", [])
                  if e["name"] == "KVSTORE_REDIS_URL" and "://kvnode:" in e.get("value", "")}  # fmt: skip
        url = raw.replace("$(REDIS_USER_PASSWORD)", pw["NODE"])
        url = url.replace("$(REDIS_SENTINEL_PASSWORD)", pw["SENTINEL_CLIENT"])
        url = url.replace("kv-kvstore-redis:26379", ",".join(f"127.0.0.1:{p}" for p in sports))
        node = sync_client(url, 2)  # the node's user, through the sentinels
        assert node.set(alive_key("n0"), "1")
        procs[0].send_signal(signal.SIGKILL)  # pod 0's Redis: the master
        deadline = time.monotonic() + 60
        while master_port() in (0, rports[0]):
            assert time.monotonic() < deadline, "no failover"
            time.sleep(0.2)
        deadline = time.monotonic() + 30
        while True:  # the same URL writes to the promoted replica (after a refused command or two)
            try:
                assert node.set(alive_key("n0"), "2")
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "the client never reached the new master"
                time.sleep(0.2)
        client = redis.Redis(port=sports[2], username="kvsentinel", password=pw["SENTINEL_CLIENT"], socket_timeout=2)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command("SENTINEL", "FAILOVER", "kvstore")
        for c in (*admin, client):
            c.close()
        node.close()
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_chart_acl_rules_are_the_ones_kvstore_up_applies() -> None:
    """One source of truth: the chart's users carry exactly kvstore.index.acl's rules (shared node user)."""
    from kvstore.index.acl import CLIENT_RULES, CLIENT_USER, SHARED_NODE_USER, node_rules

    (cm,) = by_kind(render(), "ConfigMap", "-redis")
    users = {line.split()[1]: line.split(" ", 4)[4] for line in cm["data"]["users.acl.in"].splitlines()}
    assert users == {"default": "~* &* +@all", SHARED_NODE_USER: node_rules("*"), CLIENT_USER: CLIENT_RULES}


# ------------------------------------------------------------------------------------ bad values


@pytest.mark.parametrize(("values", "name"), [c[1:] for c in BAD_VALUES], ids=[c[0] for c in BAD_VALUES])
def test_bad_values_fail_at_template_time_naming_the_value(values: dict, name: str, tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(values))
    r = helm(*render_args([f]), check=False)
    assert r.returncode != 0, f"helm template accepted {values}"
    assert names_value(r.stderr, name), r.stderr


# ------------------------------------------------------------------------------------ what the chart wires


def test_secrets_never_appear_in_clear_outside_their_secret() -> None:
    docs = render(sets=["auth.enabled=true", "auth.allowPlaintextTokens=true"])
    secrets = by_kind(docs, "Secret")
    assert {s["metadata"]["name"] for s in secrets} == {
        "kv-kvstore-redis-auth",
        "kv-kvstore-ray-auth",
        "kv-kvstore-tokens",
    }
    plain = [base64.b64decode(v).decode() for s in secrets for v in s["data"].values()]
    assert all(len(p) >= 16 for p in plain)
    others = yaml.safe_dump_all([d for d in docs if d["kind"] != "Secret"])
    assert not [p for p in plain if p.strip() in others]
    urls = {e["value"] for d in docs for _, spec in pod_specs(d) for c in containers(spec)
            for e in c.get("env", []) if e["name"] == "KVSTORE_REDIS_URL"}  # fmt: skip
    # Nodes publish as the node user; everyone else (workers, router, kvctl) reads as the client user.
    assert urls == {
        "redis://kvnode:$(REDIS_USER_PASSWORD)@kv-kvstore-redis:6379/0",
        "redis://kvclient:$(REDIS_USER_PASSWORD)@kv-kvstore-redis:6379/0",
    }
    node_urls = {e["value"] for d in docs if d["kind"] in ("DaemonSet", "StatefulSet") for _, spec in pod_specs(d)
                 for c in containers(spec) for e in c.get("env", []) if e["name"] == "KVSTORE_REDIS_URL"}  # fmt: skip
    assert node_urls == {"redis://kvnode:$(REDIS_USER_PASSWORD)@kv-kvstore-redis:6379/0"}
    # An operator's own Secret: nothing generated, every reference points at it.
    docs = render(sets=["redis.auth.existingSecret=my-redis", "rayCluster.auth.existingSecret=my-ray"])
    assert not by_kind(docs, "Secret")
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for d in docs for _, spec in pod_specs(d) for c in containers(spec)
            for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}  # fmt: skip
    assert refs == {"my-redis", "my-ray"}


def test_service_monitor_only_where_the_crd_is_served() -> None:
    assert not by_kind(render(api_versions=[]), "ServiceMonitor")
    docs = render()
    (sm,) = by_kind(docs, "ServiceMonitor")
    (svc,) = by_kind(docs, "Service", "-node")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}


def test_network_policies_admit_workers_and_labelled_clients_only() -> None:
    docs = render()
    (np_node,) = by_kind(docs, "NetworkPolicy", "-node")
    grpc_rule = next(r for r in np_node["spec"]["ingress"] if r["ports"][0]["port"] == 50051)
    peers = [p["podSelector"]["matchLabels"] for p in grpc_rule["from"]]
    node_pods = {
        "app.kubernetes.io/component": "node",
        "app.kubernetes.io/name": "kvstore",
        "app.kubernetes.io/instance": "kv",
    }
    assert peers == [{"ray.io/cluster": "kv-kvstore-ray"}, {"kvstore.io/client": "true"}, node_pods]
    assert all("namespaceSelector" not in p for p in grpc_rule["from"])  # this namespace only
    metrics_rule = next(r for r in np_node["spec"]["ingress"] if r["ports"][0]["port"] == 9400)
    assert "from" not in metrics_rule  # metricsFrom empty: anyone may scrape
    (prod_np,) = by_kind(render([ROOT / "deploy" / "values" / "production.yaml"]), "NetworkPolicy", "-node")
    metrics_rule = next(r for r in prod_np["spec"]["ingress"] if r["ports"][0]["port"] == 9400)
    assert metrics_rule["from"][0] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }
    (test_pod,) = by_kind(docs, "Pod")
    assert test_pod["metadata"]["labels"]["kvstore.io/client"] == "true"
    (np_redis,) = by_kind(docs, "NetworkPolicy", "-redis")
    redis_peers = [p["podSelector"]["matchLabels"] for p in np_redis["spec"]["ingress"][0]["from"]]
    assert {"app.kubernetes.io/component": "node", "app.kubernetes.io/name": "kvstore",
            "app.kubernetes.io/instance": "kv"} in redis_peers  # fmt: skip


def test_workers_know_their_local_cache_node_and_offer_one_slot_per_gpu() -> None:
    from workers.deploy import Role, count, plan_slots

    docs = render([ROOT / "deploy" / "values" / "production.yaml"])
    v = values_of([ROOT / "deploy" / "values" / "production.yaml"])
    (node_sts,) = by_kind(docs, "StatefulSet", "-node")
    node = node_sts["spec"]["template"]["spec"]["containers"][0]
    assert "--node-id=$(NODE_NAME)" in node["args"]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in node["env"]
    (ray,) = by_kind(docs, "RayCluster")
    fake_nodes = []
    for g in ray["spec"]["workerGroupSpecs"]:
        (worker,) = g["template"]["spec"]["containers"]
        assert {"name": "KVSTORE_LOCAL_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in worker[
            "env"
        ]
        resources = json.loads(json.loads(g["rayStartParams"]["resources"]))  # KubeRay's quoted JSON
        gpus = float(g["rayStartParams"]["num-gpus"])
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == gpus
        fake_nodes += [{"NodeID": f"{g['groupName']}-{i}", "Alive": True, "Resources": {**resources, "GPU": gpus}}
                       for i in range(g["replicas"])]  # fmt: skip
    slots = plan_slots(fake_nodes)
    w = v["workers"]
    assert count(slots, Role.PREFILL) == w["prefill"]["replicas"] * w["prefill"]["gpusPerPod"]
    assert count(slots, Role.DECODE) == w["decode"]["replicas"] * w["decode"]["gpusPerPod"]
    assert all(s.gpus == 1.0 for s in slots)


@pytest.mark.parametrize("encoding", ["raw", "fp8"])
def test_kv_encoding_reaches_the_workers(encoding: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """workers.kvEncoding becomes pd-serve's --kv-encoding (parsed by our own CLI); raw by default."""
    files = [ROOT / "deploy" / "values" / "production.yaml"]
    if encoding != "raw":
        f = tmp_path / "enc.yaml"
        f.write_text(yaml.safe_dump({"workers": {"kvEncoding": encoding}}))
        files.append(f)
    (ray,) = by_kind(render(files), "RayCluster")
    (router,) = (c for c in ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"] if c["name"] == "router")
    ((_, argv),) = argvs(router)
    params = parse(argv, container_env(router), monkeypatch)
    assert params["kv_encoding"].value == encoding


def test_tls_profile_probes_through_kvctl_health_and_mounts_the_certificate() -> None:
    docs = render([ROOT / "deploy" / "values" / "production.yaml"])
    (sts,) = by_kind(docs, "StatefulSet", "-node")
    spec = sts["spec"]["template"]["spec"]
    node = spec["containers"][0]
    assert node["readinessProbe"]["exec"]["command"][:2] == ["kvctl", "health"]
    env = container_env(node)
    assert env["KVSTORE_TLS_SERVER_NAME"] == "kv-kvstore-node.kvs.svc" and env["KVSTORE_TLS_CERT"]
    assert {"--tls-cert=/etc/kvstore/tls/tls.crt", "--tls-client-ca=/etc/kvstore/tls/ca.crt"} <= set(node["args"])
    (cert,), (client_cert,) = by_kind(docs, "Certificate", "-node"), by_kind(docs, "Certificate", "-client")
    tls_volume = next(v for v in spec["volumes"] if v["name"] == "tls")
    assert tls_volume["secret"]["secretName"] == cert["spec"]["secretName"]
    assert "kv-kvstore-node.kvs.svc" in cert["spec"]["dnsNames"]
    # Workers present a client-only certificate: they never hold the nodes' key, so cannot pose as a node.
    assert (
        client_cert["spec"]["usages"] == ["client auth", "digital signature"] and "dnsNames" not in client_cert["spec"]
    )
    (ray,) = by_kind(docs, "RayCluster")
    worker_tls = next(v for v in ray["spec"]["workerGroupSpecs"][0]["template"]["spec"]["volumes"]
                      if v["name"] == "kvstore-tls")  # fmt: skip
    secrets = {src["secret"]["name"] for src in worker_tls["projected"]["sources"]}
    assert secrets == {cert["spec"]["secretName"], client_cert["spec"]["secretName"]}
    # Without TLS the kubelet's own gRPC probe is used.
    (ds,) = by_kind(render(), "DaemonSet", "-node")
    assert ds["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"] == {"port": 50051}


def test_values_schema_knows_every_policy_and_every_profile_passes_the_loader() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert sorted(schema["properties"]["node"]["properties"]["policy"]["enum"]) == sorted(POLICIES)
    for p in PROFILES:
        values_of([p])
    assert (ROOT / "deploy" / "grafana" / "kvstore.json").read_text() == (
        CHART / "dashboards" / "kvstore.json"
    ).read_text()


def test_notes_tell_the_operator_kvctl_commands_that_parse(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import shlex

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-cluster"))  # a client-side dry run needs none
    for profile in ([], [ROOT / "deploy" / "values" / "production.yaml"]):
        args = ["install", "kv", str(CHART), "--namespace", "kvs", "--dry-run=client", "--hide-secret"]
        for f in profile:
            args += ["-f", str(f)]
        notes = helm(*args).stdout.split("NOTES:", 1)[1]
        lines = [ln.strip() for ln in notes.splitlines() if " -- " in ln and "kvctl" in ln]
        assert {"nodes", "stats", "top"} <= {ln.split("kvctl ", 1)[1].split()[0] for ln in lines}
        assert "helm -n kvs test kv" in notes
        for line in lines:
            argv = shlex.split(line.split(" -- ", 1)[1])
            if argv[:2] == ["sh", "-c"]:
                argv = shlex.split(argv[2].replace('"$KVSTORE_REDIS_URL"', "redis://r:6379/0"))
            parse(argv, {}, monkeypatch)


def test_nodes_get_their_peer_token_for_copies_while_replication_is_on() -> None:
    """With tokens on, nodes call each other with a token of their own (peer.tokens, Role.PEER): generated in the
    token Secret, mounted beside the others, named by --auth-peer-tokens-file; not with replication off."""

    def node_container(docs: list[dict[str, object]]) -> tuple[dict, dict]:  # type: ignore[type-arg]
        (workload,) = [d for d in docs if d["kind"] in ("DaemonSet", "StatefulSet") and
                       str(d["metadata"]["name"]).endswith("-node")]  # type: ignore[index]  # fmt: skip
        ((_, spec),) = list(pod_specs(workload))
        return next(c for c in containers(spec) if "--config=/etc/kvstore/node.toml" in c.get("args", [])), spec

    docs = render(sets=["auth.enabled=true", "auth.allowPlaintextTokens=true"])
    (secret,) = [s for s in by_kind(docs, "Secret") if s["metadata"]["name"].endswith("-tokens")]
    assert len(base64.b64decode(secret["data"]["peer.tokens"])) >= 16
    node, spec = node_container(docs)
    assert "--auth-peer-tokens-file=/etc/kvstore/auth/peer.tokens" in node["args"]
    (auth,) = [v for v in spec["volumes"] if v["name"] == "auth"]
    assert {"key": "peer.tokens", "path": "peer.tokens"} in auth["secret"]["items"]
    node, spec = node_container(render(sets=["auth.enabled=true", "auth.allowPlaintextTokens=true",
                                             "node.replication.enabled=false"]))  # fmt: skip
    assert not any("peer" in a for a in node["args"])
