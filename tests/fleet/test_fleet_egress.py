"""A group's weight traffic in the fleet economics (rlfleet/fleet.py, docs/economics.md "Weight traffic"):
the egress price per GB a group in another region pays, times the bytes its replicas read per version and
the versions per hour, is part of its cost per replica-hour, of its cost per usable token and of the
plan `rlfleet fleet plan` chooses. Numbers chosen to be exact in binary floating point."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlfleet.api import SamplerGroup, load_rljob
from rlfleet.api.samplergroup import SamplerGroupTemplate
from rlfleet.fleet import (
    FleetPlan,
    MeasuredGroup,
    cost_per_1m_usable_tokens,
    measured_economics,
    plan_fleet,
    request_from_mapping,
    weight_egress_cost_per_hour,
)
from rlfleet.operator import builders

REPO = Path(__file__).resolve().parents[2]

REFERENCE = {"tokensPerSecondPerReplica": 1000, "costPerReplicaHour": 3.6, "oorFraction": 0.0}


def group(name: str, cost: float, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "accelerator": "h100",
        "weightFormat": "fp8",
        "tokensPerSecondPerReplica": 1000,
        "costPerReplicaHour": cost,
        "kl": 0.0,
        "oorFraction": 0.0,
        "maxReplicas": 4,
        **extra,
    }


def plan_against_local(remote: dict[str, Any], **request: Any) -> FleetPlan:
    """The plan for 2000 usable tok/s between `remote` and a local group at $1.50/h (both `group`s), with
    the other `request` fields."""
    return plan_fleet(
        request_from_mapping(
            {
                "demand": {"usableTokensPerSecond": 2000},
                "reference": REFERENCE,
                "groups": [remote, group("local", 1.5)],
                **request,
            }
        )
    )


def test_weight_egress_cost_per_hour_is_bytes_times_versions_times_price() -> None:
    # 8 GB per version x 2 versions/h x $0.0625/GB = $1/h per replica
    assert weight_egress_cost_per_hour(8e9, 2.0, 0.0625) == 1.0
    # a bf16 view of 61 GB read whole every version at 6 versions/h and $0.02/GB: $7.32/h (to the cent)
    assert round(weight_egress_cost_per_hour(61e9, 6.0, 0.02), 10) == 7.32
    # deltas of 1.2% of it: 1.2% of that
    assert round(weight_egress_cost_per_hour(0.012 * 61e9, 6.0, 0.02), 10) == round(0.012 * 7.32, 10)
    assert weight_egress_cost_per_hour(8e9, 0.0, 0.0625) == weight_egress_cost_per_hour(8e9, 2.0, 0.0) == 0.0


def test_measured_economics_charges_a_groups_weight_traffic() -> None:
    """h100 at its catalog price $2.99/GPU-h x 2 GPUs + $1/h of weight traffic: $6.98/h for its
    1000 tok/s, half of them usable; the fleet pays both groups' GPUs and the traffic."""
    remote = MeasuredGroup("remote", "h100", "fp8", 2, 2.99, 1000.0, 0.5, egress_cost_per_hour=1.0)
    local = MeasuredGroup("local", "h100", "bf16", 1, 2.99, 500.0, 0.0)
    e = measured_economics([remote, local], "h100")
    g = e.groups["remote"]
    assert g.cost_per_hour == 2.99 * 2 + 1.0
    assert g.cost_per_1m_tokens == cost_per_1m_usable_tokens(1000.0, 1, 2.99 * 2 + 1.0, 0.0)
    assert g.cost_per_1m_usable_tokens == cost_per_1m_usable_tokens(1000.0, 1, 2.99 * 2 + 1.0, 0.5)
    assert e.groups["local"].cost_per_hour == 2.99
    assert e.cost_per_hour == 2.99 * 2 + 1.0 + 2.99
    # fleet: $9.97/h over 500 + 500 usable tok/s
    assert e.cost_per_1m_usable_tokens == (2.99 * 2 + 1.0 + 2.99) / (1000.0 * 3600.0) * 1e6
    without = measured_economics(
        [MeasuredGroup("remote", "h100", "fp8", 2, 2.99, 1000.0, 0.5), local], "h100"
    )
    assert without.groups["remote"].cost_per_1m_usable_tokens < g.cost_per_1m_usable_tokens
    # the reference (the fleet's h100 bf16 group) pays no egress: the saving shrinks by the traffic
    assert e.reference_cost_per_1m_usable_tokens == without.reference_cost_per_1m_usable_tokens
    assert e.saving is not None and without.saving is not None and e.saving < without.saving
    # no GPU price: no price at all (not the traffic's alone)
    unknown = measured_economics(
        [MeasuredGroup("x", "h100", "fp8", 2, 0.0, 1000.0, 0.0, egress_cost_per_hour=1.0)], "h100"
    )
    assert unknown.groups["x"].cost_per_hour is None and unknown.groups["x"].cost_per_1m_usable_tokens is None


def test_the_plan_counts_egress_in_each_replicas_cost() -> None:
    """Two groups making 1000 usable tok/s per replica for a demand of 2000: the remote one at $1/h is the
    cheaper until it pays for its weights: 8 GB per version x 2 versions/h x $0.0625/GB = $1/h per replica
    makes it $2/h against the local one's $1.50/h, and the plan moves to the local group."""
    free = plan_against_local(group("remote", 1.0, weightBytesPerVersion=8e9), versionsPerHour=2)
    assert free.replicas() == {"remote": 2, "local": 0} and free.cost_per_hour == 2.0
    assert "egressCostPerHour" not in free.to_dict()["groups"]["remote"]
    paying = plan_against_local(
        group("remote", 1.0, weightBytesPerVersion=8e9, egressPricePerGb=0.0625), versionsPerHour=2
    )
    assert paying.replicas() == {"remote": 0, "local": 2} and paying.cost_per_hour == 3.0
    # at the same replicas the remote group's usable token costs its GPUs and its traffic
    remote = next(g for g in paying.groups if g.name == "remote")
    assert remote.cost_per_1m_usable_tokens == cost_per_1m_usable_tokens(1000, 1, 2.0, 0.0)
    assert remote.egress_cost_per_hour == 0.0  # no replica, no traffic
    # the traffic at deltas' size (1/16 of the view) keeps the remote group the cheaper: $1.0625/h
    deltas = plan_against_local(
        group("remote", 1.0, weightBytesPerVersion=0.5e9, egressPricePerGb=0.0625), versionsPerHour=2
    )
    assert deltas.replicas() == {"remote": 2, "local": 0} and deltas.cost_per_hour == 2.125
    out = deltas.to_dict()["groups"]["remote"]
    assert (out["costPerHour"], out["egressCostPerHour"]) == (2.125, 0.125)


def test_a_measured_egress_cost_per_replica_hour_counts_as_the_computed_one() -> None:
    """egressCostPerReplicaHour (what the operator measures) in place of price x bytes x versions: $1/h per
    replica makes the remote group's $2/h against the local one's $1.50/h, as above."""
    paying = plan_against_local(group("remote", 1.0, egressCostPerReplicaHour=1.0))
    assert paying.replicas() == {"remote": 0, "local": 2} and paying.cost_per_hour == 3.0
    # at 0.25 it stays the cheaper ($1.25/h): 2 replicas, $0.50/h of them traffic
    cheap = plan_against_local(group("remote", 1.0, egressCostPerReplicaHour=0.25))
    out = cheap.to_dict()["groups"]["remote"]
    assert cheap.replicas() == {"remote": 2, "local": 0} and (
        out["costPerHour"],
        out["egressCostPerHour"],
    ) == (2.5, 0.5)


def test_a_reference_taken_from_a_group_pays_none_of_its_traffic() -> None:
    """No reference cost given: the reference is an h100 bf16 group's figures at its GPUs' cost ($1/h for
    1000 tok/s: 1 / 3600 / 1000 x 1e6 = $0.2777.. per 1M), not with the $1/h of weight traffic that group
    pays."""
    plan = plan_fleet(
        request_from_mapping(
            {
                "trainerAccelerator": "h100",
                "demand": {"usableTokensPerSecond": 1000},
                "reference": {},
                "groups": [group("remote", 1.0, weightFormat="bf16", egressCostPerReplicaHour=1.0)],
            }
        )
    )
    assert plan.reference_cost_per_1m_usable_tokens == 1.0 / 3600.0 / 1000.0 * 1e6
    assert plan.cost_per_1m_usable_tokens == 2.0 / 3600.0 / 1000.0 * 1e6 and plan.saving == -1.0


@pytest.mark.parametrize(
    ("extra", "top", "message"),
    [
        (
            {"egressPricePerGb": 0.05},
            {"versionsPerHour": 2},
            "egressPricePerGb needs its weightBytesPerVersion",
        ),
        ({"egressPricePerGb": 0.05, "weightBytesPerVersion": 1e9}, {}, "and the request's versionsPerHour"),
        (
            {"egressPricePerGb": -0.01},
            {},
            "groups.0.egressPricePerGb: Input should be greater than or equal to 0",
        ),
        (
            {"egressPricePerGb": 1001},
            {},
            "groups.0.egressPricePerGb: Input should be less than or equal to 1000",
        ),
        (
            {"weightBytesPerVersion": -1},
            {},
            "groups.0.weightBytesPerVersion: Input should be greater than or equal",
        ),
        ({}, {"versionsPerHour": -1}, "versionsPerHour: Input should be greater than or equal to 0"),
        (
            {"egressCostPerReplicaHour": 1.0, "egressPricePerGb": 0.05, "weightBytesPerVersion": 1e9},
            {"versionsPerHour": 2},
            "egressCostPerReplicaHour \\(measured\\) or egressPricePerGb with weightBytesPerVersion, not both",
        ),
        (
            {"egressCostPerReplicaHour": -1},
            {},
            "groups.0.egressCostPerReplicaHour: Input should be greater than or equal to 0",
        ),
    ],
)
def test_bad_egress_figures_are_refused_with_the_field(
    extra: dict[str, Any], top: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        request_from_mapping(
            {
                "demand": {"usableTokensPerSecond": 1},
                "reference": REFERENCE,
                "groups": [group("g", 1.0, **extra)],
                **top,
            }
        )


def test_a_sampler_groups_egress_price_is_bounded() -> None:
    base = {"name": "g", "accelerator": "h100", "weightFormat": "fp8"}
    assert SamplerGroupTemplate.model_validate(base).egress_price_per_gb is None
    assert SamplerGroupTemplate.model_validate({**base, "egressPricePerGb": 0.02}).egress_price_per_gb == 0.02
    for bad in (-0.01, 1001):
        with pytest.raises(ValueError, match="egressPricePerGb"):
            SamplerGroupTemplate.model_validate({**base, "egressPricePerGb": bad})


def test_the_rljobs_egress_price_reaches_its_samplergroup() -> None:
    """The RLJob's group carries egressPricePerGb to the SamplerGroup the operator builds (a valid object);
    a group without it has none."""
    job = load_rljob(REPO / "examples" / "rljob.yaml")
    priced = job.spec.sampler_groups[0].model_copy(update={"egress_price_per_gb": 0.02})
    sg = builders.build_samplergroup(job, priced, "ns", None)
    assert sg["spec"]["egressPricePerGb"] == 0.02
    assert SamplerGroup.model_validate(sg).spec.egress_price_per_gb == 0.02
    plain = builders.build_samplergroup(job, job.spec.sampler_groups[1], "ns", None)
    assert "egressPricePerGb" not in plain["spec"]
