"""The decide stage (operator/decide.py, issue 41 item 1): hand-built observations -> exact decisions, with
the reason of each field, for every policy (shares, quarantine, the precision autopilot up and down with
its cool-down, the fleet-mix optimizer and its spot tie-break), and a restart: decisions read back from
the RLJob's status (through JSON, as the API server stores it) give the same next decision as the ones
kept in memory. Every expected number is worked out by hand in the comments."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rlfleet.api import RLJob
from rlfleet.api.rljob_status import DecisionsStatus
from rlfleet.catalog import get_catalog
from rlfleet.operator.decide import (
    RLJOB_FORMAT,
    SG_REPLICAS,
    Decisions,
    GroupObservation,
    Observations,
    decide,
    job_config,
    replicas_changed_in_rljob,
)
from rlfleet.operator.rebalance import PodSample

CATALOG = get_catalog()


def rljob(groups: list[dict[str, Any]], router: dict[str, Any] | None = None) -> RLJob:
    return RLJob.from_manifest(
        {
            "apiVersion": "rlfleet.dev/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": "j", "namespace": "ns"},
            "spec": {
                "model": {"name": "m", "path": "/m"},
                "trainer": {"accelerator": "b200"},
                "samplerGroups": groups,
                "router": router or {},
                "weightChannel": {"store": {"type": "filesystem", "path": "/w"}},
            },
        }
    )


def nulls(value: Any, path: str = "decisions") -> list[str]:
    """Where `value` holds a None (the CRD's structural schema has no nullable field: the API server would
    refuse the whole status)."""
    if value is None:
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in nulls(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in nulls(v, f"{path}[{i}]")]
    return []


def restarted(decisions: Decisions) -> Decisions:
    """The decisions as a restarted operator reads them: the RLJob status the pipeline writes, through JSON
    (the CRD's own model accepts it, and it holds no null)."""
    written = decisions.status()
    DecisionsStatus.model_validate(written)
    assert nulls(written) == []
    status = json.loads(
        json.dumps({"decisions": written, "precisionAutopilot": dict(decisions.precision_changes)})
    )
    back = Decisions.from_status(status)
    assert back is not None
    return back


# --- shares ----------------------------------------------------------------------------------------------


def test_shares_follow_throughput_bounded_per_decision_and_every_field_says_why() -> None:
    """300 and 100 tok/s, floor 0.02: the target is 0.02 + 0.96 x 3/4 = 0.74 and 0.26; from equal shares
    the bounded change (0.1) moves 0.5 -> 0.6 and 0.5 -> 0.4. One decision later, at the same readings,
    0.6 -> 0.7 (and the history records both moves)."""
    job = rljob(
        [
            {"name": "a", "accelerator": "h100", "weightFormat": "fp8", "replicas": 2},
            {"name": "b", "accelerator": "a100", "replicas": 1},
        ]
    )
    seen = Observations(
        (
            GroupObservation("a", 2, 2, tokens_per_second=300.0),
            GroupObservation("b", 1, 1, tokens_per_second=100.0),
        )
    )
    first = decide(job, seen, None, 1000.0, CATALOG)
    a, b = first.groups["a"], first.groups["b"]
    assert (a.share, b.share) == (pytest.approx(0.6, rel=1e-12), pytest.approx(0.4, rel=1e-12))
    assert a.share_reason == "throughput 300 tok/s; bounded toward 0.740"
    assert b.share_reason == "throughput 100 tok/s; bounded toward 0.260"
    assert (a.replicas, a.replicas_reason, b.replicas) == (2, SG_REPLICAS, 1)
    assert (a.weight_format, a.weight_format_reason, b.weight_format) == ("fp8", RLJOB_FORMAT, "bf16")
    assert (a.quarantined, a.quarantine_reason, a.held_quarantine) == (False, "", None)
    assert first.time == 1000.0 and first.shares == {"a": a.share, "b": b.share}
    second = decide(job, seen, first, 1030.0, CATALOG)
    assert second.groups["a"].share == pytest.approx(0.7, rel=1e-12)
    assert [(h["from"], h["to"]) for h in second.state.groups["a"].history] == [(0.5, 0.6), (0.6, 0.7)]


def test_a_static_policy_gives_the_configured_shares() -> None:
    job = rljob(
        [
            {"name": "a", "accelerator": "h100", "replicas": 1},
            {"name": "b", "accelerator": "h100", "replicas": 1},
        ],
        {"policy": "static", "staticShares": {"a": 0.8, "b": 0.2}, "maxShareChange": 1.0},
    )
    seen = Observations((GroupObservation("a", 1, 1), GroupObservation("b", 1, 1)))
    decided = decide(job, seen, None, 0.0, CATALOG)
    # 0.02 + 0.96 x 0.8 = 0.788, 0.02 + 0.96 x 0.2 = 0.212: the floor holds under the static policy too
    assert decided.shares == {"a": pytest.approx(0.788, rel=1e-12), "b": pytest.approx(0.212, rel=1e-12)}
    assert decided.groups["a"].share_reason == "static"


# --- replicas ----------------------------------------------------------------------------------------------


def test_a_kubectl_scale_is_an_observation_kept_until_the_rljobs_replicas_change_which_win() -> None:
    """The RLJob says 2. A kubectl scale to 4 is decided as observed, its reason says so, and it stays
    through the next decision and a restart (read back from status); the RLJob's change to 3 wins over it
    (the reconcile scaled the group already, or it is at 4 still: 3 either way), and one decision later the
    replicas are the SamplerGroup's again."""

    def job(replicas: int) -> RLJob:
        return rljob([{"name": "a", "accelerator": "h100", "replicas": replicas}])

    def seen(replicas: int) -> Observations:
        return Observations((GroupObservation("a", replicas, replicas),))

    first = decide(job(2), seen(2), None, 0.0, CATALOG)
    assert (
        first.groups["a"].replicas,
        first.groups["a"].replicas_reason,
        first.groups["a"].job_replicas,
    ) == (2, SG_REPLICAS, 2)
    scaled = decide(job(2), seen(4), restarted(first), 30.0, CATALOG)
    by_hand = (
        "scaled on the SamplerGroup (kubectl scale) to 4, not the last decision's 2: kept until the RLJob's "
        "samplerGroups[].replicas changes"
    )
    assert (scaled.groups["a"].replicas, scaled.groups["a"].replicas_reason) == (4, by_hand)
    kept = decide(job(2), seen(4), restarted(scaled), 60.0, CATALOG)
    assert (kept.groups["a"].replicas, kept.groups["a"].replicas_reason) == (4, by_hand)
    assert kept.status()["groups"][0]["jobReplicas"] == 2
    for observed in (4, 3):
        changed = decide(job(3), seen(observed), restarted(kept), 90.0, CATALOG)
        assert (
            changed.groups["a"].replicas,
            changed.groups["a"].replicas_reason,
            changed.groups["a"].job_replicas,
        ) == (3, "the RLJob's samplerGroups[].replicas changed: 2 -> 3", 3)
    after = decide(job(3), seen(3), changed, 120.0, CATALOG)
    assert (after.groups["a"].replicas, after.groups["a"].replicas_reason) == (3, SG_REPLICAS)


def test_replicas_before_the_first_decision_and_from_decisions_that_did_not_record_the_rljobs() -> None:
    """No decision yet: a group not at the RLJob's replicas was scaled by hand. Decisions written before
    `jobReplicas` existed (an upgraded operator): the group's own replicas stay, whatever the RLJob says."""
    job = rljob([{"name": "a", "accelerator": "h100", "replicas": 2}])
    first = decide(job, Observations((GroupObservation("a", 5, 5),)), None, 0.0, CATALOG)
    assert (first.groups["a"].replicas, first.groups["a"].replicas_reason) == (
        5,
        "scaled on the SamplerGroup (kubectl scale) to 5, not the RLJob's 2: kept until the RLJob's "
        "samplerGroups[].replicas changes",
    )
    older = first.status()
    for g in older["groups"]:
        del g["jobReplicas"]
        g["replicasReason"] = (
            "the SamplerGroup's spec.replicas (the RLJob's samplerGroups[].replicas, or a kubectl scale)"
        )
    upgraded = Decisions.from_status({"decisions": older})
    assert upgraded is not None and upgraded.groups["a"].job_replicas is None
    kept = decide(job, Observations((GroupObservation("a", 5, 5),)), upgraded, 30.0, CATALOG)
    assert (kept.groups["a"].replicas, kept.groups["a"].replicas_reason, kept.groups["a"].job_replicas) == (
        5,
        SG_REPLICAS,
        2,
    )


def test_the_rljobs_replica_changes_against_the_spec_kopf_last_handled() -> None:
    job = rljob(
        [
            {"name": "a", "accelerator": "h100", "replicas": 3},
            {"name": "b", "accelerator": "h100", "replicas": 1},
            {"name": "new", "accelerator": "h100", "replicas": 2},
        ]
    )
    old = {
        "samplerGroups": [
            {"name": "a", "replicas": 2},
            {"name": "b", "replicas": 1},
            {"name": "gone", "replicas": 4},
        ]
    }
    assert replicas_changed_in_rljob(old, job) == {"a": (2, 3)}  # b unchanged, new created, gone deleted
    assert replicas_changed_in_rljob(None, job) == {}  # created or resumed: nothing to compare


# --- quarantine --------------------------------------------------------------------------------------------


def test_each_quarantine_source_in_order_gives_share_0_and_names_itself() -> None:
    job = rljob(
        [
            {"name": "spec", "accelerator": "h100", "replicas": 1, "quarantined": True},
            {"name": "oncall", "accelerator": "h100", "replicas": 1},
            {"name": "collapse", "accelerator": "h100", "replicas": 1},
            {"name": "free", "accelerator": "h100", "replicas": 1},
        ]
    )
    seen = Observations(
        (
            GroupObservation("spec", 1, 1, annotation="true"),
            GroupObservation("oncall", 1, 1, annotation="true"),
            GroupObservation("collapse", 1, 1, annotation="false"),
            GroupObservation("free", 1, 1),
        ),
        collapse_quarantine=frozenset({"collapse"}),
    )
    decided = decide(job, seen, None, 0.0, CATALOG)
    assert {g: (d.quarantined, d.quarantine_reason) for g, d in decided.groups.items()} == {
        "spec": (True, "spec.quarantined"),  # the RLJob's, before the annotation
        "oncall": (True, "annotation rlfleet.dev/quarantined"),
        "collapse": (True, "the trainer's collapse detector"),  # "false" releases the autopilot's only
        "free": (False, ""),
    }
    assert decided.shares == {"spec": 0.0, "oncall": 0.0, "collapse": 0.0, "free": 1.0}
    assert decided.groups["spec"].share_reason == "quarantined" and decided.quarantined["free"] is False


# --- the precision autopilot ------------------------------------------------------------------------------

AUTOPILOT_GROUPS = [  # the 0-replica groups make the channel publish the fp8 and bf16 views
    {"name": "fast", "accelerator": "b200", "replicas": 1, "weightFormat": "nvfp4"},
    {"name": "spare-fp8", "accelerator": "b200", "replicas": 0, "weightFormat": "fp8"},
    {"name": "spare-bf16", "accelerator": "b200", "replicas": 0, "weightFormat": "bf16"},
]


def autopilot_job(fast_format: str = "nvfp4", **autopilot: object) -> RLJob:
    groups = [dict(AUTOPILOT_GROUPS[0], weightFormat=fast_format), *AUTOPILOT_GROUPS[1:]]
    return rljob(
        groups,
        {
            "autopilot": {"enabled": True, "patience": 1, **autopilot},
            "optimize": {"budgets": {"groupMaxKl": 0.01}},
        },
    )


def reading(kl: float, annotation: str | None = None, **trainer: float) -> Observations:
    return Observations(
        (
            GroupObservation(
                "fast", 1, 1, tokens_per_second=100.0, trainer={"kl_k3": kl, **trainer}, annotation=annotation
            ),
            GroupObservation("spare-fp8", 0, 0),
            GroupObservation("spare-bf16", 0, 0),
        )
    )


def run(
    job: RLJob, kls: list[float], previous: Decisions | None = None, start: float = 0.0
) -> list[Decisions]:
    """One decision per KL, 30 s apart, each from the one before it."""
    out = []
    for i, kl in enumerate(kls):
        previous = decide(job, reading(kl), previous, start + 30.0 * i, CATALOG)
        out.append(previous)
    return out


def test_the_autopilot_steps_up_holds_for_patience_steps_down_after_its_cool_down_and_doubles_it_on_a_breach() -> (
    None
):
    """Patience 1, cool-down 2 (bound 8): over (0.05 > 0.01) -> nvfp4 -> fp8; one decision not judged; two
    within -> fp8 -> nvfp4, the RLJob's own format (the floor), on probation; one not judged; over on
    probation -> nvfp4 -> fp8 with the cool-down doubled to 4."""
    job = autopilot_job(stepDown=True, cooldownIntervals=2, maxCooldownIntervals=8)
    decided = run(job, [0.05, 0.05, 0.004, 0.004, 0.004, 0.05])
    assert [d.groups["fast"].weight_format for d in decided] == ["fp8", "fp8", "fp8", "nvfp4", "nvfp4", "fp8"]
    up = "KL 0.05 > 0.01 for 1 intervals: weightFormat nvfp4 -> fp8"
    down = (
        "within its budget (KL 0.004 <= 0.01) for 2 intervals (the cool-down 2): weightFormat fp8 -> nvfp4; "
        "back to fp8 if over it again within the next 2 intervals, with the cool-down doubled"
    )
    doubled = (
        "KL 0.05 > 0.01 for 1 intervals after a step down: the cool-down doubles, 2 -> 4 intervals: "
        "weightFormat nvfp4 -> fp8"
    )
    assert [d.groups["fast"].weight_format_reason for d in decided] == [up, up, up, down, down, doubled]
    assert [[(a.kind, a.to_format) for a in d.actions] for d in decided] == [
        [("step", "fp8")],
        [],
        [],
        [("step-down", "nvfp4")],
        [],
        [("step", "fp8")],
    ]
    assert decided[-1].precision.cooldown == {"fast": 4} and decided[-1].precision_changes == {
        "fast": doubled
    }
    assert decided[3].precision.probation == {"fast"} and decided[-1].precision.probation == set()
    assert all(
        not d.groups["fast"].quarantined and d.groups["fast"].job_weight_format == "nvfp4" for d in decided
    )
    # the builders derive the SamplerGroup from it while the RLJob's format is the one decided under
    assert decided[-1].weight_formats(job) == {"fast": "fp8", "spare-fp8": "fp8", "spare-bf16": "bf16"}
    assert decided[-1].weight_formats(autopilot_job("fp8")) == {"spare-fp8": "fp8", "spare-bf16": "bf16"}


def test_at_the_top_the_autopilot_quarantine_is_held_until_on_call_releases_it_or_the_rljob_changes_the_format() -> (
    None
):
    job = autopilot_job("bf16")
    first = decide(job, reading(0.05), None, 0.0, CATALOG)
    fast = first.groups["fast"]
    held = (
        "KL 0.05 > 0.01 for 1 intervals, no step up from bf16 (the ladder nvfp4 -> fp8 -> bf16 within what b200 "
        "runs and the channel publishes: bf16, fp8): quarantined"
    )
    assert (fast.weight_format, fast.quarantined, fast.held_quarantine) == ("bf16", True, held)
    assert fast.quarantine_reason == f"the precision autopilot: {held}" and first.shares["fast"] == 0.0
    # held at the next decision, whatever the readings (the autopilot no longer judges it)
    kept = decide(job, reading(0.001), first, 30.0, CATALOG)
    assert (kept.groups["fast"].quarantined, kept.groups["fast"].held_quarantine) == (True, held)
    # on call: "false" releases it, and the autopilot leaves the group alone while it stays
    released = decide(job, reading(0.05, annotation="false"), kept, 60.0, CATALOG)
    assert (
        released.groups["fast"].quarantined,
        released.groups["fast"].held_quarantine,
        released.actions,
    ) == (False, None, ())
    assert released.shares["fast"] > 0.0
    again = decide(job, reading(0.05, annotation="false"), released, 90.0, CATALOG)
    assert (again.groups["fast"].quarantined, again.actions) == (False, ())
    # the annotation removed: judged again, and quarantined again
    judged = decide(job, reading(0.05), again, 120.0, CATALOG)
    assert judged.groups["fast"].held_quarantine == held
    # a new weightFormat in the RLJob ends the autopilot's quarantine and its format
    changed = decide(autopilot_job("fp8"), reading(0.001), judged, 150.0, CATALOG)
    fast = changed.groups["fast"]
    assert (fast.weight_format, fast.weight_format_reason, fast.quarantined, fast.held_quarantine) == (
        "fp8",
        RLJOB_FORMAT,
        False,
        None,
    )


def test_a_group_answering_invalid_tokens_is_quarantined_at_its_format() -> None:
    """Trained fraction 0.25: the invalid share 0.75 > 0.05, the top reason by count (40 tokens)."""
    job = autopilot_job()
    seen = reading(
        0.004,
        trained_fraction=0.25,
        invalid_reason_logprob_not_finite_or_positive=40.0,
        invalid_reason_sampled_token_not_in_support=8.0,
    )
    fast = decide(job, seen, None, 0.0, CATALOG).groups["fast"]
    assert (fast.weight_format, fast.quarantined) == ("nvfp4", True)
    assert fast.held_quarantine == (
        "invalid share 0.75 > 0.05 (top reason logprob_not_finite_or_positive: 40 tokens) "
        "for 1 intervals: quarantined (invalid answers are not a precision to step up from)"
    )


# --- the fleet-mix optimizer ---------------------------------------------------------------------------------


def test_the_optimizer_decides_replicas_and_shares_and_drains_the_spot_group_of_two_alike() -> None:
    """Two h100 fp8 groups of one GPU ($2.99/GPU-h), 1000 tok/s per replica each, one replica each; demand
    1000 usable tok/s: one replica is enough. (1, 1) costs $5.98/h, (1, 0) or (0, 1) $2.99/h: saving 50% >
    the 5% hysteresis. Of the two alike the spot group's replica goes ($2.99/h / 1000 tok/s = $0.8306 per
    1M usable tokens). The shares move toward the plan's 0 / 1, by at most 0.1."""
    job = rljob(
        [
            {"name": "spot", "accelerator": "h100", "weightFormat": "fp8", "replicas": 1, "spot": True},
            {"name": "steady", "accelerator": "h100", "weightFormat": "fp8", "replicas": 1},
        ],
        {
            "optimize": {
                "enabled": True,
                "demand": {"usableTokensPerSecond": 1000},
                "groups": {"spot": {"maxReplicas": 2}, "steady": {"maxReplicas": 2}},
            }
        },
    )
    seen = Observations(
        tuple(GroupObservation(g, 1, 1, tokens_per_second=1000.0) for g in ("spot", "steady"))
    )
    decided = decide(job, seen, None, 0.0, CATALOG)
    spot, steady = decided.groups["spot"], decided.groups["steady"]
    plan = (
        "the optimum saves 50.00% of $5.98/h (> hysteresis 5.00%); plan $2.99/h, $0.8306 per 1M usable tokens"
    )
    assert (spot.replicas, spot.replicas_reason) == (0, f"fleet plan (Scaled): {plan}")
    assert (steady.replicas, steady.replicas_reason) == (1, SG_REPLICAS)
    assert decided.plan is not None and decided.plan.changes() == {"spot": (1, 0)}
    assert (spot.share, steady.share) == (pytest.approx(0.4, rel=1e-12), pytest.approx(0.6, rel=1e-12))
    assert (spot.share_reason, steady.share_reason) == (
        "fleet plan 0.000; bounded toward 0.000",
        "fleet plan 1.000; bounded toward 1.000",
    )
    # each group's steady figure is remembered: 1000 tok/s per replica, read over 1 replica at fp8
    assert {g: f.tokens_per_second_per_replica for g, f in decided.fleet.steady.items()} == {
        "spot": 1000.0,
        "steady": 1000.0,
    }


def test_a_group_the_autopilot_just_moved_is_left_out_of_the_plan_while_it_settles() -> None:
    job = rljob(
        [
            {"name": "fast", "accelerator": "b200", "replicas": 1, "weightFormat": "nvfp4"},
            {"name": "spare", "accelerator": "b200", "replicas": 0, "weightFormat": "fp8"},
        ],
        {
            "autopilot": {"enabled": True, "patience": 1},
            "optimize": {
                "enabled": True,
                "demand": {"usableTokensPerSecond": 100},
                "budgets": {"groupMaxKl": 0.01},
            },
        },
    )
    seen = Observations(
        (
            GroupObservation("fast", 1, 1, tokens_per_second=100.0, trainer={"kl_k3": 0.05}),
            GroupObservation("spare", 0, 0),
        )
    )
    decided = decide(job, seen, None, 0.0, CATALOG)
    assert decided.groups["fast"].weight_format == "fp8" and decided.plan is not None
    assert (
        "fast keeps its replicas (precision autopilot: settling after a precision change)"
        in decided.plan.reason
    )


# --- a restart -------------------------------------------------------------------------------------------------


def test_decisions_read_back_from_status_give_the_same_next_decision_as_the_ones_in_memory() -> None:
    """At each step of the autopilot's round trip (up, settling, within, down on probation, a breach that
    doubles the cool-down) and with pods whose counters give the share policy its rates, a restarted
    operator's decisions (read from the status) equal the in-memory ones and decide the same next."""
    job = autopilot_job(stepDown=True, cooldownIntervals=2, maxCooldownIntervals=8)
    previous: Decisions | None = None
    for i, kl in enumerate([0.05, 0.05, 0.004, 0.004, 0.004, 0.05, 0.004]):
        # nothing waiting: the share policy counts empty-queue decisions (its only eligible group: share 1)
        pods = {
            "fast-0": PodSample(
                realtime_decode_tokens_total=1000.0 * i * i, gen_throughput=50.0, num_queue_reqs=0.0
            )
        }
        seen = Observations(
            (
                GroupObservation("fast", 1, 1, pods=pods, trainer={"kl_k3": kl}),
                GroupObservation("spare-fp8", 0, 0),
                GroupObservation("spare-bf16", 0, 0),
            ),
            weights_stored_bytes={"fp8": 1e9 * i},
        )
        in_memory = decide(job, seen, previous, 1000.0 + 30.0 * i, CATALOG)
        back = restarted(in_memory)
        assert back == in_memory
        assert decide(job, seen, back, 1030.0 + 30.0 * i, CATALOG) == decide(
            job, seen, in_memory, 1030.0 + 30.0 * i, CATALOG
        )
        previous = back
    assert previous is not None and previous.precision.cooldown == {"fast": 4}
    assert previous.state.groups["fast"].ema_tokens_per_second is not None
    assert previous.state.groups["fast"].empty_queue_intervals == 7
    # decisions written before the count existed read back with 0
    older = previous.status()
    for g in older["groups"]:
        del g["memory"]["emptyQueueIntervals"]
    upgraded = Decisions.from_status({"decisions": older})
    assert upgraded is not None and upgraded.state.groups["fast"].empty_queue_intervals == 0
    # the spec's router.demandLimitedIntervals (default 2) reaches the share policy
    assert job_config(job, CATALOG).demand_limited_intervals == 2
    three = rljob([{"name": "a", "accelerator": "h100"}], {"demandLimitedIntervals": 3})
    assert job_config(three, CATALOG).demand_limited_intervals == 3


def test_no_decisions_in_status_is_none() -> None:
    assert Decisions.from_status({}) is None and Decisions.from_status(None) is None


def test_the_optimizer_takes_a_group_read_with_its_queues_empty_as_a_lower_bound_over_a_restart() -> None:
    """One h100 fp8 replica whose pod's counters make 1000 tok/s over each 30 s interval with nothing
    queued: its figure is a lower bound (fleetplan.py), planned with its replica held; the flag goes into
    `status.decisions` and a restarted operator reads it back. A reading with requests queued makes the
    figure saturated; a figure written before the flag existed reads back as saturated (as it was used)."""
    job = rljob(
        [{"name": "a", "accelerator": "h100", "weightFormat": "fp8", "replicas": 1}],
        {
            "optimize": {
                "enabled": True,
                "demand": {"usableTokensPerSecond": 1000},
                "groups": {"a": {"maxReplicas": 3}},
            }
        },
    )

    def seen(i: int, queued: float) -> Observations:
        pods = {"a-0": PodSample(realtime_decode_tokens_total=30000.0 * i, num_queue_reqs=queued)}
        return Observations((GroupObservation("a", 1, 1, pods=pods),))

    previous: Decisions | None = None
    for i in range(3):
        in_memory = decide(job, seen(i, 0.0), previous, 1000.0 + 30.0 * i, CATALOG)
        previous = restarted(in_memory)
        assert previous == in_memory
    assert previous is not None
    steady = previous.fleet.steady["a"]
    assert (steady.tokens_per_second_per_replica, steady.saturated) == (1000.0, False)
    memory = next(g["memory"] for g in previous.status()["groups"] if g["name"] == "a")
    assert memory["steadyThroughput"]["saturated"] is False
    held = decide(job, seen(3, 0.0), previous, 1090.0, CATALOG)
    assert held.plan is not None and held.plan.figures["a"].basis == "lowerBound"
    assert "a keeps its 1 replica(s), planned at 1000 tokens/s per replica: a lower bound" in held.plan.reason
    queued = decide(job, seen(4, 2.0), held, 1120.0, CATALOG)
    assert queued.fleet.steady["a"].saturated and queued.plan is not None
    assert queued.plan.figures["a"].basis == "measured"
    older = held.status()
    for g in older["groups"]:
        del g["memory"]["steadyThroughput"]["saturated"]
    upgraded = Decisions.from_status({"decisions": older})
    assert upgraded is not None and upgraded.fleet.steady["a"].saturated
