"""`kvstore pd-serve` placement (workers/deploy.py plan_slots): pure, on ray.nodes()-shaped records."""

from __future__ import annotations

from workers.deploy import Role, Slot, count, plan_slots


def node(nid: str, alive: bool = True, **res: float) -> dict:
    return {"NodeID": nid, "Alive": alive, "Resources": {"CPU": 8.0, **res}}


def test_one_slot_per_resource_unit_with_an_even_gpu_share() -> None:
    slots = plan_slots([node("p1", kvstore_prefill=4, GPU=4), node("d1", kvstore_decode=2, GPU=2), node("head")])
    assert count(slots, Role.PREFILL) == 4 and count(slots, Role.DECODE) == 2
    assert {s.gpus for s in slots} == {1.0}
    assert [s.index for s in slots if s.ray_node == "p1"] == [0, 1, 2, 3]


def test_cpu_nodes_get_no_gpus_and_dead_nodes_no_slots() -> None:
    slots = plan_slots([node("p1", kvstore_prefill=1), node("p2", alive=False, kvstore_prefill=1)])
    assert slots == [Slot(Role.PREFILL, "p1", 0, 0.0)]


def test_a_node_offering_both_roles_splits_its_gpus() -> None:
    slots = plan_slots([node("x", kvstore_prefill=1, kvstore_decode=1, GPU=1)])
    assert [(s.role, s.gpus) for s in slots] == [(Role.DECODE, 0.5), (Role.PREFILL, 0.5)]


def test_the_plan_is_ordered_so_a_changed_cluster_is_detected_by_equality() -> None:
    a = plan_slots([node("b", kvstore_decode=1), node("a", kvstore_prefill=1)])
    b = plan_slots([node("a", kvstore_prefill=1), node("b", kvstore_decode=1)])
    assert a == b
    assert plan_slots([node("a", kvstore_prefill=1)]) != b
