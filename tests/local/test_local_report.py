"""Report plots (rlfleet/local/report.py): axis labels on every plot and one vertical marker per collapse
alert, checked on the real matplotlib Figure objects (not by eye); the written report draws the
alerts the run summary carries; a plot whose metrics a run does not produce is not written (no empty
plots), and the task plot shows the task's success and malformed turns beside the shaped reward."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.pyplot as plt

from rlfleet.local.report import ALERT_GID, PLOTS, build_figures, write_report
from rlfleet.trainer.collapse import Alert

ROWS = [
    {
        "step": float(s),
        "reward_mean": 0.1 * s,
        "kl_k3": 0.01 * s,
        "group/h100-fp8/kl_k3": 0.02 * s,
        "grad_norm": 1.0 + s,
        "entropy": 2.0 - 0.1 * s,
    }  # fmt: skip
    for s in range(1, 9)
]


def _markers(fig) -> list:
    return [line for line in fig.axes[0].get_lines() if line.get_gid() == ALERT_GID]


def test_every_plot_has_axis_labels_and_one_marker_per_alert() -> None:
    alerts = [Alert(3, "kl_surge", 0.5, 0.1, group="h100-fp8"), Alert(6, "reward_cliff", 0.1, 0.6),
              {"step": 7, "signal": "rho_blowup", "value": 60.0, "baseline": 50.0, "group": None}]  # fmt: skip
    figures = build_figures(ROWS, alerts)
    try:
        # ROWS have no oor_fraction and no sc_tail_ratio: those plots are left out, not drawn empty
        assert [name for name, _ in figures] == ["reward.png", "task.png", "kl.png", "entropy.png", "grad_norm.png"]
        ylabels = {p.file: p.ylabel for p in PLOTS}
        for name, fig in figures:
            ax = fig.axes[0]
            assert ax.get_xlabel() == "step"
            assert ax.get_ylabel() == ylabels[name] and ylabels[name]
            marks = _markers(fig)
            assert len(marks) == 3  # one per alert
            assert [float(m.get_xdata()[0]) for m in marks] == [3.0, 6.0, 7.0]
            assert all(m.get_xdata()[0] == m.get_xdata()[1] for m in marks)  # vertical
            texts = [t.get_text() for t in ax.texts]
            assert "kl_surge (h100-fp8)" in texts and "reward_cliff" in texts
            assert [t.get_text() for t in ax.get_legend().get_texts()].count("collapse alert") == 1
        kl = dict(figures)["kl.png"].axes[0]
        assert sorted(line.get_label() for line in kl.get_lines() if line.get_gid() != ALERT_GID) == [
            "fleet",
            "h100-fp8",
        ]
    finally:
        for _, fig in figures:
            plt.close(fig)


def test_task_plot_draws_success_and_malformed_turns_beside_the_reward() -> None:
    rows = [{"step": 1.0, "reward_mean": 0.3, "success_rate": 0.0, "format_error_rate": 1.0},
            {"step": 2.0, "reward_mean": 0.4, "success_rate": 0.25, "format_error_rate": 0.5},
            {"step": 3.0, "reward_mean": 0.5, "format_error_rate": 0.25}]  # fmt: skip
    figures = build_figures(rows)
    try:
        ax = dict(figures)["task.png"].axes[0]
        lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
        assert lines == {
            "reward_mean": ([1.0, 2.0, 3.0], [0.3, 0.4, 0.5]),
            "success_rate": ([1.0, 2.0], [0.0, 0.25]),  # a step without the metric is skipped, not zero
            "format_error_rate": ([1.0, 2.0, 3.0], [1.0, 0.5, 0.25]),
        }
    finally:
        for _, fig in figures:
            plt.close(fig)


def test_a_plot_the_run_no_longer_produces_is_removed(tmp_path: Path) -> None:
    """A resumed run rewrites its report: a plot whose metric is gone does not stay behind."""
    write_report([{**r, "sc_tail_ratio": 1.5} for r in ROWS], tmp_path)
    assert (tmp_path / "sc_tail_ratio.png").is_file()
    write_report(ROWS, tmp_path)
    assert not (tmp_path / "sc_tail_ratio.png").exists() and (tmp_path / "kl.png").is_file()


def test_no_alerts_no_markers() -> None:
    figures = build_figures(ROWS)
    try:
        assert all(_markers(fig) == [] for _, fig in figures)
    finally:
        for _, fig in figures:
            plt.close(fig)


def test_write_report_draws_the_summary_alerts(tmp_path: Path, monkeypatch) -> None:
    """write_report passes the summary's `collapse_alerts` (the dicts local mode stores) to the plots."""
    import rlfleet.local.report as report

    seen: list = []
    real = report.build_figures

    def spy(rows, alerts=()):
        figs = real(rows, alerts)
        seen.extend(len(_markers(f)) for _, f in figs)
        return figs

    monkeypatch.setattr(report, "build_figures", spy)
    alert = Alert(4, "grad_norm_spike", 9.0, 1.0)
    write_report(ROWS, tmp_path, {"collapse_alerts": [alert.__dict__]})
    assert seen == [1] * 5  # the five plots ROWS have data for
    assert all((tmp_path / name).stat().st_size > 0 for name in ("reward.png", "task.png", "kl.png", "entropy.png"))
    assert (tmp_path / "metrics.json").is_file()


def test_report_writes_json_csv_and_plots(tmp_path):
    rows = [{"step": s, "reward_mean": 0.1 * s, "kl_k3": 0.01, "group/a/kl_k3": 0.02, "grad_norm": 1.0} for s in range(5)]
    write_report(rows, tmp_path, {"final_reward": 0.4})
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert data["summary"]["final_reward"] == 0.4 and len(data["steps"]) == 5
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[0] == "step" and "group/a/kl_k3" in header
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["grad_norm.png", "kl.png", "reward.png", "task.png"]
    for name in ("reward.png", "task.png", "kl.png", "grad_norm.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert math.isclose(data["steps"][4]["reward_mean"], 0.4)
