"""The local report's row per sampler group (issue 39 item 7): the tokens each group sampled, trained on
and dropped as invalid over the run, its trained fraction and its invalid tokens by validation reason,
summed exactly from the steps' metrics (trainer/metrics.py `invalid_token_metrics`); the trained-fraction
plot; the line the end of a run prints for a group that answered invalid tokens; the economics' usable
fraction counting only trained tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlfleet.local.main import _print_summary, step_economics
from rlfleet.local.report import build_figures, group_tokens, write_report

STEPS: list[dict[str, Any]] = [
    {"step": 1.0, "trained_fraction": 0.75, "group/good/sampled_tokens": 30.0, "group/good/num_tokens": 30.0,
     "group/good/dropped_invalid_tokens": 0.0, "group/good/trained_fraction": 1.0,
     "group/bad/sampled_tokens": 10.0, "group/bad/num_tokens": 0.0, "group/bad/dropped_invalid_tokens": 10.0,
     "group/bad/trained_fraction": 0.0, "group/bad/invalid_reason_logprob_not_finite_or_positive": 6.0,
     "group/bad/invalid_reason_sampled_token_not_in_support": 4.0, "group/bad/invalid_tokens": 0.0},
    {"step": 2.0, "trained_fraction": 0.9, "group/good/sampled_tokens": 20.0, "group/good/num_tokens": 20.0,
     "group/good/dropped_invalid_tokens": 0.0, "group/good/trained_fraction": 1.0,
     "group/bad/sampled_tokens": 12.0, "group/bad/num_tokens": 9.0, "group/bad/dropped_invalid_tokens": 3.0,
     "group/bad/trained_fraction": 0.75, "group/bad/invalid_reason_logprob_not_finite_or_positive": 3.0},
]  # fmt: skip


def test_each_group_gets_its_run_totals_and_invalid_reasons() -> None:
    rows = group_tokens(STEPS)
    assert rows == {
        "good": {
            "sampled_tokens": 50,
            "trained_tokens": 50,
            "dropped_invalid_tokens": 0,
            "invalid_tokens": {},
            "trained_fraction": 1.0,
        },
        "bad": {
            "sampled_tokens": 22,
            "trained_tokens": 9,
            "dropped_invalid_tokens": 13,
            "invalid_tokens": {"logprob_not_finite_or_positive": 9, "sampled_token_not_in_support": 4},
            "trained_fraction": 9 / 22,
        },
    }
    assert group_tokens([{"step": 1.0, "kl_k3": 0.1}]) == {}  # a run before this metric: no rows


def test_the_report_holds_the_rows_and_draws_the_trained_fraction(
    tmp_path: Path, capsys, example_run
) -> None:
    ((name, fig),) = [(n, f) for n, f in build_figures(STEPS) if n == "trained.png"]
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["fleet", "bad", "good"]
    summary = {"groups": group_tokens(STEPS), "collapse_alerts": []}
    write_report(STEPS, tmp_path / "report", summary)
    assert (tmp_path / "report" / "trained.png").is_file()
    assert (
        json.loads((tmp_path / "report" / "metrics.json").read_text())["summary"]["groups"]["bad"][
            "dropped_invalid_tokens"
        ]
        == 13
    )
    rc = example_run(groups=[("good", "bf16"), ("bad", "bf16")])
    _print_summary(
        rc,
        {
            **summary,
            "reward_first": 0.1,
            "reward_last": 0.2,
            "summary_window_steps": 1,
            "steps": 2,
            "seconds": 3.0,
            "entropy_first": None,
        },
        tmp_path,
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [
        "group bad: 13 of its 22 sampled tokens dropped as invalid, 40.9% trained on "
        "(top reason logprob_not_finite_or_positive: 9 tokens)"
    ]


def test_the_usable_fraction_of_the_economics_counts_only_trained_tokens(example_run) -> None:
    rc = example_run(groups=[("good", "bf16"), ("bad", "bf16")])
    m = {
        "group/good/tokens_per_second": 100.0,
        "group/good/oor_fraction": 0.2,
        "group/good/trained_fraction": 1.0,
        "group/bad/tokens_per_second": 100.0,
        "group/bad/oor_fraction": 0.2,
        "group/bad/trained_fraction": 0.5,
    }
    figures = step_economics(rc, m)
    assert figures["group/good/usable_fraction"] == 1.0 - 0.2
    assert figures["group/bad/usable_fraction"] == 0.5 * (1.0 - 0.2)
    assert figures["usable_fraction"] == (100 * 0.8 + 100 * 0.4) / 200
