"""The operator charges a group's weight traffic (issue 40 item 5, docs/economics.md "Weight traffic"):
the rate of the trainer's `rlfleet_trainer_weights_stored_bytes_total{view}` x 3600 / 1e9 x the group's
egressPricePerGb x its ready replicas, in its cost per hour and per usable token; and per planned replica
in the fleet-mix optimizer's cost (spec.router.optimize). Every expected number below is worked out by
hand in the comments."""

from __future__ import annotations

import json

import pytest

from rlfleet.api import RLJob
from rlfleet.catalog import get_catalog
from rlfleet.operator import decide, fleetplan
from rlfleet.operator.rebalance import (
    GroupInput,
    RebalanceConfig,
    RebalanceResult,
    RebalanceState,
    ViewMemory,
    egress_cost_per_hour,
    parse_trainer_stored_bytes,
    rebalance,
    replica_egress_cost_per_hour,
    view_rate,
)

# smoothing 0.5: the EMA is the mean of the newest rate and the previous EMA
CONFIG = RebalanceConfig(smoothing=0.5, reference_accelerator="h100", reference_price_per_gpu_hour=3.0)


def groups() -> list[GroupInput]:
    # remote: 2 ready replicas of 1 GPU at $3/GPU-h, bf16, paying $0.02/GB; local: the same, paying nothing
    remote = GroupInput(
        "remote",
        2,
        2,
        3.0,
        accelerator="h100",
        weight_format="bf16",
        tokens_per_second=1000.0,
        egress_price_per_gb=0.02,
    )
    local = GroupInput("local", 2, 2, 3.0, accelerator="h100", weight_format="bf16", tokens_per_second=1000.0)
    return [remote, local]


def step(state: RebalanceState | None, now: float, bf16: float | None) -> RebalanceResult:
    return rebalance(
        groups(), state, now, CONFIG, weights_stored_bytes=None if bf16 is None else {"bf16": bf16}
    )


def test_the_rate_of_two_intervals_a_restart_and_a_missed_reading_price_the_remote_group() -> None:
    # t=0: an anchor of 61 GB stored; no earlier reading, so no rate and no egress yet
    first = step(None, 0.0, 61e9)
    assert first.groups["remote"].egress_cost_per_hour is None
    assert first.groups["remote"].cost_per_hour == 6.0  # 2 GPUs x $3
    assert "egressCostPerHour" not in first.groups["remote"].status_patch()

    # t=600: +1.2 GB -> 2e6 B/s (the first rate: the EMA) -> 7.2 GB/h per replica x $0.02 = $0.144 x 2 = $0.288/h
    second = step(first.state, 600.0, 62.2e9)
    remote = second.groups["remote"]
    assert remote.egress_cost_per_hour == pytest.approx(0.288)
    assert remote.cost_per_hour == pytest.approx(6.288)
    # 6.288 USD/h / 3600 s / 1000 tok/s x 1e6 = 1.746666.. USD per 1M (all usable: nothing reported out of band)
    assert remote.cost_per_1m_useful_tokens == pytest.approx(1.7466666667)
    patch = remote.status_patch()
    assert (patch["egressCostPerHour"], patch["costPerHour"], patch["costPer1MTokens"]) == (
        0.288,
        6.288,
        1.7467,
    )
    # the fleet: 12.288 USD/h / 2000 tok/s -> 12.288 / 3600 / 2000 x 1e6 = 1.706666.. USD per 1M
    assert second.economics.cost_per_hour == pytest.approx(12.288)
    assert second.fleet_cost_per_1m_usable_tokens == pytest.approx(1.7066666667)

    # t=1200: +0.6 GB -> 1e6 B/s; EMA 0.5 x 1e6 + 0.5 x 2e6 = 1.5e6 B/s -> 5.4 GB/h x $0.02 x 2 = $0.216/h
    third = step(second.state, 1200.0, 62.8e9)
    assert third.groups["remote"].egress_cost_per_hour == pytest.approx(0.216)

    # t=1800: the trainer restarted, its counter reads 0.3 GB (< 62.8 GB): what it stored since, 0.3e9 / 600 =
    # 0.5e6 B/s; EMA 0.5 x 0.5e6 + 0.5 x 1.5e6 = 1e6 B/s -> 3.6 GB/h x $0.02 x 2 = $0.144/h
    fourth = step(third.state, 1800.0, 0.3e9)
    assert fourth.groups["remote"].egress_cost_per_hour == pytest.approx(0.144)
    assert fourth.state.views["bf16"] == ViewMemory(
        counter=0.3e9, time=1800.0, ema_bytes_per_second=pytest.approx(1e6)
    )

    # t=2400: the trainer unreadable: the view keeps its memory and the group its last egress
    fifth = step(fourth.state, 2400.0, None)
    assert fifth.groups["remote"].egress_cost_per_hour == pytest.approx(0.144)
    assert fifth.state.views["bf16"].time == 1800.0
    # t=3000: +0.6 GB since t=1800 (1200 s) -> 0.5e6 B/s; EMA 0.5 x 0.5e6 + 0.5 x 1e6 = 0.75e6 -> 2.7 GB/h x $0.02 x 2 = $0.108/h
    sixth = step(fifth.state, 3000.0, 0.9e9)
    assert sixth.groups["remote"].egress_cost_per_hour == pytest.approx(0.108)

    # the memory survives the JSON the rebalancer keeps
    restored = RebalanceState.from_dict(json.loads(json.dumps(third.state.to_dict())))
    assert step(restored, 1800.0, 0.3e9).groups["remote"].egress_cost_per_hour == pytest.approx(0.144)


def test_a_group_without_a_price_pays_nothing_and_costs_as_before() -> None:
    second = step(step(None, 0.0, 61e9).state, 600.0, 62.2e9)
    local = second.groups["local"]
    assert local.egress_cost_per_hour is None and "egressCostPerHour" not in local.status_patch()
    assert local.cost_per_hour == 6.0
    # 6 / 3600 / 1000 x 1e6 = 1.666.. USD per 1M usable tokens, as without any weight reading
    assert local.cost_per_1m_useful_tokens == pytest.approx(1.6666666667)
    without = rebalance(groups(), None, 600.0, CONFIG)
    assert (
        without.groups["local"].cost_per_hour == 6.0 and without.groups["remote"].egress_cost_per_hour is None
    )


def test_a_group_pays_for_its_own_views_traffic_and_its_ready_replicas() -> None:
    # an fp8 group reads the fp8 view: 0.3 GB over 600 s = 0.5e6 B/s -> 1.8 GB/h x $0.05 x 3 ready = $0.27/h
    fp8 = GroupInput(
        "fp8",
        3,
        4,
        2.0,
        accelerator="h100",
        weight_format="fp8",
        tokens_per_second=500.0,
        egress_price_per_gb=0.05,
    )
    first = rebalance([fp8], None, 0.0, CONFIG, weights_stored_bytes={"bf16": 0.0, "fp8": 1e9})
    second = rebalance([fp8], first.state, 600.0, CONFIG, weights_stored_bytes={"bf16": 60e9, "fp8": 1.3e9})
    assert second.groups["fp8"].egress_cost_per_hour == pytest.approx(0.27)
    assert second.groups["fp8"].cost_per_hour == pytest.approx(8.27)  # 4 GPUs x $2 + $0.27
    # no ready replica: no traffic
    idle = GroupInput("fp8", 0, 4, 2.0, accelerator="h100", weight_format="fp8", egress_price_per_gb=0.05)
    assert (
        rebalance([idle], first.state, 600.0, CONFIG, weights_stored_bytes={"fp8": 1.3e9})
        .groups["fp8"]
        .egress_cost_per_hour
        == 0.0
    )


def test_view_rate_and_the_cost_formula() -> None:
    assert view_rate(5e9, ViewMemory(), 60.0) is None  # no earlier reading
    assert view_rate(None, ViewMemory(1e9, 0.0), 60.0) is None  # no reading now
    assert view_rate(4e9, ViewMemory(1e9, 0.0), 60.0) == 5e7  # 3e9 / 60
    assert view_rate(6e8, ViewMemory(1e9, 0.0), 60.0) == 1e7  # restarted: 6e8 since, / 60
    assert view_rate(4e9, ViewMemory(1e9, 60.0), 60.0) is None  # no time elapsed
    # 1e6 B/s = 3.6 GB/h; x $0.02 = $0.072 per replica, x 5 = $0.36
    assert egress_cost_per_hour(1e6, 0.02, 5) == pytest.approx(0.36)


def test_the_trainers_counter_is_parsed_and_the_groups_price_taken_from_its_spec() -> None:
    text = """# HELP rlfleet_trainer_weights_stored_bytes bytes stored
# TYPE rlfleet_trainer_weights_stored_bytes counter
rlfleet_trainer_weights_stored_bytes_total{view="bf16"} 6.22e+10
rlfleet_trainer_weights_stored_bytes_created{view="bf16"} 1.7e+09
rlfleet_trainer_weights_stored_bytes_total{view="fp8"} 3.1e+10
# HELP rlfleet_trainer_kl_k3 kl
# TYPE rlfleet_trainer_kl_k3 gauge
rlfleet_trainer_kl_k3{key="a",scope="group"} 0.01
"""
    assert parse_trainer_stored_bytes(text) == {"bf16": 6.22e10, "fp8": 3.1e10}
    assert parse_trainer_stored_bytes('rlfleet_trainer_kl_k3{key="a",scope="group"} 0.01\n') == {}
    job = RLJob.from_manifest(
        {
            "apiVersion": "rlfleet.dev/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": "j", "namespace": "ns"},
            "spec": {
                "model": {"name": "m", "path": "/m"},
                "samplerGroups": [
                    {"name": "remote", "accelerator": "h100", "replicas": 2, "egressPricePerGb": 0.02}
                ],
                "weightChannel": {"store": {"type": "filesystem", "path": "/w"}},
            },
        }
    )
    sg = {
        "metadata": {"name": "j-remote"},
        "spec": {"name": "remote", "accelerator": "h100", "replicas": 2, "egressPricePerGb": 0.02},
        "status": {"readyReplicas": 2},
    }
    assert decide.group_input(job, sg, {}, {}, None).egress_price_per_gb == 0.02
    sg["spec"].pop("egressPricePerGb")
    assert decide.group_input(job, sg, {}, {}, None).egress_price_per_gb is None


# --- the fleet-mix optimizer (spec.router.optimize) charges it per planned replica -------------------------
#
# Two h100 fp8 groups of one GPU at the catalog's $2.99/GPU-h, each 1000 tok/s per replica, one replica each;
# demand 2000 usable tok/s, bounds [0, 4]. "remote" pays $0.08/GB for its view: between two readings 1800 s
# apart the trainer stored 3 versions of the fp8 view at 1.5 GB each (anchors and deltas averaged), so
# 1.5 GB/version x 6 versions/h x $0.08/GB = $0.72/h per replica (the rate: 4.5e9 B / 1800 s = 2.5e6 B/s).
# Free of egress every plan of 2 replicas costs $5.98/h: the current (1, 1) is kept. Paying it, (1, 1)
# costs $6.70/h and (0, 2) $5.98/h: the optimum saves 0.72 / 6.70 = 10.75% > the hysteresis 5%, and
# the optimizer moves remote's replica to local.

BYTES_PER_VERSION, VERSIONS_PER_HOUR, PRICE_PER_GB = 1.5e9, 6.0, 0.08
EGRESS_PER_REPLICA_HOUR = 0.72  # 1.5 x 6 x 0.08, by hand

OPTIMIZED_JOB = {
    "apiVersion": "rlfleet.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "j", "namespace": "ns", "uid": "u"},
    "spec": {
        "model": {"name": "m", "path": "/m"},
        "trainer": {"accelerator": "h100"},
        "samplerGroups": [
            {"name": "remote", "accelerator": "h100", "weightFormat": "fp8", "replicas": 1, "egressPricePerGb": PRICE_PER_GB},
            {"name": "local", "accelerator": "h100", "weightFormat": "fp8", "replicas": 1},
        ],
        "router": {"optimize": {"enabled": True, "demand": {"usableTokensPerSecond": 2000},
                                "groups": {"remote": {"maxReplicas": 4}, "local": {"maxReplicas": 4}}}},
        "weightChannel": {"store": {"type": "filesystem", "path": "/w"}},
    },
}  # fmt: skip


def samplergroups(price: float | None = PRICE_PER_GB) -> list[dict]:
    remote = {"name": "remote", "accelerator": "h100", "weightFormat": "fp8", "replicas": 1}
    if price is not None:
        remote["egressPricePerGb"] = price
    local = {"name": "local", "accelerator": "h100", "weightFormat": "fp8", "replicas": 1}
    return [
        {"metadata": {"name": f"j-{s['name']}"}, "spec": s, "status": {"readyReplicas": 1}}
        for s in (remote, local)
    ]


def stored_state() -> RebalanceState:
    """The rebalance state after the two readings of the fp8 view, 1800 s apart."""
    first = RebalanceState(views={"fp8": ViewMemory(counter=10e9, time=0.0)})
    remote = GroupInput(
        "remote",
        1,
        1,
        2.99,
        accelerator="h100",
        weight_format="fp8",
        tokens_per_second=1000.0,
        egress_price_per_gb=PRICE_PER_GB,
    )
    stored = 10e9 + BYTES_PER_VERSION * VERSIONS_PER_HOUR / 2  # half an hour: 3 versions
    return rebalance([remote], first, 1800.0, CONFIG, weights_stored_bytes={"fp8": stored}).state


def optimizer_decision(egress: float | None, price: float | None = PRICE_PER_GB) -> fleetplan.FleetDecision:
    spec = RLJob.from_manifest(OPTIMIZED_JOB).spec.router.optimize
    readings = [
        fleetplan.fleet_reading(
            sg, 2.99, 1, 1000.0, None, None, False, egress if sg["spec"]["name"] == "remote" else None
        )
        for sg in samplergroups(price)
    ]
    reference = fleetplan.ReferenceFigures("h100", 1000.0, 2.99, None)
    request, left_out = fleetplan.fleet_request(
        spec, "h100", reference, readings, {"remote": 1000.0, "local": 1000.0}
    )
    return fleetplan.decide(request, left_out, readings, {"remote": 0.5, "local": 0.5})


def test_the_optimizers_egress_per_replica_is_bytes_per_version_x_versions_per_hour_x_price() -> None:
    state = stored_state()
    assert state.views["fp8"].ema_bytes_per_second == 2.5e6
    egress = replica_egress_cost_per_hour(PRICE_PER_GB, "fp8", state)
    assert egress == pytest.approx(BYTES_PER_VERSION * VERSIONS_PER_HOUR * PRICE_PER_GB / 1e9, rel=1e-12)
    assert egress == pytest.approx(EGRESS_PER_REPLICA_HOUR, rel=1e-12)
    # no price, another view not read, no state read yet: none
    assert replica_egress_cost_per_hour(None, "fp8", state) is None
    assert replica_egress_cost_per_hour(PRICE_PER_GB, "bf16", state) is None
    assert replica_egress_cost_per_hour(PRICE_PER_GB, "fp8", RebalanceState()) is None


def test_of_two_groups_alike_the_optimizer_scales_up_the_one_that_pays_no_egress() -> None:
    paying = optimizer_decision(replica_egress_cost_per_hour(PRICE_PER_GB, "fp8", stored_state()))
    assert paying.decision == "Scaled" and paying.changes() == {"remote": (1, 0), "local": (1, 2)}
    assert paying.plan is not None and paying.plan.cost_per_hour == pytest.approx(5.98, rel=1e-12)
    assert paying.shares == {"remote": 0.0, "local": 1.0}
    # the request carries the figure; the solver charges it per replica on top of the GPUs
    assert paying.reason.startswith(
        "the optimum saves 10.75% of $6.70/h (> hysteresis 5.00%); plan $5.98/h, $0.8306 per 1M usable tokens"
    )  # 5.98 / 3600 / 2000 x 1e6
    assert paying.reason.endswith(
        "remote pays $0.7200/h per replica for its weight traffic (egress $0.08/GB), in its cost"
    )
    # free of egress (no price): every 2-replica plan costs the same, the current one is kept
    free = optimizer_decision(None, price=None)
    assert free.decision == "Kept" and free.changes() == {} and "weight traffic" not in free.reason
    assert free.plan is not None and free.plan.cost_per_hour == pytest.approx(5.98, rel=1e-12)
    # a price but no reading of its view yet: planned at 0 egress, and the reason says so
    unread = optimizer_decision(None)
    assert unread.decision == "Kept" and unread.changes() == {}
    assert unread.reason.endswith(
        "remote planned without its weight traffic (egress $0.08/GB: its fp8 view's "
        "stored bytes not read yet)"
    )


def test_the_decision_gives_the_optimizer_each_groups_egress_from_its_views_reading() -> None:
    """decide.py end to end: the first decision has one reading of the view (no rate: planned without
    egress, kept), the second its rate (remote drained, local scaled up)."""
    job = RLJob.from_manifest(OPTIMIZED_JOB)
    groups = tuple(
        decide.GroupObservation(name, 1, 1, tokens_per_second=1000.0) for name in ("remote", "local")
    )
    first = decide.decide(
        job, decide.Observations(groups, weights_stored_bytes={"fp8": 10e9}), None, 0.0, get_catalog()
    )
    assert first.plan is not None and first.plan.decision == "Kept"
    assert "remote planned without its weight traffic" in first.plan.reason
    second = decide.decide(
        job,
        decide.Observations(groups, weights_stored_bytes={"fp8": 10e9 + 4.5e9}),
        first,
        1800.0,
        get_catalog(),
    )
    assert second.result is not None
    assert second.result.groups["remote"].egress_cost_per_hour == pytest.approx(
        EGRESS_PER_REPLICA_HOUR, rel=1e-12
    )
    assert second.plan is not None and second.plan.decision == "Scaled"
    assert second.plan.changes() == {"remote": (1, 0), "local": (1, 2)}
    assert "remote pays $0.7200/h per replica for its weight traffic" in second.plan.reason
    assert {g: d.replicas for g, d in second.groups.items()} == {"remote": 0, "local": 2}
    assert second.groups["local"].replicas_reason.startswith("fleet plan (Scaled): the optimum saves 10.75%")


def test_a_lora_group_pays_for_its_base_views_traffic_and_every_versions_adapter() -> None:
    # one interval of 600 s: bf16 +6e8 B (the base, stored once: 1e6 B/s over this interval), lora +1.2e8 B
    # (the adapters: 2e5 B/s). A LoRA group reads both: 1.2e6 B/s -> 4.32 GB/h x $0.02 = $0.0864 per replica;
    # the same group without LoRA reads the bf16 view alone: 3.6 GB/h x $0.02 = $0.072.
    state = RebalanceState(
        views={
            "bf16": ViewMemory(counter=6e8, time=600.0, ema_bytes_per_second=1e6),
            "lora": ViewMemory(counter=1.2e8, time=600.0, ema_bytes_per_second=2e5),
        }
    )
    assert replica_egress_cost_per_hour(0.02, "bf16", state, lora=True) == pytest.approx(0.0864)
    assert replica_egress_cost_per_hour(0.02, "bf16", state) == pytest.approx(0.072)
    # the adapters' rate not read yet: no figure rather than a low one
    no_adapters = RebalanceState(views={"bf16": state.views["bf16"]})
    assert replica_egress_cost_per_hour(0.02, "bf16", no_adapters, lora=True) is None
    # the decide stage takes `lora` from the SamplerGroup's spec
    sg = {"spec": {"name": "g", "accelerator": "h100", "weightFormat": "fp8", "lora": {"rank": 8}}}
    job = RLJob.from_manifest(OPTIMIZED_JOB)
    assert decide.group_input(job, sg, {}, {}, None).lora
    assert not decide.group_input(job, {"spec": {**sg["spec"], "lora": None}}, {}, {}, None).lora
