"""The precision autopilot (operator/autopilot.py): a group whose reported mismatch is made worse moves up
nvfp4 -> fp8 -> bf16 after `patience` intervals over its budget, waits `patience` intervals after each move,
and is quarantined at the top; the ladder within what its class runs and the channel publishes; the
RLJob's weightFormat kept as the SamplerGroup's override until the RLJob changes it (operator/builders.py);
the RLJob block."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from support.autopilot_readings import autopilot_reading
from support.manifests import rljob

from rlfleet.api import RLJob
from rlfleet.catalog import load_catalog
from rlfleet.operator import autopilot, builders
from rlfleet.operator.autopilot import AutopilotAction, AutopilotMemory, AutopilotReading, StepDown
from rlfleet.operator.decide import Decisions, GroupDecision

ALL_VIEWS = ("bf16", "fp8", "nvfp4")


def reading(weight_format: str, kl: float | None, oor: float | None = None, **kw) -> AutopilotReading:
    return autopilot_reading(weight_format=weight_format, kl=kl, oor_fraction=oor, **kw)


def drive(
    kls: list[float | None], patience: int = 2, views=ALL_VIEWS, step_down: StepDown | None = None, **kw
) -> list[list[AutopilotAction]]:
    """Interval by interval: the group's KL as the trainer reports it, its weightFormat following each step."""
    memory, weight_format, quarantined, out = AutopilotMemory(), kw.pop("weight_format", "nvfp4"), False, []
    for kl in kls:
        actions, memory = autopilot.autopilot(
            [reading(weight_format, kl, quarantined=quarantined, **kw)],
            memory,
            patience,
            views,
            None,
            step_down,
        )
        for a in actions:
            weight_format = a.to_format or weight_format
            quarantined = quarantined or a.kind == "quarantine"
        out.append(actions)
    return out


def test_a_group_made_worse_steps_up_the_ladder_with_hysteresis_then_is_quarantined() -> None:
    ok, bad = 0.005, 0.02
    intervals = drive([ok, bad, ok, bad, bad, bad, bad, bad, bad, bad, bad, bad, bad])
    moves = [(i, a.kind, a.from_format, a.to_format) for i, actions in enumerate(intervals) for a in actions]
    # interval 1 over, 2 back within (the count restarts), 3 and 4 over: nvfp4 -> fp8; 5 and 6 not judged
    # (patience 2 after a move); 7 and 8 over: fp8 -> bf16; 9, 10 wait; 11, 12 over at bf16: quarantined
    assert moves == [
        (4, "step", "nvfp4", "fp8"),
        (8, "step", "fp8", "bf16"),
        (12, "quarantine", "bf16", None),
    ]
    step, top = intervals[4][0], intervals[12][0]
    assert step.reason == "KL 0.02 > 0.01 for 2 intervals: weightFormat nvfp4 -> fp8"
    assert top.reason == (
        "KL 0.02 > 0.01 for 2 intervals, no step up from bf16 (the ladder nvfp4 -> fp8 -> bf16 "
        "within what b200 runs and the channel publishes: bf16, fp8, nvfp4): quarantined"
    )
    # quarantined: never judged again
    assert drive([bad] * 6, patience=1, weight_format="bf16")[1:] == [[]] * 5


def test_the_out_of_range_share_crosses_its_budget_too_and_no_budget_or_report_never_moves() -> None:
    (action,) = drive([0.0], patience=1, oor=0.25)[0]
    assert action.reason == "out-of-range share 0.25 > 0.2 for 1 intervals: weightFormat nvfp4 -> fp8"
    assert drive([0.5] * 4, patience=1, max_kl=None, max_oor_fraction=None) == [[]] * 4
    memory = AutopilotMemory()
    for _ in range(3):  # no trainer report yet
        actions, memory = autopilot.autopilot([reading("nvfp4", None)], memory, 1, ALL_VIEWS)
        assert actions == []


def moves(intervals: list[list[AutopilotAction]]) -> list[tuple[int, str, str, str | None]]:
    return [(i, a.kind, a.from_format, a.to_format) for i, actions in enumerate(intervals) for a in actions]


def test_a_group_steps_back_down_after_a_cool_down_and_each_breach_on_probation_doubles_it_to_its_bound() -> (
    None
):
    """Patience 1 (one interval not judged after each move), cool-down 3, bound 8, floor nvfp4 (the
    RLJob's own format). By hand, interval by interval:
    0 over: nvfp4 -> fp8; 1 settling; 2, 3, 4 within: the cool-down 3 is over, fp8 -> nvfp4 (probation);
    5 settling; 6 within; 7 over on probation: nvfp4 -> fp8, cool-down 3 -> 6; 8 settling; 9-14 within (6):
    fp8 -> nvfp4; 15 settling; 16 over on probation: -> fp8, cool-down 6 -> 12, bounded to 8; 17 settling;
    18-25 within (8): -> nvfp4; 26 settling; 27-34 within (8): the probation passes (cool-down back to 3),
    no step below the floor; 35 over (not on probation): -> fp8, cool-down stays 3; 36 settling; 37, 38
    no report (not judged, the count holds); 39, 40, 41 within: -> nvfp4."""
    ok, bad = 0.005, 0.02
    kls: list[float | None] = [
        bad,
        ok,
        ok,
        ok,
        ok,
        ok,
        ok,
        bad,
        ok,
        *[ok] * 6,
        ok,
        bad,
        ok,
        *[ok] * 8,
        ok,
        *[ok] * 8,
        bad,
        ok,
        None,
        None,
        ok,
        ok,
        ok,
    ]
    intervals = drive(kls, patience=1, step_down=StepDown(cooldown=3, max_cooldown=8), floor_format="nvfp4")
    assert moves(intervals) == [
        (0, "step", "nvfp4", "fp8"),
        (4, "step-down", "fp8", "nvfp4"),
        (7, "step", "nvfp4", "fp8"),
        (14, "step-down", "fp8", "nvfp4"),
        (16, "step", "nvfp4", "fp8"),
        (25, "step-down", "fp8", "nvfp4"),
        (35, "step", "nvfp4", "fp8"),
        (41, "step-down", "fp8", "nvfp4"),
    ]
    reasons = [a.reason for actions in intervals for a in actions]
    assert reasons == [
        "KL 0.02 > 0.01 for 1 intervals: weightFormat nvfp4 -> fp8",
        "within its budget (KL 0.005 <= 0.01) for 3 intervals (the cool-down 3): weightFormat fp8 -> nvfp4; back to "
        "fp8 if over it again within the next 3 intervals, with the cool-down doubled",
        "KL 0.02 > 0.01 for 1 intervals after a step down: the cool-down doubles, 3 -> 6 intervals: weightFormat "
        "nvfp4 -> fp8",
        "within its budget (KL 0.005 <= 0.01) for 6 intervals (the cool-down 6): weightFormat fp8 -> nvfp4; back to "
        "fp8 if over it again within the next 6 intervals, with the cool-down doubled",
        "KL 0.02 > 0.01 for 1 intervals after a step down: the cool-down doubles, 6 -> 8 intervals (its bound): "
        "weightFormat nvfp4 -> fp8",
        "within its budget (KL 0.005 <= 0.01) for 8 intervals (the cool-down 8): weightFormat fp8 -> nvfp4; back to "
        "fp8 if over it again within the next 8 intervals, with the cool-down doubled",
        "KL 0.02 > 0.01 for 1 intervals: weightFormat nvfp4 -> fp8",
        "within its budget (KL 0.005 <= 0.01) for 3 intervals (the cool-down 3): weightFormat fp8 -> nvfp4; back to "
        "fp8 if over it again within the next 3 intervals, with the cool-down doubled",
    ]


def test_a_step_down_stops_at_the_rljobs_format_and_never_without_step_down_or_a_floor() -> None:
    ok, bad = 0.005, 0.02
    # the RLJob says fp8: up to bf16, back to fp8 after the cool-down, never to nvfp4
    intervals = drive(
        [bad, ok, ok, ok, ok, ok, ok, ok, ok, ok],
        patience=1,
        step_down=StepDown(2, 4),
        weight_format="fp8",
        floor_format="fp8",
    )
    assert moves(intervals) == [(0, "step", "fp8", "bf16"), (3, "step-down", "bf16", "fp8")]
    # step down off, or no floor known: only up
    assert moves(drive([bad] + [ok] * 8, patience=1, floor_format="nvfp4")) == [(0, "step", "nvfp4", "fp8")]
    assert moves(drive([bad] + [ok] * 8, patience=1, step_down=StepDown(2, 4))) == [
        (0, "step", "nvfp4", "fp8")
    ]
    # the next cheaper format within what the channel publishes and the class runs, never below the floor
    assert autopilot.cheaper_format("b200", "bf16", "nvfp4", "auto", ALL_VIEWS) == "fp8"
    assert autopilot.cheaper_format("b200", "bf16", "nvfp4", "auto", ["nvfp4", "bf16"]) == "nvfp4"
    assert autopilot.cheaper_format("b200", "fp8", "fp8", "auto", ALL_VIEWS) is None
    assert autopilot.cheaper_format("b200", "bf16", "mxfp4", "auto", ALL_VIEWS) is None  # off the ladder


def test_the_ladder_is_what_the_class_runs_and_the_channel_publishes(tmp_path: Path) -> None:
    # the channel publishes only the views the job's groups name: no fp8 group, nvfp4 goes to bf16
    assert autopilot.next_format("b200", "nvfp4", "auto", ["nvfp4", "bf16"]) == "bf16"
    assert autopilot.next_format("b200", "nvfp4", "auto", ["nvfp4"]) is None
    assert autopilot.next_format("b200", "mxfp4", "auto", ALL_VIEWS) is None  # off the ladder
    assert autopilot.next_format("b200", "bf16", "auto", ALL_VIEWS) is None
    # a class without fp8 (a catalog override) skips it
    path = tmp_path / "catalog.yaml"
    path.write_text("classes:\n  b200:\n    weightFormats: {fp8: null}\n")
    assert autopilot.next_format("b200", "nvfp4", "auto", ALL_VIEWS, load_catalog(path)) == "bf16"
    ((action,),) = drive([0.02], patience=1, views=("nvfp4",))
    assert (action.kind, action.to_format) == ("quarantine", None)


JOB = rljob(
    "j",
    [
        {"name": "b200-nvfp4", "accelerator": "b200", "replicas": 2, "weightFormat": "nvfp4"},
        {"name": "b200-bf16", "accelerator": "b200", "replicas": 0},
    ],
    "ns",
    router={
        "autopilot": {"enabled": True, "patience": 2},
        "optimize": {
            "budgets": {"groupMaxKl": 0.01},
            "groups": {"b200-bf16": {"maxReplicas": 0, "maxKl": 0.5}},
        },
    },
)


def test_the_budgets_are_the_optimizers_and_the_block_is_off_by_default() -> None:
    job = RLJob.from_manifest(JOB)
    assert autopilot.group_budgets(job.spec.router.optimize, "b200-nvfp4") == (0.01, None)
    assert autopilot.group_budgets(job.spec.router.optimize, "b200-bf16") == (0.5, None)
    plain = copy.deepcopy(JOB)
    del plain["spec"]["router"]
    spec = RLJob.from_manifest(plain).spec.router.autopilot
    assert (
        spec.enabled,
        spec.patience,
        spec.step_down,
        spec.cooldown_intervals,
        spec.max_cooldown_intervals,
    ) == (False, 3, True, 20, 320)
    bad = copy.deepcopy(JOB)
    bad["spec"]["router"]["autopilot"].update(cooldownIntervals=50, maxCooldownIntervals=40)
    with pytest.raises(
        ValueError, match=r"cooldownIntervals must be <= maxCooldownIntervals \(got 50 > 40\)"
    ):
        RLJob.from_manifest(bad)


def test_the_samplergroup_is_built_with_the_decided_weight_format_until_the_rljob_changes_its_own() -> None:
    job = RLJob.from_manifest(JOB)
    group = job.spec.sampler_groups[0]
    fresh = builders.build_samplergroup(job, group, "ns", None)
    assert (
        fresh["spec"]["weightFormat"] == "nvfp4" and "replicas" not in fresh["spec"]
    )  # replicas only to create it
    assert (
        builders.build_samplergroup(job, group, "ns", None, weight_format="fp8")["spec"]["weightFormat"]
        == "fp8"
    )
    stepped = Decisions(
        0.0, {group.name: GroupDecision(group.name, 2, "", "fp8", "stepped", 1.0, "", False, "", "nvfp4")}
    )
    assert stepped.weight_formats(job) == {group.name: "fp8"}
    changed = copy.deepcopy(JOB)
    changed["spec"]["samplerGroups"][0]["weightFormat"] = "bf16"  # the RLJob's own value changed: it wins
    job2 = RLJob.from_manifest(changed)
    assert stepped.weight_formats(job2) == {}
    children = builders.build_job_children(
        job2, "ns", None, load_catalog(None), weight_formats=stepped.weight_formats(job2)
    )
    assert next(c for c in children if c["kind"] == "SamplerGroup")["spec"]["weightFormat"] == "bf16"


@pytest.mark.parametrize("patience", [0, 1001])
def test_patience_is_bounded(patience: int) -> None:
    bad = copy.deepcopy(JOB)
    bad["spec"]["router"]["autopilot"]["patience"] = patience
    with pytest.raises(ValueError, match="patience"):
        RLJob.from_manifest(bad)
