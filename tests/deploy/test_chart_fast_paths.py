"""The fast paths in the chart (DESIGN.md §8.1, §11): the UCX plane with RDMA devices, and the same-host socket
that node and client pods share. Rendered by the real helm, validated against Kubernetes' schemas, and
the pieces that run in a pod (the socket directory's permissions, the memlock check) run here for real."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from kvstore.config import NodeConfig
from tests.deploy.commands import container_env, pod_specs
from tests.deploy.conftest import ROOT, render
from tests.deploy.schemas import raycluster_errors

PRODUCTION = ROOT / "deploy" / "values" / "production.yaml"
UCX_ON = ["node.dataPlanes.ucx.enabled=true"]
RDMA_ON = [*UCX_ON, "node.dataPlanes.ucx.rdma.enabled=true", "node.dataPlanes.ucx.rdma.resources.rdma/ib=1"]
ENGINES_ON = ["engines.enabled=true"]


def pods(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Every pod template by where it is ("DaemonSet/kv-kvstore-node", "RayCluster/kv-kvstore-ray/decode", ...):
    (pod metadata, pod spec)."""
    out = {}
    for d in docs:
        meta = {}
        if d["kind"] in ("DaemonSet", "StatefulSet", "Deployment"):
            meta = d["spec"]["template"].get("metadata", {})
        for where, spec in pod_specs(d):
            if d["kind"] == "RayCluster" and not where.endswith("/head"):
                group = next(g for g in d["spec"]["workerGroupSpecs"] if where.endswith("/" + g["groupName"]))
                meta = group["template"].get("metadata", {})
            out[where] = (meta, spec)
    return out


def node_pod(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    (key,) = [k for k in pods(docs) if k.split("/")[0] in ("DaemonSet", "StatefulSet") and k.endswith("-node")]
    return pods(docs)[key]


def client_containers(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """The containers that call cache nodes with pages: Ray workers and the engines' LMCache sidecar,
    by where: (pod metadata, pod spec, container)."""
    out = {}
    for where, (meta, spec) in pods(docs).items():
        if where.startswith("RayCluster/") and not where.endswith("/head"):
            out[where] = (meta, spec, spec["containers"][0])
        elif where.startswith("Deployment/") and where.endswith("-engine"):
            out[where] = (meta, spec, next(c for c in spec["initContainers"] if c["name"] == "lmcache"))
    return out


def volume(spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(v for v in spec["volumes"] if v["name"] == name)


def mount(container: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((m for m in container.get("volumeMounts", []) if m["name"] == name), None)


def validate_all(docs: list[dict[str, Any]]) -> None:
    for d in docs:
        if d["kind"] == "RayCluster":
            assert raycluster_errors(d) == [], d["metadata"]["name"]
        elif d["apiVersion"].startswith(("v1", "apps/", "policy/", "networking.k8s.io/")):
            for version in ("1.30.0", "1.35.0"):
                kubernetes_validate.validate(d, version, strict=True)


# ------------------------------------------------------------------------------ the production profile


def test_production_profile_shows_ucx_with_rdma_the_socket_in_node_and_workers_and_the_engines(
    tmp_path: Path,
) -> None:
    """The fast paths of the production profile, read from `helm template` of deploy/values/production.yaml."""
    docs = render([PRODUCTION])
    _, spec = node_pod(docs)
    node = spec["containers"][0]
    # UCX on, on a fixed port, over the RDMA device plugin's resource, with memory pinning allowed.
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-node")]
    (conf := tmp_path / "node.toml").write_text(cm["data"]["node.toml"])
    cfg = NodeConfig.load(conf, env={})
    assert cfg.ucx_enabled and cfg.ucx_port == 50053
    assert {"name": "ucx-plane", "containerPort": 50053} in node["ports"]
    for kind in ("requests", "limits"):
        assert node["resources"][kind]["rdma/rdma_shared_device_a"] == "1"
    assert node["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert [c["name"] for c in spec["initContainers"]] == ["local-socket-permissions", "memlock-check"]
    env = container_env(node)
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1" and env["RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"] == "true"
    assert env["UCX_TCP_PORT_RANGE"] == "50100-50163"
    assert "--advertise-addr=$(POD_IP):50051" in node["args"]  # the planes advertise the same host
    # The node serves the socket on the release's host directory and names its host.
    assert "--local-socket=/var/run/kvstore/node.sock" in node["args"]
    assert {"name": "KVSTORE_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in node["env"]
    host_dir = volume(spec, "kvstore-local-socket")["hostPath"]
    assert host_dir == {"path": "/var/run/kvstore/kv-kvstore", "type": "DirectoryOrCreate"}
    assert mount(node, "kvstore-local-socket") == {"name": "kvstore-local-socket", "mountPath": "/var/run/kvstore"}
    # Every worker group and the engines: the same host directory at the same path, their host, the
    # socket's path, the socket's group, the same RDMA device and UCX environment.
    clients = client_containers(docs)
    assert {w.rsplit("/", 1)[1] for w in clients} == {"prefill", "decode", "kv-kvstore-engine"}
    for where, (_, cspec, c) in clients.items():
        assert volume(cspec, "kvstore-local-socket")["hostPath"] == host_dir, where
        assert mount(c, "kvstore-local-socket") == {
            "name": "kvstore-local-socket", "mountPath": "/var/run/kvstore", "readOnly": True
        }, where  # fmt: skip
        cenv = container_env(c)
        assert cenv["KVSTORE_LOCAL_SOCKET"] == "/var/run/kvstore/node.sock", where
        assert {"name": "KVSTORE_LOCAL_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in c["env"]
        assert 10001 in cspec["securityContext"]["supplementalGroups"], where
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1", where
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"], where
        assert cenv["UCX_NET_DEVICES"] == "mlx5_0:1" and cenv["KVSTORE_UCX_ALLOW_PLAINTEXT"] == "1", where
        assert "UCX_TCP_PORT_RANGE" not in cenv, where  # the node's lanes only
        assert any(i["name"] == "memlock-check" for i in cspec["initContainers"]), where
    # The engine roles are there (their wiring: tests/deploy/test_chart_engines.py).
    assert [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kv-kvstore-engine"]
    # The NetworkPolicy opens the UCX listener and UCX's TCP lanes to the same peers as gRPC.
    (np,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-node")]
    cache_rule = np["spec"]["ingress"][0]
    assert {"port": 50053, "protocol": "TCP"} in cache_rule["ports"]
    assert {"port": 50100, "endPort": 50163, "protocol": "TCP"} in cache_rule["ports"]
    engine_pods = {"app.kubernetes.io/component": "engine", "app.kubernetes.io/name": "kvstore",
                   "app.kubernetes.io/instance": "kv"}  # fmt: skip
    assert {"podSelector": {"matchLabels": engine_pods}} in cache_rule["from"]


# ------------------------------------------------------------------------------------------- UCX


def test_ucx_is_off_by_default_and_its_port_is_configured_exposed_and_allowed(tmp_path: Path) -> None:
    docs = render()
    _, spec = node_pod(docs)
    node = spec["containers"][0]
    assert not any(p["name"] == "ucx-plane" for p in node["ports"])
    assert not any(e["name"].startswith("UCX_") for e in node["env"])
    docs = render(sets=[*UCX_ON, "node.dataPlanes.ucx.port=7000", "node.dataPlanes.ucx.tcpPortRange="])
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-node")]
    (conf := tmp_path / "node.toml").write_text(cm["data"]["node.toml"])
    assert NodeConfig.load(conf, env={}).ucx_port == 7000
    _, spec = node_pod(docs)
    assert {"name": "ucx-plane", "containerPort": 7000} in spec["containers"][0]["ports"]
    assert "UCX_TCP_PORT_RANGE" not in container_env(spec["containers"][0])  # "": UCX picks, nothing to open
    (np,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-node")]
    ports = np["spec"]["ingress"][0]["ports"]
    assert {"port": 7000, "protocol": "TCP"} in ports and not any("endPort" in p for p in ports)
    # UCX without RDMA (TCP fallback): no devices, no capabilities, no privileges asked for.
    _, spec = node_pod(docs)
    assert spec["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert [c["name"] for c in spec["initContainers"]] == ["local-socket-permissions", "nvme-permissions"]


def test_roce_variants_host_network_or_a_secondary_network() -> None:
    # RoCE through the host's interface: the node on the host network, Service names still resolve.
    docs = render(sets=[*RDMA_ON, "node.dataPlanes.ucx.network.hostNetwork=true"])
    validate_all(docs)
    _, spec = node_pod(docs)
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert "--advertise-addr=$(POD_IP):50051" in spec["containers"][0]["args"]  # POD_IP = the host's address
    # RoCE through SR-IOV VFs: the Multus attachment on the node and on every client pod.
    sets = [*RDMA_ON, *ENGINES_ON, "node.dataPlanes.ucx.network.attachments=sriov/rdma-vf@net1"]
    docs = render(sets=sets)
    validate_all(docs)
    meta, spec = node_pod(docs)
    assert meta["annotations"]["k8s.v1.cni.cncf.io/networks"] == "sriov/rdma-vf@net1"
    assert "hostNetwork" not in spec
    for where, (cmeta, _, _) in client_containers(docs).items():
        assert cmeta["annotations"]["k8s.v1.cni.cncf.io/networks"] == "sriov/rdma-vf@net1", where
    # rdma.clients false: only the node gets devices and the network; clients stay as they were.
    docs = render(sets=[*sets, "node.dataPlanes.ucx.rdma.clients=false"])
    for where, (cmeta, cspec, c) in client_containers(docs).items():
        assert "k8s.v1.cni.cncf.io/networks" not in cmeta.get("annotations", {}), where
        assert "rdma/ib" not in c["resources"].get("limits", {}), where
        assert not any(i["name"] == "memlock-check" for i in cspec.get("initContainers", [])), where


def test_client_resources_differ_and_host_devices_need_a_privileged_container() -> None:
    docs = render(sets=[*RDMA_ON, "node.dataPlanes.ucx.rdma.clientResources.nvidia\\.com/sriov_rdma_vf=2"])
    for where, (_, _, c) in client_containers(docs).items():
        assert c["resources"]["limits"] == {**c["resources"]["limits"], "nvidia.com/sriov_rdma_vf": "2"}, where
        assert "rdma/ib" not in c["resources"]["limits"], where
    sets = ["node.dataPlanes.ucx.enabled=true", "node.dataPlanes.ucx.rdma.enabled=true",
            "node.dataPlanes.ucx.rdma.hostDevices=true", *ENGINES_ON]  # fmt: skip
    docs = render(sets=sets)
    validate_all(docs)  # the API refuses privileged with allowPrivilegeEscalation false: not rendered together
    _, spec = node_pod(docs)
    node = spec["containers"][0]
    assert node["securityContext"]["privileged"] is True and "allowPrivilegeEscalation" not in node["securityContext"]
    assert mount(node, "dev-infiniband") == {"name": "dev-infiniband", "mountPath": "/dev/infiniband"}
    assert volume(spec, "dev-infiniband")["hostPath"] == {"path": "/dev/infiniband", "type": "Directory"}
    for where, (_, _, c) in client_containers(docs).items():
        assert c["securityContext"]["privileged"] is True and mount(c, "dev-infiniband"), where


# ------------------------------------------------------------------------------- the same-host socket


def test_the_socket_can_be_turned_off_and_moved() -> None:
    docs = render(sets=["node.localSocket.enabled=false", *ENGINES_ON])
    _, spec = node_pod(docs)
    assert not any(a.startswith("--local-socket") for a in spec["containers"][0]["args"])
    assert [c["name"] for c in spec["initContainers"]] == ["nvme-permissions"]
    for where, (_, cspec, c) in client_containers(docs).items():
        assert "KVSTORE_LOCAL_SOCKET" not in container_env(c), where
        assert "supplementalGroups" not in cspec["securityContext"], where
        assert "KVSTORE_LOCAL_NODE" in container_env(c), where  # still: puts go to this host's node first
    docs = render(sets=["node.localSocket.hostDir=/run/kv", "node.localSocket.group=2000", "fullnameOverride=a"])
    _, spec = node_pod(docs)
    assert "--local-socket=/run/kv/node.sock" in spec["containers"][0]["args"]
    assert volume(spec, "kvstore-local-socket")["hostPath"]["path"] == "/run/kv/a"
    init = spec["initContainers"][0]
    assert init["command"][-1] == "/run/kv" and '"10001:2000"' in init["command"][2]
    for where, (_, cspec, _) in client_containers(docs).items():
        assert cspec["securityContext"]["supplementalGroups"] == [2000], where


def _as(uid: int, gid: int, groups: list[int]) -> list[str]:
    """argv prefix running a command as uid/gid with these supplementary groups and no capabilities, as a
    pod's non-root container runs."""
    group_args = [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", *group_args, "--inh-caps=-all", "--bounding-set=-all"]


PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as the pods' users (CI runs as root)")
def test_socket_directory_lets_the_node_serve_and_only_the_socket_group_connect(
    request: pytest.FixtureRequest,
) -> None:
    """The node pod's init container, run for real on a directory as root (the kubelet creates the
    hostPath root-owned): then the node's user binds a socket in it, a client of another user in the
    socket group connects but can neither rename the node's socket nor bind one of its own there (SECURITY.md,
    round 4, finding 1: with mode 2770 another tenant's client replaced the socket), and a user outside the
    group cannot even reach the socket."""
    docs = render(sets=["node.localSocket.group=3456"])
    _, spec = node_pod(docs)
    init = next(c for c in spec["initContainers"] if c["name"] == "local-socket-permissions")
    assert init["securityContext"]["runAsUser"] == 0 and init["securityContext"]["capabilities"]["drop"] == ["ALL"]
    base = Path(tempfile.mkdtemp(prefix="kvs-sock-", dir="/tmp"))  # pytest's tmp_path is 0700 root's
    os.chmod(base, 0o755)
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    hostdir = base / "hostdir"
    hostdir.mkdir(mode=0o755)
    caps = "-all," + ",".join("+" + c.lower() for c in init["securityContext"]["capabilities"]["add"])
    subprocess.run(["setpriv", f"--bounding-set={caps}", *init["command"][:3], str(hostdir)], check=True, timeout=30)
    st = hostdir.stat()
    assert (st.st_uid, st.st_gid, oct(st.st_mode & 0o7777)) == (10001, 3456, "0o2750")
    sock = hostdir / "node.sock"
    serve = ("import socket, os, sys; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); os.chmod(sys.argv[1], 0o660);"
             "s.listen(); print('ready', flush=True); c, _ = s.accept(); c.sendall(b'ok'); c.close()")  # fmt: skip
    node = subprocess.Popen([*_as(10001, 10001, []), PYTHON, "-c", serve, str(sock)], stdout=subprocess.PIPE, text=True)
    try:
        assert node.stdout is not None and node.stdout.readline().strip() == "ready"
        assert sock.stat().st_gid == 3456  # the setgid directory gave the socket its group
        connect = (
            "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); print(s.recv(2).decode())"
        )
        outsider = subprocess.run([*_as(20002, 20002, []), PYTHON, "-c", connect, str(sock)],
                                  check=False, capture_output=True, text=True, timeout=30)  # fmt: skip
        assert outsider.returncode != 0 and "Permission denied" in outsider.stderr
        engine = subprocess.run([*_as(20002, 20002, [3456]), PYTHON, "-c", connect, str(sock)],
                                check=False, capture_output=True, text=True, timeout=30)  # fmt: skip
        assert engine.returncode == 0 and engine.stdout.strip() == "ok", engine.stderr
        squat = ("import os, socket, sys; d = sys.argv[1]\n"
                 "for act in (lambda: os.rename(d + '/node.sock', d + '/moved.sock'),\n"
                 "            lambda: socket.socket(socket.AF_UNIX).bind(d + '/other.sock')):\n"
                 "    try:\n        act(); print('done')\n    except PermissionError:\n        print('denied')")  # fmt: skip
        tenant = subprocess.run([*_as(20003, 20003, [3456]), PYTHON, "-c", squat, str(hostdir)],
                                check=False, capture_output=True, text=True, timeout=30)  # fmt: skip
        assert tenant.stdout.split() == ["denied", "denied"], (tenant.stdout, tenant.stderr)
        assert sock.exists() and not (hostdir / "other.sock").exists()
        assert node.wait(10) == 0
    finally:
        if node.poll() is None:
            node.kill()
            node.wait(10)


# ------------------------------------------------------------------------------------ memlock check


def _memlock_script(docs: list[dict[str, Any]]) -> str:
    _, spec = node_pod(docs)
    init = next(c for c in spec["initContainers"] if c["name"] == "memlock-check")
    assert init["command"][:2] == ["sh", "-c"]
    return init["command"][2]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to a pod's user and capabilities")
def test_memlock_check_passes_with_ipc_lock_or_unlimited_memlock_and_names_the_fix_otherwise() -> None:
    """The rendered check, run by a real sh: as root with CAP_IPC_LOCK it passes; as uid 10001 without
    capabilities it passes only under an unlimited RLIMIT_MEMLOCK, and otherwise fails naming the fix."""
    script = _memlock_script(render(sets=RDMA_ON))
    ok = subprocess.run(["sh", "-c", script], check=False, capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and ": ok" in ok.stdout
    limited = subprocess.run(["prlimit", "--memlock=65536:65536", *_as(10001, 10001, []), "sh", "-c", script],
                             check=False, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert limited.returncode == 1
    assert "RLIMIT_MEMLOCK is 64 KiB" in limited.stderr and "LimitMEMLOCK=infinity" in limited.stderr
    assert "node.dataPlanes.ucx.rdma.memlockCheck" in limited.stderr


def _can_unlimit_memlock() -> bool:
    r = subprocess.run(["prlimit", "--memlock=unlimited", "true"], check=False, capture_output=True, timeout=30)
    return r.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0 or not _can_unlimit_memlock(),
                    reason="raising RLIMIT_MEMLOCK to unlimited needs CAP_SYS_RESOURCE or an unlimited hard limit")  # fmt: skip
def test_memlock_check_passes_a_non_root_user_under_an_unlimited_memlock() -> None:
    script = _memlock_script(render(sets=RDMA_ON))
    unlimited = subprocess.run(["prlimit", "--memlock=unlimited", *_as(10001, 10001, []), "sh", "-c", script],
                               check=False, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert unlimited.returncode == 0, unlimited.stderr


def test_every_fast_path_variant_validates() -> None:
    """Each option combination above, against Kubernetes 1.30 and 1.35 and the RayCluster CRD."""
    for sets in (RDMA_ON, [*RDMA_ON, *ENGINES_ON, "node.kind=StatefulSet"], [*UCX_ON, *ENGINES_ON],
                 [*RDMA_ON, "node.dataPlanes.ucx.rdma.ipcLock=false", "node.dataPlanes.ucx.rdma.memlockCheck=false"]):  # fmt: skip
        validate_all(render(sets=sets))
