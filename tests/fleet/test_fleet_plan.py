"""The fleet-mix optimizer (rlfleet/fleet.py, docs/economics.md): cost per usable token, hand-solved
optima, budgets, hysteresis, the change bound, binding constraints, infeasibility, and the MILP's answer
against a brute-force enumeration of every integer plan on small instances."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.catalog import CatalogError
from rlfleet.fleet import (
    PlanInfeasible,
    cost_per_1m_usable_tokens,
    fleet_cost_per_1m_usable_tokens,
    plan_fleet,
    request_from_mapping,
)

REFERENCE = {"tokensPerSecondPerReplica": 1000, "costPerReplicaHour": 3.6, "oorFraction": 0.0}


def group(name: str, tps: float, cost: float, max_replicas: int = 10, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "accelerator": "h100",
        "weightFormat": "fp8",
        "tokensPerSecondPerReplica": tps,
        "costPerReplicaHour": cost,
        "kl": extra.pop("kl", 0.0),
        "oorFraction": extra.pop("oor", 0.0),
        "maxReplicas": max_replicas,
        **extra,
    }


def request(groups: list[dict[str, Any]], demand: float, **extra: Any) -> Any:
    return request_from_mapping(
        {"demand": {"usableTokensPerSecond": demand}, "groups": groups, "reference": REFERENCE, **extra}
    )


def binding_of(plan: Any) -> set[tuple[str, str | None]]:
    return {(b.constraint, b.group) for b in plan.binding}


# --- cost per usable token -------------------------------------------------------------------------


def test_cost_per_1m_usable_tokens_arithmetic() -> None:
    # 2 replicas x $3.60/h = $7.20/h; 2 x 1000 tok/s x (1 - 0.5) = 1000 usable tok/s = 3.6M usable/h
    assert cost_per_1m_usable_tokens(1000, 2, 3.6, 0.5) == pytest.approx(2.0, rel=1e-12)
    # the replica count cancels
    assert cost_per_1m_usable_tokens(1000, 7, 3.6, 0.5) == pytest.approx(2.0, rel=1e-12)
    # no usable token: no price
    assert cost_per_1m_usable_tokens(1000, 0, 3.6, 0.0) is None
    assert cost_per_1m_usable_tokens(1000, 3, 3.6, 1.0) is None
    # fleet: $7.20 + $1.80 = $9/h over (1000 + 2000) usable tok/s = 10.8M/h -> $5/6 per 1M
    fleet = fleet_cost_per_1m_usable_tokens([(1000, 2, 3.6, 0.5), (2000, 1, 1.8, 0.0)])
    assert fleet == pytest.approx(5 / 6, rel=1e-12)


# --- hand-solved optima -----------------------------------------------------------------------------


def test_cheaper_group_is_used_up_to_its_bound_then_the_next() -> None:
    # A: $1/h per 1000 tok/s, at most 3; B: $2/h per 1000 tok/s. 3500 needed: A=3 (3000), B=1 (500 more).
    plan = plan_fleet(request([group("a", 1000, 1.0, max_replicas=3), group("b", 1000, 2.0)], 3500))
    assert plan.replicas() == {"a": 3, "b": 1}
    assert plan.cost_per_hour == pytest.approx(5.0)
    assert plan.decision == "optimal"
    shares = {g.name: g.share for g in plan.groups}
    assert shares == pytest.approx({"a": 0.75, "b": 0.25})
    assert binding_of(plan) == {("demand", None), ("maxReplicas", "a")}
    # $5/h over 4000 usable tok/s = 14.4M/h; the reference makes 1000 tok/s for $3.60/h = $1/1M
    assert plan.cost_per_1m_usable_tokens == pytest.approx(5 / 14.4)
    assert plan.reference_cost_per_1m_usable_tokens == pytest.approx(1.0)
    assert plan.saving == pytest.approx(1 - 5 / 14.4)


def test_without_explanation_the_same_plan_and_no_binding_list() -> None:
    req = request([group("a", 1000, 1.0, max_replicas=3), group("b", 1000, 2.0)], 3500)
    plan = plan_fleet(req, explain=False)
    assert plan.replicas() == {"a": 3, "b": 1}
    assert plan.binding == ()


def test_a_bound_the_optimum_does_not_reach_can_still_bind() -> None:
    # integer plans are not convex: a (1000 tok/s, $0.50/h, at most 2) is unused at the optimum b=1
    # ($2/h; a=2 + b=1 would be $3/h), yet three a's ($1.50/h) would be cheaper
    plan = plan_fleet(request([group("a", 1000, 0.5, max_replicas=2), group("b", 3000, 2.0)], 3000))
    assert plan.replicas() == {"a": 0, "b": 1}
    assert ("maxReplicas", "a") in binding_of(plan)


def test_group_budget_excludes_the_cheap_low_precision_group() -> None:
    cheap = group("b200-nvfp4", 4000, 2.0, kl=0.02, oor=0.05, accelerator="b200", weightFormat="nvfp4")
    safe = group("h100-bf16", 1000, 1.5, weightFormat="bf16")
    # without a budget: one nvfp4 replica (3800 usable tok/s, $2/h) beats two bf16 ones ($3/h)
    assert plan_fleet(request([cheap, safe], 2000)).replicas() == {"b200-nvfp4": 1, "h100-bf16": 0}
    plan = plan_fleet(request([cheap, safe], 2000, budgets={"groupMaxKl": 0.01}))
    assert plan.replicas() == {"b200-nvfp4": 0, "h100-bf16": 2}
    nvfp4 = plan.groups[0]
    assert not nvfp4.within_budget and nvfp4.share == 0.0
    assert ("groupBudget", "b200-nvfp4") in binding_of(plan)
    assert "KL 0.02 > 0.01" in next(b.message for b in plan.binding if b.group == "b200-nvfp4")


def test_fleet_out_of_range_budget_limits_the_mix() -> None:
    # fleet oor <= 0.02: 4000a x 0.05 <= 0.02 (4000a + 1000b)  <=>  b >= 6a. Demand 5000:
    # a=1 needs b>=6 ($11/h); a=0, b=5 is $7.50/h. Without the budget a=2 ($4/h).
    a = group("a", 4000, 2.0, oor=0.05)
    b = group("b", 1000, 1.5)
    assert plan_fleet(request([a, b], 5000)).replicas() == {"a": 2, "b": 0}
    plan = plan_fleet(request([a, b], 5000, budgets={"maxOorFraction": 0.02}))
    assert plan.replicas() == {"a": 0, "b": 5}
    assert plan.oor_fraction == 0.0
    assert ("fleetMaxOorFraction", None) in binding_of(plan)


def test_infeasible_demand_names_the_most_the_groups_can_make() -> None:
    with pytest.raises(
        PlanInfeasible, match=r"no plan meets the budgets: demand 5000 usable tokens/s; .* at most 3000"
    ):
        plan_fleet(
            request([group("a", 1000, 1.0, max_replicas=1), group("b", 1000, 2.0, max_replicas=2)], 5000)
        )


def test_infeasible_budget_names_the_constraint_whose_removal_helps() -> None:
    # only a high-KL group: the fleet KL budget admits none of its tokens
    with pytest.raises(PlanInfeasible, match="a plan exists without: fleetMaxKl"):
        plan_fleet(request([group("a", 1000, 1.0, kl=0.05)], 500, budgets={"maxKl": 0.01}))


def test_hysteresis_keeps_the_current_plan_when_the_gain_is_small() -> None:
    # optimum a=2 ($2.00/h); current b=2 ($2.08/h) meets the demand: gain 3.85%
    groups = [group("a", 1000, 1.0, replicas=0), group("b", 1000, 1.04, replicas=2)]
    kept = plan_fleet(request(groups, 2000, hysteresis=0.05))
    assert kept.decision == "kept"
    assert kept.replicas() == {"a": 0, "b": 2}
    assert kept.optimal_cost_per_hour == pytest.approx(2.0)
    assert "3.85%" in kept.reason
    moved = plan_fleet(request(groups, 2000, hysteresis=0.03))
    assert moved.decision == "optimal"
    assert moved.replicas() == {"a": 2, "b": 0}


def test_hysteresis_never_keeps_a_plan_that_misses_the_demand() -> None:
    groups = [group("a", 1000, 1.0, replicas=1), group("b", 1000, 1.04, replicas=0)]
    plan = plan_fleet(request(groups, 2000, hysteresis=0.5))
    assert plan.decision == "optimal"
    assert plan.replicas() == {"a": 2, "b": 0}


def test_change_bound_limits_one_step() -> None:
    # unbounded: a=4 (cheaper); from a=0, b=4 with at most 1 replica per group per step: a=1, b=3
    groups = [group("a", 1000, 1.0, replicas=0), group("b", 1000, 2.0, replicas=4)]
    assert plan_fleet(request(groups, 4000, hysteresis=0.0)).replicas() == {"a": 4, "b": 0}
    plan = plan_fleet(request(groups, 4000, hysteresis=0.0, maxStepReplicas=1))
    assert plan.replicas() == {"a": 1, "b": 3}
    # neither group's bound alone binds (a=1, b=3 either way); the setting does
    assert binding_of(plan) == {("demand", None), ("maxStep", None)}


def test_lowered_max_replicas_is_reached_one_bounded_step_at_a_time() -> None:
    groups = [group("a", 1000, 1.0, max_replicas=2, replicas=7), group("b", 1000, 2.0)]
    plan = plan_fleet(request(groups, 3000, maxStepReplicas=3))
    assert plan.replicas() == {"a": 4, "b": 0}  # 7 -> 4 (not 2): at most 3 removed per interval
    assert plan.decision == "optimal"


def test_group_over_budget_is_drained_at_the_change_bound() -> None:
    groups = [group("a", 1000, 1.0, kl=0.5, replicas=5), group("b", 1000, 2.0, replicas=2)]
    plan = plan_fleet(request(groups, 2000, budgets={"groupMaxKl": 0.1}, maxStepReplicas=2))
    assert plan.replicas() == {"a": 3, "b": 2}  # a: 5 -> 3 (no share); b serves the demand
    assert {g.name: g.share for g in plan.groups} == {"a": 0.0, "b": 1.0}
    # a's replicas cost money and make no usable token: $3 + $4 over 2000 usable tok/s
    assert plan.cost_per_1m_usable_tokens == pytest.approx(7.0 / 7.2)


def test_reference_defaults_to_a_bf16_group_of_the_trainer_class() -> None:
    ref = group("b200-bf16", 2000, 6.0, oor=0.1, accelerator="b200", weightFormat="bf16")
    req = request_from_mapping(
        {"demand": {"usableTokensPerSecond": 1000}, "groups": [ref, group("a", 1000, 1.0)]}
    )
    plan = plan_fleet(req)
    # $6/h over 1800 usable tok/s = 6.48M/h
    assert plan.reference_cost_per_1m_usable_tokens == pytest.approx(6 / 6.48)
    no_ref = request_from_mapping(
        {"demand": {"usableTokensPerSecond": 1000}, "groups": [group("a", 1000, 1.0)]}
    )
    with pytest.raises(CatalogError, match="reference.tokensPerSecondPerReplica"):
        plan_fleet(no_ref)


def test_catalog_price_when_no_cost_is_given() -> None:
    g = group("h100-fp8", 1000, 0.0)
    del g["costPerReplicaHour"]
    g["gpusPerReplica"] = 2
    plan = plan_fleet(request([g], 1000))
    assert plan.cost_per_hour == pytest.approx(2 * 2.99)  # the built-in catalog's h100 price


def test_bad_input_is_refused_at_the_boundary() -> None:
    with pytest.raises(ValueError, match="minReplicas 3 > maxReplicas 2"):
        request([group("a", 1000, 1.0, max_replicas=2, minReplicas=3)], 10)
    with pytest.raises(ValueError, match="groups.0.tokensPerSecondPerReplica"):
        request([group("a", 0, 1.0)], 10)
    with pytest.raises(ValueError, match="duplicate group names: a"):
        request([group("a", 1, 1.0), group("a", 1, 1.0)], 10)
    with pytest.raises(CatalogError, match="cannot run weightFormat nvfp4"):
        plan_fleet(request([group("a", 1000, 1.0, weightFormat="nvfp4")], 10))


# --- the MILP against every integer plan ------------------------------------------------------------


def brute_force_cost(spec: dict[str, Any]) -> float | None:
    """The cheapest plan by enumeration, with the constraints as docs/economics.md states them."""
    budgets = spec.get("budgets", {})
    step = spec.get("maxStepReplicas")
    ranges = []
    within = []
    for g in spec["groups"]:
        ok = g["kl"] <= budgets.get("groupMaxKl", float("inf"))
        within.append(ok)
        allowed = range(g.get("minReplicas", 0), g["maxReplicas"] + 1) if ok else range(0, 1)
        if step is not None and g.get("replicas") is not None:
            window = range(max(0, g["replicas"] - step), g["replicas"] + step + 1)
            # within one step of the current replicas; the step nearest the bounds when none is inside
            allowed = [x for x in window if x in allowed] or [
                min(window, key=lambda x: abs(x - allowed[0]) + abs(x - allowed[-1]))
            ]
        ranges.append(allowed)
    best = None
    for xs in itertools.product(*ranges):
        served = [(g, x) for g, x, ok in zip(spec["groups"], xs, within, strict=True) if ok]
        usable = sum(g["tokensPerSecondPerReplica"] * (1 - g["oorFraction"]) * x for g, x in served)
        tokens = sum(g["tokensPerSecondPerReplica"] * x for g, x in served)
        if usable < spec["demand"]["usableTokensPerSecond"] * (1 - 1e-9):
            continue
        if (
            "maxKl" in budgets
            and sum(g["tokensPerSecondPerReplica"] * x * g["kl"] for g, x in served)
            > budgets["maxKl"] * tokens + 1e-9
        ):
            continue
        if (
            "maxOorFraction" in budgets
            and sum(g["tokensPerSecondPerReplica"] * x * g["oorFraction"] for g, x in served)
            > budgets["maxOorFraction"] * tokens + 1e-9
        ):
            continue
        cost = sum(g["costPerReplicaHour"] * x for g, x in zip(spec["groups"], xs, strict=True))
        best = cost if best is None else min(best, cost)
    return best


@st.composite
def instances(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(2, 3))
    groups = []
    for i in range(n):
        max_replicas = draw(st.integers(0, 4))
        g = group(
            f"g{i}",
            tps=draw(st.sampled_from([500, 1000, 1500, 2500, 4000])),
            cost=draw(st.sampled_from([0.5, 1.0, 1.79, 2.99, 5.99])),
            max_replicas=max_replicas,
            kl=draw(st.sampled_from([0.0, 0.001, 0.01, 0.05])),
            oor=draw(st.sampled_from([0.0, 0.01, 0.05, 0.2])),
            minReplicas=draw(st.integers(0, max_replicas)),
        )
        if draw(st.booleans()):
            g["replicas"] = draw(st.integers(0, 8))  # may lie beyond the bounds (they were lowered)
        groups.append(g)
    budgets: dict[str, float] = {}
    for key, values in (("maxKl", [0.005, 0.02]), ("maxOorFraction", [0.02, 0.1]), ("groupMaxKl", [0.02])):
        if draw(st.booleans()):
            budgets[key] = draw(st.sampled_from(values))
    spec: dict[str, Any] = {
        "demand": {"usableTokensPerSecond": draw(st.integers(0, 12000))},
        "groups": groups,
        "budgets": budgets,
        "reference": REFERENCE,
        "hysteresis": 0.0,
    }
    if draw(st.booleans()):
        spec["maxStepReplicas"] = draw(st.integers(1, 2))
    return spec


@settings(max_examples=150, deadline=None)
@given(instances())
def test_milp_is_never_worse_than_enumerating_every_plan(spec: dict[str, Any]) -> None:
    expected = brute_force_cost(spec)
    req = request_from_mapping(spec)
    if expected is None:
        with pytest.raises(PlanInfeasible):
            plan_fleet(req)
        return
    plan = plan_fleet(req)
    assert plan.optimal_cost_per_hour == pytest.approx(expected, rel=1e-9, abs=1e-9)
    if plan.decision == "optimal":
        assert plan.cost_per_hour == pytest.approx(expected, rel=1e-9, abs=1e-9)
    shares = [g.share for g in plan.groups]
    assert sum(shares) == pytest.approx(1.0) or sum(shares) == 0.0
