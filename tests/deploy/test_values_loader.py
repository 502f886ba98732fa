"""`kvstore up --values`: the chart's values turned into local processes; the same bad files as the
chart refuses, refused with the same value named, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvstore.cli.values import load_values, merge, plan
from kvstore.config import parse_size
from kvstore.pageformat import slot_bytes_for
from tests.deploy.cases import BAD_VALUES, names_value
from tests.deploy.conftest import CHART, PROFILES

pytestmark = pytest.mark.fast  # pure: no process, node or network (tests/conftest.py)

GiB = 1 << 30


def write(tmp_path: Path, values: dict, name: str = "values.yaml") -> Path:
    f = tmp_path / name
    f.write_text(yaml.safe_dump(values))
    return f


@pytest.mark.parametrize(("values", "name"), [c[1:] for c in BAD_VALUES], ids=[c[0] for c in BAD_VALUES])
def test_the_loader_refuses_what_the_chart_refuses(values: dict, name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        load_values([write(tmp_path, values)], CHART)
    assert names_value(str(err.value), name), str(err.value)


def test_merge_follows_helm() -> None:
    base = {"a": {"b": 1, "c": {"d": 2}}, "l": [1, 2], "x": 1}
    assert merge(base, {"a": {"c": {"e": 3}}, "l": [9], "x": None}) == {"a": {"b": 1, "c": {"d": 2, "e": 3}}, "l": [9]}
    assert base == {"a": {"b": 1, "c": {"d": 2}}, "l": [1, 2], "x": 1}  # inputs untouched


def test_profiles_plan_scaled_budgets_and_the_chart_node_toml(tmp_path: Path) -> None:
    for profile in PROFILES:
        v = load_values([profile], CHART)
        p = plan(v, tmp_path, mem_available=64 * GiB)
        scale = v["local"]["scale"]
        assert p.node is not None and p.nodes >= 1
        assert p.node.dram_bytes == int(parse_size(v["node"]["budgets"]["dram"]) * scale)
        assert p.node.nvme_bytes == int(parse_size(v["node"]["budgets"]["nvme"]) * scale)
        assert p.node.config["grace_seconds"] == v["node"]["shutdown"]["drainSeconds"]
        assert p.redis_password == v["redis"]["auth"]["enabled"]
        assert p.workers is None  # local.workers is off in the examples: a laptop has no model
    prod = plan(load_values([CHART.parents[1] / "deploy" / "values" / "production.yaml"], CHART), tmp_path, 64 * GiB)
    assert any("tls" in n for n in prod.notes)  # what the local run leaves out is said


def test_later_files_override_earlier_ones_and_nodes_follow_the_kind(tmp_path: Path) -> None:
    a = write(tmp_path, {"node": {"kind": "StatefulSet", "replicas": 3}, "local": {"scale": 0.001}}, "a.yaml")
    b = write(tmp_path, {"local": {"scale": 0.0005}}, "b.yaml")
    v = load_values([a, b], CHART)
    p = plan(v, tmp_path, mem_available=64 * GiB)
    assert p.nodes == 3 and v["local"]["scale"] == 0.0005


def test_a_plan_that_does_not_fit_names_local_scale(tmp_path: Path) -> None:
    v = load_values([write(tmp_path, {"local": {"scale": 1.0}})], CHART)  # 8 GiB of DRAM + 2 GiB overhead
    with pytest.raises(ValueError, match=r"local\.scale"):
        plan(v, tmp_path, mem_available=4 * GiB)
    tiny = load_values([write(tmp_path, {"local": {"scale": 1e-6}})], CHART)
    with pytest.raises(ValueError, match=r"less than one page slot"):
        plan(tiny, tmp_path, mem_available=64 * GiB)
    ok = load_values([write(tmp_path, {"local": {"scale": 0.001}})], CHART)
    assert plan(ok, tmp_path, mem_available=64 * GiB).node.dram_bytes >= slot_bytes_for(2 << 20)  # type: ignore[union-attr]


def test_local_workers_need_a_checkpoint(tmp_path: Path) -> None:
    v = load_values([write(tmp_path, {"local": {"scale": 0.001, "workers": True, "modelPath": str(tmp_path)}})], CHART)
    with pytest.raises(ValueError, match=r"local\.modelPath"):
        plan(v, tmp_path, mem_available=64 * GiB)


def test_engines_run_locally_only_with_vllm_and_the_refusal_names_the_field(tmp_path: Path) -> None:
    import sys

    from kvstore.cli.engines import DEFAULT_ENGINE_PYTHON, plan_engines

    bogus = {"engines": {"enabled": True}, "local": {"scale": 0.001, "engines": {"python": str(tmp_path / "nope")}}}
    v = load_values([write(tmp_path, bogus)], CHART)
    with pytest.raises(ValueError, match=r"local\.engines\.python .*cannot import"):
        plan(v, tmp_path, mem_available=64 * GiB)
    no_vllm = {"engines": {"enabled": True}, "local": {"scale": 0.001, "engines": {"python": sys.executable}}}
    with pytest.raises(ValueError, match=r"local\.engines\.python .*cannot import vllm"):
        plan(load_values([write(tmp_path, no_vllm)], CHART), tmp_path, mem_available=64 * GiB)
    if not DEFAULT_ENGINE_PYTHON.exists():
        unset = load_values([write(tmp_path, {"engines": {"enabled": True}, "local": {"scale": 0.001}})], CHART)
        with pytest.raises(ValueError, match=r"set local\.engines\.python"):
            plan(unset, tmp_path, mem_available=64 * GiB)
    with pytest.raises(ValueError, match=r"local\.engines\.modelPath"):
        plan_engines(v, Path(sys.executable), missing=[])
    off = {"engines": {"enabled": True}, "local": {"scale": 0.001, "engines": {"enabled": False}}}
    p = plan(load_values([write(tmp_path, off)], CHART), tmp_path, mem_available=64 * GiB)
    assert p.engines is None and any("local.engines.enabled is false" in n for n in p.notes)


def test_local_plan_serves_the_socket_and_ucx_as_the_chart_says(tmp_path: Path) -> None:
    v = load_values([write(tmp_path, {"local": {"scale": 0.001}, "node": {"dataPlanes": {"ucx": {"enabled": True}}}})],
                    CHART)  # fmt: skip
    p = plan(v, tmp_path, mem_available=64 * GiB)
    assert p.local_socket and p.node is not None and p.node.config["ucx_enabled"] is True
    assert "ucx_port" not in p.node.config  # a free port locally: nodes share one machine
    off = load_values(
        [write(tmp_path, {"local": {"scale": 0.001}, "node": {"localSocket": {"enabled": False}}})], CHART
    )
    assert not plan(off, tmp_path, mem_available=64 * GiB).local_socket


def test_local_workers_take_the_kv_encoding(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    for values, expect in (({}, "raw"), ({"workers": {"kvEncoding": "fp8"}}, "fp8")):
        local = {"local": {"scale": 0.001, "workers": True, "modelPath": str(tmp_path)}, **values}
        v = load_values([write(tmp_path, local)], CHART)
        workers = plan(v, tmp_path, mem_available=64 * GiB).workers
        assert workers is not None and workers.kv_encoding == expect


def test_redis_cluster_values_plan_a_local_redis_cluster(tmp_path: Path) -> None:
    """production.yaml with redis.cluster on: `kvstore up --values` starts a Redis Cluster of the same shape
    (the chart's masters and replicas per master) instead of the Sentinel group."""
    prod = CHART.parents[1] / "deploy" / "values" / "production.yaml"
    on = write(tmp_path, {"redis": {"cluster": {"enabled": True, "masters": 4, "replicasPerMaster": 2},
                                    "sentinel": {"enabled": False}}})  # fmt: skip
    p = plan(load_values([prod, on], CHART), tmp_path, mem_available=64 * GiB)
    assert p.redis_sentinel is None and p.redis_cluster is not None
    assert (p.redis_cluster.masters, p.redis_cluster.replicas, p.redis_cluster.node_timeout_ms) == (4, 2, 5000)
    assert plan(load_values([prod], CHART), tmp_path, mem_available=64 * GiB).redis_cluster is None
