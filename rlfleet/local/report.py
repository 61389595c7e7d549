"""Run report: metrics JSON + CSV and PNG plots (reward, per-group KL, OOR share, entropy, grad norm,
sc_tail_ratio). Input: the list of per-step flat metric dicts (each with a `step` key) and the
collapse detector's alerts (trainer/collapse.py `Alert`, or its dict as stored in the run summary's
`collapse_alerts`): every plot has axis labels and draws each alert as one vertical line at its step,
so a collapse can be read against every curve."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PLOTS: tuple[tuple[str, str, str, str], ...] = (
    # file, title, metric name, y-axis label (per-group series are drawn when `group/<g>/<name>` keys exist)
    ("reward.png", "reward (mean per step)", "reward_mean", "mean reward"),
    ("kl.png", "sampler/trainer KL (k3)", "kl_k3", "KL(q || p), k3 estimator (nats)"),
    ("oor.png", "out-of-range share of tokens", "oor_fraction", "share of tokens outside the MIS band"),
    ("entropy.png", "entropy of p (nats)", "entropy", "entropy (nats)"),
    ("grad_norm.png", "grad norm", "grad_norm", "grad norm (before clipping)"),
    ("sc_tail_ratio.png", "sc_tail_ratio (rho)", "sc_tail_ratio", "rho = q tail mass / p tail mass"),
)
ALERT_GID = "collapse-alert"  # matplotlib gid of the alert markers (tests find them by it)


def _alert_fields(alert: Any) -> tuple[float, str, str | None]:
    """(step, signal, group) of an Alert or of its dict form."""
    get = alert.get if isinstance(alert, dict) else lambda k, d=None: getattr(alert, k, d)
    return float(get("step")), str(get("signal", "alert")), get("group")


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        if key in row and row[key] is not None:
            xs.append(float(row["step"]))
            ys.append(float(row[key]))
    return xs, ys


def write_metrics(
    rows: Sequence[dict[str, Any]], out_dir: str | Path, summary: dict[str, Any] | None = None
) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "metrics.json", "csv": out / "metrics.csv"}
    paths["json"].write_text(
        json.dumps({"summary": summary or {}, "steps": list(rows)}, indent=1, default=float)
    )
    keys = sorted({k for row in rows for k in row}, key=lambda k: (k != "step", k.count("/"), k))
    with open(paths["csv"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow(row)
    return paths


def build_figures(rows: Sequence[dict[str, Any]], alerts: Sequence[Any] = ()) -> list[tuple[str, Any]]:
    """(file name, matplotlib Figure) per plot; the caller saves and closes them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({k.split("/")[1] for row in rows for k in row if k.startswith("group/")})
    marks = [_alert_fields(a) for a in alerts]
    figures = []
    for filename, title, key, ylabel in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        drawn = False
        xs, ys = _series(rows, key)
        if ys:
            ax.plot(xs, ys, label="fleet", color="black", linewidth=2)
            drawn = True
        for g in groups:
            gx, gy = _series(rows, f"group/{g}/{key}")
            if gy:
                ax.plot(gx, gy, label=g, linewidth=1)
                drawn = True
        if key in ("grad_norm", "kl_k3") and ys and min(ys) > 0:
            ax.set_yscale("log")
        for i, (step, signal, group) in enumerate(marks):
            label = "collapse alert" if i == 0 else None  # one legend entry for all markers
            line = ax.axvline(step, color="red", linestyle="--", linewidth=0.8, alpha=0.7, label=label)
            line.set_gid(ALERT_GID)
            ax.annotate(signal + (f" ({group})" if group else ""), (step, 1.0), xycoords=("data", "axes fraction"),
                        rotation=90, fontsize=6, color="red", va="top", ha="right")  # fmt: skip
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if drawn or marks:
            ax.legend(fontsize=7)
        if not drawn:
            ax.text(
                0.5, 0.5, "no data (metric not produced in this run)", ha="center", transform=ax.transAxes
            )
        fig.tight_layout()
        figures.append((filename, fig))
    return figures


def write_plots(
    rows: Sequence[dict[str, Any]], out_dir: str | Path, alerts: Sequence[Any] = ()
) -> list[Path]:
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, fig in build_figures(rows, alerts):
        path = out / filename
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def write_report(
    rows: Sequence[dict[str, Any]], out_dir: str | Path, summary: dict[str, Any] | None = None
) -> Path:
    """Metrics files and plots; the alerts drawn are the summary's `collapse_alerts` (if any)."""
    out = Path(out_dir)
    write_metrics(rows, out, summary)
    write_plots(rows, out, alerts=(summary or {}).get("collapse_alerts", ()))
    return out
