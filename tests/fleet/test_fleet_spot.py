"""Spot groups in the fleet-mix optimizer (rlfleet/fleet.py, docs/economics.md "Spot groups"): among the
cheapest plans, the one with the fewest spot replicas, so a spot group's replicas are removed before an
on-demand group's of the same cost per usable token; never at a higher cost. Hand-solved instances, an
enumeration of every integer plan, the CLI file and the operator's mapping."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from support.fleet_plan_cli import run_fleet_plan
from test_fleet_plan import REFERENCE, group, request

from rlfleet.fleet import plan_fleet
from rlfleet.operator.fleetplan import fleet_reading


def plan(groups: list[dict[str, Any]], demand: float, **extra: Any) -> Any:
    return plan_fleet(request(groups, demand, **extra))


@pytest.mark.parametrize("spot_first_in_the_file", [False, True])
def test_at_equal_cost_the_spot_replicas_are_the_ones_left_out(spot_first_in_the_file: bool) -> None:
    # 4000 tok/s from two identical $2/h x 1000 tok/s groups of at most 3: every split of 4 costs $8/h;
    # the plan keeps the on-demand group whole and takes one spot replica
    on_demand, spot = (
        group("od", 1000, 2.0, max_replicas=3),
        group("sp", 1000, 2.0, max_replicas=3, spot=True),
    )
    groups = [spot, on_demand] if spot_first_in_the_file else [on_demand, spot]
    result = plan(groups, 4000)
    assert result.replicas() == {"od": 3, "sp": 1}
    assert result.cost_per_hour == pytest.approx(8.0)


def test_when_the_demand_falls_the_spot_group_is_drained_first() -> None:
    # running 3 + 3 (6000 tok/s); the demand falls to 3000 with up to 3 removed per group per interval:
    # $6/h is the optimum, and of its splits (3,0) (2,1) (1,2) (0,3) the one without spot replicas
    result = plan(
        [group("od", 1000, 2.0, replicas=3), group("sp", 1000, 2.0, replicas=3, spot=True)],
        3000,
        maxStepReplicas=3,
        hysteresis=0.05,
    )
    assert result.decision == "optimal"
    assert result.replicas() == {"od": 3, "sp": 0}
    # one replica per interval: both can lose one, the spot group loses it
    result = plan(
        [group("od", 1000, 2.0, replicas=3), group("sp", 1000, 2.0, replicas=3, spot=True)],
        5000,
        maxStepReplicas=1,
    )
    assert result.replicas() == {"od": 3, "sp": 2}


def test_equal_cost_per_usable_token_of_different_replica_sizes() -> None:
    # od: 2000 tok/s for $4/h, sp: 1000 tok/s for $2/h, both $2 per 1000 tok/s; oor 0.5 on od and 0 on sp
    # would differ, so both 0: plans of 4000 tok/s at $8/h are (2,0) (1,2) (0,4): the first
    result = plan([group("od", 2000, 4.0), group("sp", 1000, 2.0, spot=True)], 4000)
    assert result.replicas() == {"od": 2, "sp": 0}
    # the same price per USABLE token: od makes 2000 tok/s at 50% out of range = 1000 usable for $2/h
    result = plan([group("od", 2000, 2.0, oor=0.5), group("sp", 1000, 2.0, spot=True)], 3000)
    assert result.replicas() == {"od": 3, "sp": 0}


def test_a_cheaper_spot_group_still_wins_and_fills_what_on_demand_cannot() -> None:
    # the tie-break never costs money: spot at $1/h beats on-demand at $2/h
    result = plan([group("od", 1000, 2.0), group("sp", 1000, 1.0, spot=True)], 3000)
    assert result.replicas() == {"od": 0, "sp": 3}
    # equal prices, on-demand bounded at 2: the third replica has to be spot
    result = plan([group("od", 1000, 2.0, max_replicas=2), group("sp", 1000, 2.0, spot=True)], 3000)
    assert result.replicas() == {"od": 2, "sp": 1}


def enumerate_plans(groups: list[dict[str, Any]], demand: float) -> list[tuple[int, ...]]:
    """Every integer plan meeting the demand within the bounds."""
    ranges = [range(0, g["maxReplicas"] + 1) for g in groups]
    return [
        xs
        for xs in itertools.product(*ranges)
        if sum(g["tokensPerSecondPerReplica"] * x for g, x in zip(groups, xs, strict=True)) >= demand
    ]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 4), st.integers(1, 4), st.integers(0, 3), st.booleans()
        ),  # tok/s x1000, $/h, max, spot
        min_size=2,
        max_size=4,
    ),
    st.integers(1, 8),
)
def test_the_plan_is_the_cheapest_with_the_fewest_spot_replicas(
    specs: list[tuple[int, int, int, bool]], demand_k: int
) -> None:
    groups = [
        group(f"g{i}", tps * 1000, float(cost), max_replicas=m, spot=spot)
        for i, (tps, cost, m, spot) in enumerate(specs)
    ]
    feasible = enumerate_plans(groups, demand_k * 1000)
    if not feasible:
        return  # infeasible instances: test_fleet_plan.py
    cost = {xs: sum(g["costPerReplicaHour"] * x for g, x in zip(groups, xs, strict=True)) for xs in feasible}
    cheapest = min(cost.values())
    spot_of = {xs: sum(x for g, x in zip(groups, xs, strict=True) if g["spot"]) for xs in feasible}
    fewest = min(spot_of[xs] for xs in feasible if cost[xs] == cheapest)
    result = plan(groups, demand_k * 1000)
    chosen = tuple(result.replicas()[g["name"]] for g in groups)
    assert cost[chosen] == cheapest
    assert spot_of[chosen] == fewest


def test_the_plan_file_takes_spot_per_group(tmp_path: Path) -> None:
    spec = {
        "demand": {"usableTokensPerSecond": 4000},
        "reference": REFERENCE,
        "groups": [group("sp", 1000, 2.0, max_replicas=3, spot=True), group("od", 1000, 2.0, max_replicas=3)],
    }
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = run_fleet_plan(path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert {name: g["replicas"] for name, g in out["groups"].items()} == {"od": 3, "sp": 1}
    path.write_text(yaml.safe_dump({**spec, "groups": [{**spec["groups"][0], "spot": "sometimes"}]}))
    bad = run_fleet_plan(path)
    assert bad.returncode == 2 and "spot" in bad.stderr


def test_the_operator_reads_spot_from_the_samplergroup() -> None:
    sg = {
        "spec": {"name": "sp", "accelerator": "h100", "weightFormat": "fp8", "replicas": 2, "spot": True},
        "status": {"readyReplicas": 2},
    }
    assert fleet_reading(sg, 2.0, 1, 2000.0, 0.0, 0.0, False).spot is True
    del sg["spec"]["spot"]
    assert fleet_reading(sg, 2.0, 1, 2000.0, 0.0, 0.0, False).spot is False
