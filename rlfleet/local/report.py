"""Run report: metrics JSON + CSV and PNG plots (reward, the task's success and malformed turns beside
the shaped reward, per-group KL, OOR share, entropy, grad norm, sc_tail_ratio, a mixture of experts'
routing mismatch, each group's tokens trained / sampled; a plot whose metrics the
run did not produce is not written), and the weight channel's traffic (`WeightTraffic`: bytes stored per
version per view, anchor or delta, in weights.csv and the summary's `weights`). Input: the list of per-step flat metric dicts (each with a `step` key) and the
collapse detector's alerts (trainer/collapse.py `Alert`, or its dict as stored in the run summary's
`collapse_alerts`): every plot has axis labels and draws each alert as one vertical line at its step,
so a collapse can be read against every curve."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from rlfleet.channel import ChannelError, Manifest, WeightChannel
from rlfleet.records import INVALID_METRIC_PREFIX
from rlfleet.store import StoreError


class Plot(NamedTuple):
    file: str
    title: str
    metrics: tuple[
        str, ...
    ]  # one: the fleet's series plus one per group (`group/<g>/<metric>`); more: one each
    ylabel: str


PLOTS: tuple[Plot, ...] = (
    Plot("reward.png", "reward (mean per step)", ("reward_mean",), "mean reward"),
    # the environment's own pass/fail beside its (shaped) reward: a shaped reward can rise on partial credit
    Plot(
        "task.png",
        "task: shaped reward, success, malformed turns",
        ("reward_mean", "success_rate", "format_error_rate", "test_infra_touched_rate"),
        "mean reward / share of episodes",
    ),
    Plot("kl.png", "sampler/trainer KL (k3)", ("kl_k3",), "KL(q || p), k3 estimator (nats)"),
    Plot(
        "oor.png", "out-of-range share of tokens", ("oor_fraction",), "share of tokens outside the MIS band"
    ),
    Plot("entropy.png", "entropy of p (nats)", ("entropy",), "entropy (nats)"),
    Plot("grad_norm.png", "grad norm", ("grad_norm",), "grad norm (before clipping)"),
    Plot("sc_tail_ratio.png", "sc_tail_ratio (rho)", ("sc_tail_ratio",), "rho = q tail mass / p tail mass"),
    # a mixture of experts only (trainer/backends/routing.py): tokens routed to other experts than the trainer's
    Plot(
        "routing.png",
        "routing mismatch (mixture of experts)",
        ("routing_mismatch_tokens",),
        "share of tokens whose experts differ",
    ),
    # a group answering invalid tokens (NaN, positive or out-of-support logprobs, ...): they are dropped
    Plot(
        "trained.png",
        "tokens trained on / tokens sampled",
        ("trained_fraction",),
        "share of sampled tokens trained on",
    ),
)
ALERT_GID = "collapse-alert"  # matplotlib gid of the alert markers (tests find them by it)


def _alert_fields(alert: Any) -> tuple[float, str, str | None]:
    """(step, signal, group) of an Alert or of its dict form."""
    fields: dict[str, Any] = alert if isinstance(alert, dict) else vars(alert)  # a dataclass Alert
    return float(fields["step"]), str(fields.get("signal", "alert")), fields.get("group")


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        if key in row and row[key] is not None:
            xs.append(float(row["step"]))
            ys.append(float(row[key]))
    return xs, ys


def group_tokens(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per group over the whole run (the summary's `groups`, one row each): tokens sampled, tokens trained
    on, tokens dropped as invalid, `trained_fraction` = trained / sampled, and the invalid tokens by
    validation reason (trainer/metrics.py `invalid_token_metrics`, summed over the steps; a token failing
    several checks counts under each reason)."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        for key, value in row.items():
            parts = key.split("/")
            if len(parts) != 3 or parts[0] != "group" or value is None:
                continue
            _, group, name = parts
            if name in ("sampled_tokens", "dropped_invalid_tokens", "num_tokens") or name.startswith(
                INVALID_METRIC_PREFIX
            ):
                g = out.setdefault(
                    group,
                    {
                        "sampled_tokens": 0,
                        "trained_tokens": 0,
                        "dropped_invalid_tokens": 0,
                        "invalid_tokens": {},
                    },
                )
                if name.startswith(INVALID_METRIC_PREFIX):
                    reason = name[len(INVALID_METRIC_PREFIX) :]
                    g["invalid_tokens"][reason] = g["invalid_tokens"].get(reason, 0) + int(value)
                else:
                    g["trained_tokens" if name == "num_tokens" else name] += int(value)
    for g in out.values():
        g["trained_fraction"] = g["trained_tokens"] / g["sampled_tokens"] if g["sampled_tokens"] else None
    return out


WEIGHT_FIELDS = ("version", "view", "kind", "base", "stored_bytes", "bytes")


def version_traffic(manifest: Manifest) -> list[dict[str, Any]]:
    """One row per view of a published version: anchor or delta (against `base`), the bytes the channel
    stores for it (what a replica that follows every version reads) and the complete view's bytes."""
    return [
        {
            "version": manifest.version,
            "view": name,
            "kind": "anchor" if vm.delta is None else "delta",
            "base": None if vm.delta is None else vm.delta.base,
            "stored_bytes": vm.stored_bytes,
            "bytes": vm.bytes,
        }
        for name, vm in sorted(manifest.views.items())
    ]


def weight_traffic(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per view over the versions in `rows` (`version_traffic`'s): versions, anchors, deltas, the bytes
    stored and the complete views' bytes summed, `stored_share` = stored / complete over every version
    (what following every version costs against full versions), and over the delta versions the mean and
    worst share of the view a delta stores (None: no delta)."""
    out: dict[str, dict[str, Any]] = {}
    for row in sorted(rows, key=lambda r: (r["view"], r["version"])):
        v = out.setdefault(
            row["view"],
            {"versions": 0, "anchors": 0, "deltas": 0, "stored_bytes": 0, "bytes": 0, "delta_shares": []},
        )
        v["versions"] += 1
        v["anchors" if row["kind"] == "anchor" else "deltas"] += 1
        v["stored_bytes"] += row["stored_bytes"]
        v["bytes"] += row["bytes"]
        if row["kind"] == "delta" and row["bytes"]:
            v["delta_shares"].append(row["stored_bytes"] / row["bytes"])
    for v in out.values():
        shares = v.pop("delta_shares")
        v["stored_share"] = v["stored_bytes"] / v["bytes"] if v["bytes"] else None
        v["mean_delta_share"] = sum(shares) / len(shares) if shares else None
        v["worst_delta_share"] = max(shares) if shares else None
    return out


def lora_traffic(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """A LoRA run's bytes per version against full fine-tuning's, from `version_traffic` rows (None: no
    `lora` view, not a LoRA run): the adapter each version stored (mean over versions), the base views
    stored once, and what a full fine-tuning version of the same views is (their complete bytes)."""
    from rlfleet.lora import LORA_VIEW

    adapters = [r["stored_bytes"] for r in rows if r["view"] == LORA_VIEW]
    if not adapters:
        return None
    bases = {r["view"]: r["bytes"] for r in rows if r["view"] != LORA_VIEW}
    full = sum(bases.values())
    mean = sum(adapters) / len(adapters)
    return {
        "versions": len(adapters),
        "adapter_bytes_per_version": mean,
        "base_views": sorted(bases),
        "base_bytes_once": full,
        "full_fine_tuning_bytes_per_version": full,
        "ratio": mean / full if full else None,
    }


@dataclass
class WeightTraffic:
    """How a run's channel stored each version: every version's manifest read once, when `observe` first
    sees it (a local run observes after every step and at its end: retention deletes old versions)."""

    versions: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    def observe(self, channel: WeightChannel) -> None:
        try:
            published = channel.versions()
        except StoreError:
            return
        for version in published:
            if version in self.versions:
                continue
            try:
                self.versions[version] = version_traffic(channel.manifest(version))
            except (ChannelError, StoreError):  # retained no longer (deleted since it was listed)
                continue

    def rows(self) -> list[dict[str, Any]]:
        return [row for version in sorted(self.versions) for row in self.versions[version]]


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
    weight_rows = (summary or {}).get("weight_versions")
    if weight_rows:  # bytes stored per version per view (anchor or delta)
        paths["weights"] = out / "weights.csv"
        with open(paths["weights"], "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=WEIGHT_FIELDS)
            writer.writeheader()
            writer.writerows(weight_rows)
    return paths


def build_figures(rows: Sequence[dict[str, Any]], alerts: Sequence[Any] = ()) -> list[tuple[str, Any]]:
    """(file name, matplotlib Figure) per plot with data in `rows` (a plot none of whose metrics the run
    produced is left out, not drawn empty); the caller saves and closes them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({k.split("/")[1] for row in rows for k in row if k.startswith("group/")})
    marks = [_alert_fields(a) for a in alerts]
    figures = []
    for plot in PLOTS:
        series = [(key, "fleet" if len(plot.metrics) == 1 else key, 2) for key in plot.metrics]
        if len(plot.metrics) == 1:
            series += [(f"group/{g}/{plot.metrics[0]}", g, 1) for g in groups]
        drawn = [(label, width, *_series(rows, key)) for key, label, width in series]
        drawn = [d for d in drawn if d[3]]
        if not drawn:  # a metric this run does not produce (rho with mask replay, success without a judge)
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for label, width, xs, ys in drawn:
            style: dict[str, Any] = {"color": "black"} if label == "fleet" else {}
            ax.plot(xs, ys, label=label, linewidth=width, **style)
        fleet = next((ys for label, _, _, ys in drawn if label == "fleet"), [])
        if plot.metrics[0] in ("grad_norm", "kl_k3") and fleet and min(fleet) > 0:
            ax.set_yscale("log")
        for i, (step, signal, group) in enumerate(marks):
            alert_label = "collapse alert" if i == 0 else None  # one legend entry for all markers
            line = ax.axvline(step, color="red", linestyle="--", linewidth=0.8, alpha=0.7, label=alert_label)
            line.set_gid(ALERT_GID)
            ax.annotate(
                signal + (f" ({group})" if group else ""),
                (step, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                fontsize=6,
                color="red",
                va="top",
                ha="right",
            )
        ax.set_title(plot.title)
        ax.set_xlabel("step")
        ax.set_ylabel(plot.ylabel)
        ax.legend(fontsize=7)
        fig.tight_layout()
        figures.append((plot.file, fig))
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
    for plot in PLOTS:  # a resumed run's report holds no plot of an earlier part the run no longer draws
        if out / plot.file not in written:
            (out / plot.file).unlink(missing_ok=True)
    return written


def write_report(
    rows: Sequence[dict[str, Any]], out_dir: str | Path, summary: dict[str, Any] | None = None
) -> Path:
    """Metrics files and plots; the alerts drawn are the summary's `collapse_alerts` (if any)."""
    out = Path(out_dir)
    write_metrics(rows, out, summary)
    write_plots(rows, out, alerts=(summary or {}).get("collapse_alerts", ()))
    return out
