"""The pure trainer-report -> RLJob status / quarantine function (operator/trainer_report.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.api.rljob_status import RLJobStatus
from rlfleet.operator import status as ops
from rlfleet.operator.job_status import rljob_status
from rlfleet.operator.trainer_report import (
    CollapseSignal,
    TrainerReport,
    parse_trainer_report,
    trainer_job_status,
)

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"
GROUPS = ["h100-bf16", "b200-nvfp4", "h200-fp8"]

EXPORT = """# HELP rlfleet_trainer_step rlfleet trainer metric step
# TYPE rlfleet_trainer_step gauge
rlfleet_trainer_step{key="",scope="fleet"} 12.0
rlfleet_trainer_weight_version{key="",scope="fleet"} 11.0
rlfleet_trainer_reward_mean{key="",scope="fleet"} 0.42
rlfleet_trainer_kl_k3{key="",scope="fleet"} 0.031
rlfleet_trainer_kl_k3{key="b200-nvfp4",scope="group"} 0.2
rlfleet_trainer_oor_fraction{key="",scope="fleet"} 0.07
rlfleet_trainer_entropy{key="",scope="fleet"} 1.5
rlfleet_trainer_sc_tail_ratio{key="",scope="fleet"} 6.5
rlfleet_trainer_collapse_risk{group="b200-nvfp4",signal="kl_surge"} 1.0
rlfleet_trainer_collapse_risk{group="",signal="reward_cliff"} 0.0
rlfleet_trainer_collapse_value{group="b200-nvfp4",signal="kl_surge"} 0.2
rlfleet_trainer_collapse_baseline{group="b200-nvfp4",signal="kl_surge"} 0.01
rlfleet_trainer_quarantine_requested{group="b200-nvfp4"} 1.0
rlfleet_trainer_quarantine_requested{group="not-in-this-job"} 1.0
rlfleet_trainer_pause_requested 0.0
"""


def job(action: str = "quarantine-group", status: dict | None = None, generation: int = 3) -> dict:
    return {
        "apiVersion": "rlfleet.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "j", "namespace": "ns", "generation": generation},
        "spec": {"samplerGroups": [{"name": g} for g in GROUPS], "safety": {"action": action}},
        "status": status or {},
    }


def risk_of(status: dict) -> dict:
    return next(c for c in status["conditions"] if c["type"] == "CollapseRisk")


def test_parse_and_status_from_a_collapsing_trainer() -> None:
    report = parse_trainer_report(EXPORT)
    assert (report.step, report.weight_version) == (12, 11)
    assert report.signals == (CollapseSignal("kl_surge", "b200-nvfp4", 0.2, 0.01),)  # reward_cliff reads 0
    out = trainer_job_status(job(), [], report, T0)
    assert out.status["step"] == 12 and out.status["weightVersion"] == 11
    assert out.status["metrics"] == {
        "reward": 0.42,
        "kl": 0.031,
        "oorFraction": 0.07,
        "entropy": 1.5,
        "scTailRatio": 6.5,
        "updatedAt": T0,
    }
    risk = risk_of(out.status)
    assert (risk["status"], risk["reason"], risk["observedGeneration"]) == ("True", "KlSurge", 3)
    assert "kl_surge (group b200-nvfp4): 0.2 vs baseline 0.01" in risk["message"]
    assert out.quarantine == {"b200-nvfp4"}  # a group not in the job is ignored
    assert out.risk and out.risk_changed
    RLJobStatus.model_validate(out.status)  # a valid status of the CRD's schema


def test_alert_and_pause_never_quarantine_and_pause_is_reported() -> None:
    report = parse_trainer_report(
        EXPORT.replace("rlfleet_trainer_pause_requested 0.0", "rlfleet_trainer_pause_requested 1")
    )
    assert trainer_job_status(job("alert"), [], report, T0).quarantine == frozenset()
    out = trainer_job_status(job("pause"), [], report, T0)
    assert out.quarantine == frozenset() and risk_of(out.status)["reason"] == "TrainingPaused"
    assert "spec" not in out.status  # the status only; the RLJob spec is never written


def test_unchanged_report_is_a_no_op_and_transitions_keep_times() -> None:
    report = parse_trainer_report(EXPORT)
    first = trainer_job_status(job(), [], report, T0)
    again = trainer_job_status(job(status=first.status), [], report, T1)
    assert not ops.status_changed(first.status, again.status) and not again.risk_changed
    assert again.status["metrics"]["updatedAt"] == T0 and risk_of(again.status)["lastTransitionTime"] == T0
    calm = trainer_job_status(job(status=first.status), [], TrainerReport(step=13, fleet={"kl_k3": 0.01}), T1)
    risk = risk_of(calm.status)
    assert (risk["status"], risk["reason"], risk["lastTransitionTime"]) == ("False", "NoSignal", T1)
    assert calm.risk_changed and calm.status["metrics"] == {"kl": 0.01, "updatedAt": T1}
    # the trainer unreadable: the last reported values are re-sent (one apply owns them), nothing invented
    gone = trainer_job_status(job(status=calm.status), [], None, T1)
    assert gone.status["step"] == 13 and gone.status["metrics"] == calm.status["metrics"]
    assert not gone.risk_changed and gone.quarantine == frozenset()


def test_group_collapse_risk_rolls_up_without_a_trainer() -> None:
    sg = {
        "spec": {"name": "h200-fp8"},
        "status": {"conditions": [{"type": "CollapseRisk", "status": "True", "message": "oor share 0.4"}]},
    }
    out = trainer_job_status(job(), [sg], None, T0)
    risk = risk_of(out.status)
    assert (risk["status"], risk["reason"]) == (
        "True",
        "GroupCollapseRisk",
    ) and "h200-fp8: oor share 0.4" in risk["message"]
    assert "step" not in out.status and "metrics" not in out.status


signals = st.lists(
    st.builds(
        CollapseSignal,
        st.sampled_from(["kl_surge", "reward_cliff", "rho_blowup"]),
        st.sampled_from(["", *GROUPS, "other"]),
    ),
    max_size=4,
    unique=True,
)


@settings(max_examples=80, deadline=None)
@given(
    action=st.sampled_from(["alert", "quarantine-group", "pause"]),
    sigs=signals,
    requested=st.lists(st.sampled_from([*GROUPS, "other"]), unique=True),
    pause=st.booleans(),
    version=st.integers(0, 50),
    observed_version=st.integers(0, 50),
    was_risky=st.booleans(),
)
def test_invariants(action, sigs, requested, pause, version, observed_version, was_risky) -> None:
    old = {
        "weightVersion": observed_version,
        "conditions": [
            {"type": "CollapseRisk", "status": "True" if was_risky else "False", "lastTransitionTime": T0}
        ],
    }
    report = TrainerReport(
        step=version,
        weight_version=version,
        signals=tuple(sigs),
        quarantine_requested=tuple(sorted(requested)),
        pause_requested=pause,
    )
    out = trainer_job_status(job(action, status=old), [], report, T1)
    # quarantine only with quarantine-group, only groups of this job, exactly those the trainer asked for
    assert out.quarantine == (set(requested) & set(GROUPS) if action == "quarantine-group" else set())
    # risk iff the trainer raised a signal or paused; an Event exactly on a transition
    assert out.risk == (bool(sigs) or pause) and out.risk_changed == (out.risk != was_risky)
    risk = risk_of(out.status)
    assert risk["lastTransitionTime"] == (T1 if out.risk_changed else T0)
    assert risk["observedGeneration"] == 3
    # weightVersion never goes backwards (the WeightChannel status is the other writer)
    assert out.status["weightVersion"] == max(version, observed_version)
    RLJobStatus.model_validate(out.status)


def test_a_finished_run_reads_succeeded_and_stays_so_while_the_trainer_is_unreadable() -> None:
    """The trainer's own exporter (rlfleet.trainer.metrics, as a restarted finished trainer exports it)
    -> Complete=True -> the RLJob's phase Succeeded; an unreadable trainer keeps it; no finished gauge,
    no Complete condition."""
    import urllib.request

    from rlfleet.trainer.metrics import PrometheusExporter

    exporter = PrometheusExporter(port=0)
    try:
        exporter.update(50, {"reward_mean": 0.5, "weight_version": 50})
        exporter.update_finished()
        text = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10).read().decode()
    finally:
        exporter.close()
    report = parse_trainer_report(text)
    assert (report.finished, report.step) == (True, 50)
    out = trainer_job_status(job(), [], report, T0)
    [complete] = [c for c in out.status["conditions"] if c["type"] == "Complete"]
    assert (complete["status"], complete["reason"], complete["message"]) == (
        "True",
        "TrainingFinished",
        "training finished at step 50",
    )
    RLJobStatus.model_validate(out.status)
    trainer = {"status": {"readyReplicas": 1}}
    s = rljob_status(job(), [], trainer, None, now=T0, trainer_report=out.status)
    assert (s["phase"], s["reason"]) == ("Succeeded", "TrainingFinished") and "step 50" in s["message"]
    assert s["step"] == 50
    unreadable = trainer_job_status(job(status=s), [], None, T1)  # the trainer pod restarting, say
    assert [c for c in unreadable.status["conditions"] if c["type"] == "Complete"] == [complete]
    running = trainer_job_status(job(), [], parse_trainer_report(EXPORT), T0)
    assert [c["type"] for c in running.status["conditions"]] == ["CollapseRisk"]
    s = rljob_status(job(), [], trainer, None, now=T0, trainer_report=running.status)
    assert s["phase"] != "Succeeded"
