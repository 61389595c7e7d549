"""A group answering invalid tokens, on the operator's side (issue 39 item 7): the trainer's per-group
`trained_fraction` and `invalid_reason_<reason>` metrics parsed from its exporter text, the usable fraction
(trained x in band) in the economics and the SamplerGroup status (`kubectl get sg` column Usable), and the
autopilot's quarantine at any format once the invalid share is over `maxInvalidFraction` for `patience`
intervals, with the share and the top reason in the reason. Pure functions, exact values."""

from __future__ import annotations

import copy

import pytest
from support.autopilot_readings import autopilot_reading
from support.manifests import rljob

from rlfleet.api import RLJob
from rlfleet.api.crdgen import generate
from rlfleet.catalog import load_catalog
from rlfleet.fleet import MeasuredGroup
from rlfleet.operator import autopilot, decide
from rlfleet.operator.autopilot import AutopilotMemory, AutopilotReading
from rlfleet.operator.group_status import samplergroup_status
from rlfleet.operator.rebalance import GroupInput, RebalanceConfig, parse_trainer_group_metrics, rebalance

VIEWS = ("bf16", "fp8", "nvfp4")
# the trainer's exporter (trainer/metrics.py PrometheusExporter) for one step: 40 of 48 tokens of the
# garbage group dropped, 8 trained; the good group's 50 all trained
EXPORTER_TEXT = """\
# HELP rlfleet_trainer_trained_fraction rlfleet trainer metric trained_fraction
# TYPE rlfleet_trainer_trained_fraction gauge
rlfleet_trainer_trained_fraction{key="bad",scope="group"} 0.16666666666666666
rlfleet_trainer_trained_fraction{key="good",scope="group"} 1.0
rlfleet_trainer_trained_fraction{key="",scope="fleet"} 0.5714285714285714
# HELP rlfleet_trainer_invalid_reason_logprob_not_finite_or_positive rlfleet trainer metric
# TYPE rlfleet_trainer_invalid_reason_logprob_not_finite_or_positive gauge
rlfleet_trainer_invalid_reason_logprob_not_finite_or_positive{key="bad",scope="group"} 24.0
# HELP rlfleet_trainer_invalid_reason_sampled_token_not_in_support rlfleet trainer metric
# TYPE rlfleet_trainer_invalid_reason_sampled_token_not_in_support gauge
rlfleet_trainer_invalid_reason_sampled_token_not_in_support{key="bad",scope="group"} 16.0
# HELP rlfleet_trainer_invalid_tokens rlfleet trainer metric invalid_tokens
# TYPE rlfleet_trainer_invalid_tokens gauge
rlfleet_trainer_invalid_tokens{key="bad",scope="group"} 0.0
# HELP rlfleet_trainer_oor_fraction rlfleet trainer metric oor_fraction
# TYPE rlfleet_trainer_oor_fraction gauge
rlfleet_trainer_oor_fraction{key="bad",scope="group"} 0.25
rlfleet_trainer_kl_k3{key="bad",scope="group"} 0.001
"""


def reading(trained: float | None, invalid: dict[str, float] | None = None, **kw) -> AutopilotReading:
    fields = {"name": "bad", "kl": 0.001, "max_invalid_fraction": 0.05, **kw}
    return autopilot_reading(trained_fraction=trained, invalid_tokens=invalid or {}, **fields)


def drive(readings: list[AutopilotReading], patience: int = 2) -> list[list[autopilot.AutopilotAction]]:
    memory, out = AutopilotMemory(), []
    for r in readings:
        actions, memory = autopilot.autopilot([r], memory, patience, VIEWS)
        out.append(actions)
    return out


def test_the_exporters_per_group_invalid_tokens_parse_into_the_groups_input() -> None:
    trainer = parse_trainer_group_metrics(EXPORTER_TEXT)
    # the objective's own `invalid_tokens` count is not a reason, and a 0 count is no reason either
    assert decide.invalid_tokens(trainer["bad"]) == {
        "logprob_not_finite_or_positive": 24.0,
        "sampled_token_not_in_support": 16.0,
    }
    job = RLJob.from_manifest(JOB)
    sg = {
        "metadata": {"name": "j-bad"},
        "spec": {"name": "bad", "accelerator": "b200", "replicas": 1},
        "status": {"readyReplicas": 1},
    }
    g = decide.group_input(job, sg, {}, trainer["bad"], 100.0)
    assert g.trained_fraction == 1 / 6 and dict(g.invalid_tokens) == decide.invalid_tokens(trainer["bad"])
    assert decide.group_input(job, sg, {}, {}, 100.0).trained_fraction is None  # no report: none


def test_an_invalid_share_over_the_bound_quarantines_at_any_format_without_a_step_up() -> None:
    invalid = {
        "logprob_not_finite_or_positive": 24.0,
        "sampled_token_not_in_support": 16.0,
        "support_empty": 24.0,
    }
    intervals = drive([reading(1 / 6, invalid)] * 2)
    assert intervals[0] == []  # patience 2: the first interval over only counts
    (action,) = intervals[1]
    assert (action.kind, action.from_format, action.to_format) == ("quarantine", "nvfp4", None)
    # 1 - 1/6, the top reason by count (a tie goes to the first by name)
    assert action.reason == (
        "invalid share 0.833333 > 0.05 (top reason logprob_not_finite_or_positive: 24 tokens) "
        "for 2 intervals: quarantined (invalid answers are not a precision to step up from)"
    )
    # over its KL budget too: still no step up (the invalid answers decide), and a group quarantined is not judged
    (both,) = drive([reading(0.5, {"weight_version_negative": 3.0}, kl=0.5)], patience=1)[0]
    assert both.kind == "quarantine" and both.reason.startswith(
        "invalid share 0.5 > 0.05 (top reason weight_version_negative: 3 tokens) for 1 intervals"
    )
    assert drive([reading(0.0, quarantined=True)] * 3, patience=1) == [[]] * 3


def test_within_the_bound_without_a_report_or_after_a_clean_interval_nothing_moves() -> None:
    assert (
        drive([reading(0.75, {"support_empty": 5.0}, max_invalid_fraction=0.25)] * 3, patience=1) == [[]] * 3
    )  # at the bound: within
    assert drive([reading(0.96, {"support_empty": 5.0})] * 3, patience=1) == [[]] * 3
    assert drive([reading(None)] * 3, patience=1) == [[]] * 3  # the trainer did not report the group
    # over, clean, over: the count restarts (patience 2)
    assert drive([reading(0.5), reading(1.0), reading(0.5)]) == [[], [], []]
    # the bound 1.0 never quarantines; 0.0 quarantines at the first invalid token
    assert drive([reading(0.0, max_invalid_fraction=1.0)], patience=1) == [[]]
    assert drive([reading(0.999, max_invalid_fraction=0.0)], patience=1)[0][0].kind == "quarantine"


def test_the_usable_fraction_counts_only_trained_tokens_in_band_in_the_economics_and_the_status() -> None:
    assert MeasuredGroup("g", "b200", "bf16", 1, 6.0, 100.0, 0.2, 0.5).usable_fraction == 0.5 * (1.0 - 0.2)
    assert (
        MeasuredGroup("g", "b200", "bf16", 1, 6.0, 100.0, 0.2).usable_fraction == 1.0 - 0.2
    )  # not reported: all
    config = RebalanceConfig(reference_accelerator="b200", min_share=0.0, max_share_change=1.0)
    half = GroupInput(
        "bad",
        1,
        1,
        6.0,
        accelerator="b200",
        tokens_per_second=1000.0,
        oor_fraction=0.2,
        kl=0.001,
        trained_fraction=0.5,
        invalid_tokens={"support_empty": 40.0, "logprob_not_finite_or_positive": 8.0},
    )
    whole = GroupInput(
        "good",
        1,
        1,
        6.0,
        accelerator="b200",
        tokens_per_second=1000.0,
        oor_fraction=0.2,
        kl=0.001,
        trained_fraction=1.0,
    )
    silent = GroupInput("new", 1, 1, 6.0, accelerator="b200", tokens_per_second=1000.0)
    result = rebalance([half, whole, silent], None, 0.0, config)
    bad, good = result.groups["bad"], result.groups["good"]
    assert bad.usable_fraction == 0.5 * (1.0 - 0.2) and good.usable_fraction == 1.0 - 0.2
    # half its tokens dropped: every usable token costs twice as much
    assert bad.cost_per_1m_useful_tokens == pytest.approx(2 * good.cost_per_1m_useful_tokens, rel=1e-12)
    patch = bad.status_patch()
    assert patch["usableFraction"] == 0.4
    assert patch["invalidTokens"] == {"logprob_not_finite_or_positive": 8, "support_empty": 40}
    assert "invalidTokens" not in good.status_patch() and good.status_patch()["usableFraction"] == 0.8
    assert "usableFraction" not in result.groups["new"].status_patch()  # no report: no measured figure
    # an exporter naming more reasons than the status holds: the most frequent 16, never a refused status
    many = {f"reason_{i:02d}": float(i) for i in range(40)}
    flood = rebalance(
        [GroupInput("bad", 1, 1, 6.0, trained_fraction=0.0, invalid_tokens=many)], None, 0.0, config
    )
    assert flood.groups["bad"].status_patch()["invalidTokens"] == {
        f"reason_{i:02d}": i for i in range(24, 40)
    }
    sg = {
        "apiVersion": "rlfleet.dev/v1alpha1",
        "kind": "SamplerGroup",
        "metadata": {"name": "j-bad", "generation": 1},
        "spec": {
            "name": "bad",
            "accelerator": "b200",
            "weightFormat": "bf16",
            "replicas": 1,
            "model": {"name": "m", "path": "p"},
            "weightChannel": "j-weights",
        },
    }
    status = samplergroup_status(sg, None, load_catalog(None), rebalance=patch)
    assert (status["usableFraction"], status["invalidTokens"]) == (0.4, patch["invalidTokens"])
    kept = samplergroup_status({**sg, "status": status}, None, load_catalog(None), rebalance=None)
    assert (kept["usableFraction"], kept["invalidTokens"]) == (
        0.4,
        patch["invalidTokens"],
    )  # not rebalanced yet


def test_kubectl_get_sg_shows_usable_and_the_bound_is_the_autopilots_with_a_one_line_error() -> None:
    (crd,) = [c for c in generate().values() if c["spec"]["names"]["kind"] == "SamplerGroup"]
    columns = {c["name"]: c for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Usable"]["jsonPath"] == ".status.usableFraction" and "priority" not in columns["Usable"]
    assert RLJob.from_manifest(JOB).spec.router.autopilot.max_invalid_fraction == 0.05
    bad = copy.deepcopy(JOB)
    bad["spec"]["router"]["autopilot"]["maxInvalidFraction"] = 1.5
    with pytest.raises(ValueError, match="maxInvalidFraction") as info:
        RLJob.from_manifest(bad)
    assert "less than or equal to 1" in str(info.value)


JOB = rljob(
    "j",
    [
        {"name": "bad", "accelerator": "b200", "replicas": 1, "weightFormat": "nvfp4"},
        {"name": "good", "accelerator": "b200", "replicas": 1},
    ],
    "ns",
    router={"autopilot": {"enabled": True, "patience": 2}},
)
