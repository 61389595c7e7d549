"""Run report: metrics JSON + CSV and PNG plots (reward, per-group KL, OOR share, entropy, grad norm,
sc_tail_ratio). Input: the list of per-step flat metric dicts (each with a `step` key)."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PLOTS: tuple[tuple[str, str, str], ...] = (
    # file, title, metric name (per-group series are drawn when `group/<g>/<name>` keys exist)
    ("reward.png", "reward (mean per step)", "reward_mean"),
    ("kl.png", "sampler/trainer KL (k3)", "kl_k3"),
    ("oor.png", "out-of-range share of tokens", "oor_fraction"),
    ("entropy.png", "entropy of p (nats)", "entropy"),
    ("grad_norm.png", "grad norm", "grad_norm"),
    ("sc_tail_ratio.png", "sc_tail_ratio (rho)", "sc_tail_ratio"),
)


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        if key in row and row[key] is not None:
            xs.append(float(row["step"]))
            ys.append(float(row[key]))
    return xs, ys


def write_metrics(rows: Sequence[dict[str, Any]], out_dir: str | Path, summary: dict[str, Any] | None = None) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "metrics.json", "csv": out / "metrics.csv"}
    paths["json"].write_text(json.dumps({"summary": summary or {}, "steps": list(rows)}, indent=1, default=float))
    keys = sorted({k for row in rows for k in row}, key=lambda k: (k != "step", k.count("/"), k))
    with open(paths["csv"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow(row)
    return paths


def write_plots(rows: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = sorted({k.split("/")[1] for row in rows for k in row if k.startswith("group/")})
    written = []
    for filename, title, key in PLOTS:
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
        ax.set_title(title)
        ax.set_xlabel("step")
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data (metric not produced in this run)", ha="center", transform=ax.transAxes)
        fig.tight_layout()
        path = out / filename
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def write_report(rows: Sequence[dict[str, Any]], out_dir: str | Path, summary: dict[str, Any] | None = None) -> Path:
    out = Path(out_dir)
    write_metrics(rows, out, summary)
    write_plots(rows, out)
    return out
