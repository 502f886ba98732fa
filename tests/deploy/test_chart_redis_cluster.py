"""The chart's Redis Cluster (redis.cluster), offline and on real processes:

- production.yaml with redis.cluster on (sentinel off) renders manifests that validate; every pod's
  KVSTORE_REDIS_URL is a rediss+cluster:// one with the CA; the certificate names each Redis pod; the
  cluster bus is open between the Redis pods only; a `cluster` container runs beside each Redis.
- The rendered ConfigMap (redis.conf, the ACL users, cluster.sh) and what the auth-config init container
  adds, run as six real redis-server processes and six copies of the rendered cluster.sh on loopback
  (each "pod" on its own ports): the script forms the cluster (3 masters, a replica each); a node
  publishes through its rendered URL and a client finds the pages; a master is killed and the cluster
  fails it over; the killed pod comes back without its state (a new pod) and the script brings it in
  again as a replica, its previous life forgotten.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import redis

from kvstore.cli.waits import free_port
from kvstore.index import IndexReader
from kvstore.index.publisher import IndexPublisher
from kvstore.names import TierKind
from tests.deploy.commands import pod_specs
from tests.deploy.conftest import ROOT, render

CLUSTER_SETS = ["redis.cluster.enabled=true", "redis.sentinel.enabled=false"]
PW = {"ADMIN": "admin-password-0123456789", "NODE": "node-password-0123456789", "CLIENT": "client-password-012345"}


def by_kind(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_production_with_a_redis_cluster_renders_and_validates() -> None:
    docs = render([ROOT / "deploy" / "values" / "production.yaml"], sets=CLUSTER_SETS)
    for d in docs:
        if d["kind"] in ("StatefulSet", "Service", "ConfigMap", "NetworkPolicy", "PodDisruptionBudget", "Deployment"):
            kubernetes_validate.validate(d, "1.30.0", strict=True)
    (sts,) = by_kind(docs, "StatefulSet", "-redis")
    spec = sts["spec"]["template"]["spec"]
    assert sts["spec"]["replicas"] == 6 and sts["spec"]["serviceName"] == "kv-kvstore-redis-headless"
    assert [c["name"] for c in spec["containers"]] == ["redis", "cluster"]
    cluster_env = env_of(spec["containers"][1])
    assert cluster_env["SELF"] == "$(POD_NAME).kv-kvstore-redis-headless.kvs.svc:6379@16379"
    assert cluster_env["PEERS"].split() == [f"kv-kvstore-redis-{i}.kv-kvstore-redis-headless.kvs.svc:6379@16379"
                                            for i in range(6)]  # fmt: skip
    assert cluster_env["CLI_TLS"] == "--tls --cacert /run/redis-tls/ca.crt" and cluster_env["REPLICAS"] == "1"
    urls = {e["value"] for d in docs for _, ps in pod_specs(d) for c in ps.get("initContainers", []) + ps["containers"]
            for e in c.get("env", []) if e["name"] == "KVSTORE_REDIS_URL"}  # fmt: skip
    assert urls == {
        f"rediss+cluster://{user}:$(REDIS_USER_PASSWORD)@kv-kvstore-redis:6379/?ssl_ca_certs=/etc/kvstore/tls/ca.crt"
        for user in ("kvnode", "kvclient")
    }
    (cert,) = by_kind(docs, "Certificate", "-redis")
    assert "*.kv-kvstore-redis-headless.kvs.svc" in cert["spec"]["dnsNames"]
    (cm,) = by_kind(docs, "ConfigMap", "-redis")
    conf = cm["data"]["redis.conf"]
    for line in ("cluster-enabled yes", "tls-cluster yes", "tls-replication yes", "cluster-port 16379",
                 "cluster-require-full-coverage no", "cluster-preferred-endpoint-type hostname"):  # fmt: skip
        assert line in conf.splitlines() or f"    {line}" in conf, line
    (policy,) = by_kind(docs, "NetworkPolicy", "-redis")
    bus = [r for r in policy["spec"]["ingress"] if {"port": 16379, "protocol": "TCP"} in r["ports"]]
    assert len(bus) == 1 and [
        f["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for f in bus[0]["from"]
    ] == ["redis"]
    assert by_kind(docs, "PodDisruptionBudget", "-redis")


def hashed(text: str) -> str:
    for name, value in PW.items():
        text = text.replace(f" #{name} ", f" #{hashlib.sha256(value.encode()).hexdigest()} ")
    return text


class Pods:
    """The rendered Redis pods on loopback: pod i's redis-server (its own port and bus port) and its
    copy of the rendered cluster.sh, both stopped by close(), each by PID."""

    def __init__(self, tmp: Path, cm: dict[str, Any], init_script: str, n: int) -> None:
        self.tmp, self.cm, self.n = tmp, cm, n
        self.ports, self.buses = [free_port() for _ in range(n)], [free_port() for _ in range(n)]
        self.redis: list[subprocess.Popen[bytes] | None] = [None] * n
        self.loops: list[subprocess.Popen[bytes]] = []
        # What the auth-config init container appends for a cluster pod (asserted against its script).
        self.per_pod = ["cluster-announce-hostname 127.0.0.1", "masteruser default", f"masterauth {PW['ADMIN']}"]
        for step in ('echo "cluster-announce-hostname $(hostname).', 'echo "masteruser default"',
                     'echo "masterauth $REDIS_PASSWORD"'):  # fmt: skip
            assert step in init_script, step

    def addr(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}@{self.buses[i]}"

    def start_redis(self, i: int, fresh: bool = False) -> None:
        pod = self.tmp / f"pod-{i}"
        if fresh and pod.exists():
            shutil.rmtree(pod)  # a new pod: its emptyDir (and the cluster state in it) is gone
        (pod / "data").mkdir(parents=True, exist_ok=True)
        (pod / "auth.conf").write_text(hashed(self.cm["data"]["users.acl.in"]) + "\n".join(self.per_pod) + "\n")
        text = self.cm["data"]["redis.conf"].replace("include /run/redis/auth.conf", f"include {pod / 'auth.conf'}")
        text = text.replace("dir /data", f"dir {pod / 'data'}").replace(
            "/data/nodes.conf", str(pod / "data/nodes.conf")
        )
        text = re.sub(r"^(\s*)port \d+$", rf"\g<1>port {self.ports[i]}", text.replace("bind 0.0.0.0", "bind 127.0.0.1"),
                      flags=re.M)  # fmt: skip
        text = re.sub(r"^(\s*)cluster-port \d+$", rf"\g<1>cluster-port {self.buses[i]}", text, flags=re.M)
        (pod / "redis.conf").write_text(text)
        self.redis[i] = subprocess.Popen(["redis-server", str(pod / "redis.conf")], stdout=subprocess.DEVNULL,
                                         stderr=subprocess.STDOUT)  # fmt: skip

    def start(self, replicas: int) -> None:
        script = self.tmp / "cluster.sh"
        script.write_text(self.cm["data"]["cluster.sh"])
        for i in range(self.n):
            self.start_redis(i)
        env = {**os.environ, "PEERS": " ".join(self.addr(i) for i in range(self.n)), "REPLICAS": str(replicas),
               "CLI_TLS": "", "REDISCLI_AUTH": PW["ADMIN"], "INTERVAL": "1"}  # fmt: skip
        for i in range(self.n):
            log = open(self.tmp / f"cluster-{i}.log", "wb")  # noqa: SIM115 - the child's now
            self.loops.append(subprocess.Popen(["sh", str(script)], env={**env, "SELF": self.addr(i)}, stdout=log,
                                               stderr=subprocess.STDOUT))  # fmt: skip
            log.close()

    def admin(self, i: int) -> redis.Redis:
        return redis.Redis(port=self.ports[i], password=PW["ADMIN"], socket_timeout=2, decode_responses=True)

    def nodes(self, i: int) -> list[list[str]]:
        try:
            with self.admin(i) as a:
                return [line.split() for line in a.execute_command("CLUSTER", "NODES").splitlines() if line.strip()]
        except (redis.RedisError, OSError):
            return []

    def kill(self, i: int) -> None:
        p = self.redis[i]
        assert p is not None
        p.send_signal(signal.SIGKILL)
        p.wait(10)

    def close(self) -> None:
        for p in [*self.loops, *(r for r in self.redis if r is not None)]:
            if p.poll() is None:
                p.kill()
            p.wait(10)

    def logs(self) -> str:
        return "\n".join(f"-- cluster.sh of pod {i}:\n{(self.tmp / f'cluster-{i}.log').read_text()[-1500:]}"
                         for i in range(self.n))  # fmt: skip


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def rendered() -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    sets = ["auth.enabled=true", "auth.allowPlaintextTokens=true", *CLUSTER_SETS,
            "redis.cluster.nodeTimeoutMilliseconds=1000"]  # fmt: skip
    docs = render(sets=sets)
    (cm,) = by_kind(docs, "ConfigMap", "-redis")
    (sts,) = by_kind(docs, "StatefulSet", "-redis")
    return cm, sts, docs


@pytest.fixture
def pods(tmp_path: Path, rendered: tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]) -> Iterator[Pods]:
    cm, sts, _ = rendered
    spec = sts["spec"]["template"]["spec"]
    assert spec["containers"][1]["command"] == ["sh", "/etc/redis/cluster.sh"]  # what the emulation runs
    p = Pods(tmp_path, cm, spec["initContainers"][0]["command"][2], sts["spec"]["replicas"])
    try:
        yield p
    finally:
        p.close()


def url_of(docs: list[dict[str, Any]], user: str, password: str, pods: Pods) -> str:
    (raw,) = {e["value"] for d in docs for _, ps in pod_specs(d) for c in ps["containers"] for e in c.get("env", [])
              if e["name"] == "KVSTORE_REDIS_URL" and f"://{user}:" in e.get("value", "")}  # fmt: skip
    servers = ",".join(f"127.0.0.1:{p}" for p in pods.ports)
    return raw.replace("$(REDIS_USER_PASSWORD)", password).replace("kv-kvstore-redis:6379", servers)


def test_rendered_cluster_forms_fails_over_and_takes_a_new_pod_back(
    pods: Pods, rendered: tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]
) -> None:
    _, _, docs = rendered
    pods.start(replicas=1)

    def whole() -> bool:
        nodes = pods.nodes(0)
        masters = [n for n in nodes if "master" in n[2] and len(n) >= 9 and "fail" not in n[2]]
        replicas = [n for n in nodes if "slave" in n[2] and "fail" not in n[2]]
        return len(nodes) == 6 and len(masters) == 3 and len(replicas) == 3

    wait_for(whole, 90, f"the rendered cluster.sh to form the cluster:\n{pods.logs()}")
    node_url, client_url = url_of(docs, "kvnode", PW["NODE"], pods), url_of(docs, "kvclient", PW["CLIENT"], pods)
    assert node_url.startswith("redis+cluster://kvnode:")
    chain = [hashlib.sha256(f"chart-{i}".encode()).digest() for i in range(32)]

    async def scenario() -> None:
        pub = IndexPublisher(node_url, "n0", "10.0.0.1:50051", lambda: [("ns", h, TierKind.DRAM) for h in chain],
                             lambda: {}, ttl_seconds=3.0)  # fmt: skip
        await pub.start()
        try:
            assert await pub.wait_registered(30), pub.status()
            with IndexReader(client_url, socket_timeout=2) as index:
                assert (await asyncio.to_thread(index.lookup, "ns", chain)).matched == 32
                masters = [i for i in range(6) if any("myself" in n[2] and "master" in n[2] for n in pods.nodes(i))]
                victim = masters[0]
                pods.kill(victim)  # a master pod's Redis dies: the cluster promotes its replica
                await asyncio.to_thread(wait_for, lambda: len(pods.nodes((victim + 1) % 6)) == 6 and all(
                    "fail" in n[2] for n in pods.nodes((victim + 1) % 6) if n[1].startswith(f"127.0.0.1:{pods.ports[victim]}@")
                ), 30, "the failure seen")  # fmt: skip

                async def found() -> bool:
                    return (await asyncio.to_thread(index.lookup, "ns", chain)).matched == 32

                deadline = time.monotonic() + 60
                while not await found():  # the node republishes to the promoted replica; lookups miss meanwhile
                    assert time.monotonic() < deadline, "lookups never found the pages again after the failover"
                    await asyncio.sleep(0.2)
                # The pod comes back without its state (a new pod): cluster.sh brings it in as a replica.
                pods.start_redis(victim, fresh=True)
                await asyncio.to_thread(wait_for, whole, 90,
                                        f"the new pod in the cluster, its previous life forgotten:\n{pods.logs()}")  # fmt: skip
                assert any("myself" in n[2] and "slave" in n[2] for n in pods.nodes(victim))
                assert await found()
        finally:
            await pub.close()

    asyncio.run(scenario())
