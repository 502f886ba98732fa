"""The cluster simulation (devkit/cluster_sim.py): deterministic, and its modes do what they say on a small cluster."""

from __future__ import annotations

import pytest

from devkit.cluster_sim import SimConfig, simulate

SMALL = SimConfig(nodes=12, capacity=300, prefixes=4, active=120, requests=800, rate=30.0, churn_every=5.0)


def test_the_simulation_is_deterministic() -> None:
    a, b = simulate(SMALL, "heat"), simulate(SMALL, "heat")
    assert (a.pages_hit, a.copies, a.served) == (b.pages_hit, b.copies, b.served)


def test_modes_copy_as_they_say_and_heat_spreads_the_reads() -> None:
    none, static2, heat = (simulate(SMALL, m) for m in ("none", "static2", "heat"))
    assert none.copies == 0 and none.kills == heat.kills > 0
    assert static2.copies > heat.copies > 0  # two of every page, against copies of what is read
    assert heat.max_over_mean < none.max_over_mean  # a hot prefix is served from several nodes
    assert 0 < heat.hit_rate <= 1 and heat.pages_read == none.pages_read


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="mode"):
        simulate(SMALL, "three")
