"""Report plots (rlfleet/local/report.py): axis labels on every plot and one vertical marker per collapse
alert, checked on the real matplotlib Figure objects (not by eye); the written report draws the
alerts the run summary carries; a plot whose metrics a run does not produce is not written (no empty
plots), and the task plot shows the task's success and malformed turns beside the shaped reward."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from safetensors.numpy import save_file

from rlfleet.channel import DeltaSource, WeightChannel
from rlfleet.deltas import encode_delta
from rlfleet.local.main import weights_line
from rlfleet.local.report import (
    ALERT_GID,
    PLOTS,
    WeightTraffic,
    build_figures,
    weight_traffic,
    write_metrics,
    write_report,
)
from rlfleet.store import FilesystemStore
from rlfleet.trainer.collapse import Alert

ROWS = [
    {
        "step": float(s),
        "reward_mean": 0.1 * s,
        "kl_k3": 0.01 * s,
        "group/h100-fp8/kl_k3": 0.02 * s,
        "grad_norm": 1.0 + s,
        "entropy": 2.0 - 0.1 * s,
    }
    for s in range(1, 9)
]


def _markers(fig) -> list:
    return [line for line in fig.axes[0].get_lines() if line.get_gid() == ALERT_GID]


def test_every_plot_has_axis_labels_and_one_marker_per_alert() -> None:
    alerts = [
        Alert(3, "kl_surge", 0.5, 0.1, group="h100-fp8"),
        Alert(6, "reward_cliff", 0.1, 0.6),
        {"step": 7, "signal": "rho_blowup", "value": 60.0, "baseline": 50.0, "group": None},
    ]
    figures = build_figures(ROWS, alerts)
    try:
        # ROWS have no oor_fraction and no sc_tail_ratio: those plots are left out, not drawn empty
        assert [name for name, _ in figures] == [
            "reward.png",
            "task.png",
            "kl.png",
            "entropy.png",
            "grad_norm.png",
        ]
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
    rows = [
        {"step": 1.0, "reward_mean": 0.3, "success_rate": 0.0, "format_error_rate": 1.0},
        {"step": 2.0, "reward_mean": 0.4, "success_rate": 0.25, "format_error_rate": 0.5},
        {"step": 3.0, "reward_mean": 0.5, "format_error_rate": 0.25},
    ]
    figures = build_figures(rows)
    try:
        ax = dict(figures)["task.png"].axes[0]
        lines = {
            line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()
        }
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
    assert all(
        (tmp_path / name).stat().st_size > 0 for name in ("reward.png", "task.png", "kl.png", "entropy.png")
    )
    assert (tmp_path / "metrics.json").is_file()


def test_report_writes_json_csv_and_plots(tmp_path):
    rows = [
        {"step": s, "reward_mean": 0.1 * s, "kl_k3": 0.01, "group/a/kl_k3": 0.02, "grad_norm": 1.0}
        for s in range(5)
    ]
    write_report(rows, tmp_path, {"final_reward": 0.4})
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert data["summary"]["final_reward"] == 0.4 and len(data["steps"]) == 5
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[0] == "step" and "group/a/kl_k3" in header
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "grad_norm.png",
        "kl.png",
        "reward.png",
        "task.png",
    ]
    for name in ("reward.png", "task.png", "kl.png", "grad_norm.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert math.isclose(data["steps"][4]["reward_mean"], 0.4)


def _view(directory: Path, values: np.ndarray) -> Path:
    directory.mkdir(parents=True)
    save_file({"model.layers.0.mlp.up_proj.weight": values}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text("{}")
    return directory


def test_weight_traffic_over_anchors_and_deltas(tmp_path: Path) -> None:
    """A real channel: v0 anchors, v1 a bf16 delta (3 elements changed) beside an fp8 anchor, v2 anchors,
    then v0 and v1 deleted by retention. Each version is read once as it appears, so the report keeps
    them; the sums, shares, weights.csv and the summary line are exact."""
    channel = WeightChannel(FilesystemStore(tmp_path / "store", create=True))
    traffic = WeightTraffic()
    rng = np.random.default_rng(0)
    w0 = rng.integers(0, 2**16, 4096, dtype=np.uint16)
    w1 = w0.copy()
    w1[[1, 100, 4000]] ^= 1
    codes = rng.integers(0, 256, 4096, dtype=np.uint8)
    channel.publish({"bf16": _view(tmp_path / "0" / "bf16", w0), "fp8": _view(tmp_path / "0" / "fp8", codes)})
    traffic.observe(channel)
    bf16_1, fp8_1 = _view(tmp_path / "1" / "bf16", w1), _view(tmp_path / "1" / "fp8", codes)
    payload = tmp_path / "model.safetensors.delta"
    assert encode_delta(tmp_path / "0" / "bf16" / "model.safetensors", bf16_1 / "model.safetensors", payload)
    channel.publish(
        {"bf16": bf16_1, "fp8": fp8_1}, deltas={"bf16": DeltaSource(0, {"model.safetensors": payload})}
    )
    traffic.observe(channel)
    traffic.observe(channel)  # read once: nothing new
    channel.publish({"bf16": _view(tmp_path / "2" / "bf16", w1), "fp8": _view(tmp_path / "2" / "fp8", codes)})
    channel.retain(keep=1)
    assert channel.versions() == [2]
    traffic.observe(channel)

    full_bf16 = (bf16_1 / "model.safetensors").stat().st_size + 2  # + config.json "{}"
    full_fp8 = (fp8_1 / "model.safetensors").stat().st_size + 2
    delta = payload.stat().st_size + 2  # the payload and config.json, stored whole
    rows = traffic.rows()
    assert [(r["version"], r["view"], r["kind"], r["base"], r["stored_bytes"], r["bytes"]) for r in rows] == [
        (0, "bf16", "anchor", None, full_bf16, full_bf16),
        (0, "fp8", "anchor", None, full_fp8, full_fp8),
        (1, "bf16", "delta", 0, delta, full_bf16),
        (1, "fp8", "anchor", None, full_fp8, full_fp8),
        (2, "bf16", "anchor", None, full_bf16, full_bf16),
        (2, "fp8", "anchor", None, full_fp8, full_fp8),
    ]
    summary = weight_traffic(rows)
    assert summary["bf16"] == {
        "versions": 3,
        "anchors": 2,
        "deltas": 1,
        "stored_bytes": 2 * full_bf16 + delta,
        "bytes": 3 * full_bf16,
        "stored_share": (2 * full_bf16 + delta) / (3 * full_bf16),
        "mean_delta_share": delta / full_bf16,
        "worst_delta_share": delta / full_bf16,
    }
    assert summary["fp8"]["stored_share"] == 1.0 and summary["fp8"]["mean_delta_share"] is None
    paths = write_metrics([], tmp_path / "report", {"weights": summary, "weight_versions": rows})
    with open(paths["weights"]) as fh:
        written = list(csv.DictReader(fh))
    assert [(r["version"], r["kind"], r["base"], r["stored_bytes"]) for r in written[2:3]] == [
        ("1", "delta", "0", str(delta))
    ]
    assert json.loads(paths["json"].read_text())["summary"]["weights"]["bf16"]["deltas"] == 1
    assert weights_line("bf16", summary["bf16"]) == (
        f"weights bf16: 3 versions (2 anchors, 1 deltas), {(2 * full_bf16 + delta) / 1e6:.2f} MB stored of "
        f"{3 * full_bf16 / 1e6:.2f} MB as full versions ({summary['bf16']['stored_share']:.1%}); a delta "
        f"{delta / full_bf16:.2%} of the view on average (worst {delta / full_bf16:.2%})"
    )
    assert weights_line("fp8", summary["fp8"]).endswith("as full versions (100.0%)")
