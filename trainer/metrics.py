"""Per-step metrics (method.md) as ONE flat dict str -> float, plus a Prometheus exporter.

Keys: fleet-wide `kl_k3`, `oor_fraction`, ...; broken down as `group/<name>/<metric>`,
`view/<precision view>/<metric>` and `staleness/<bucket>/<metric>` (buckets 0-1, 2-3, 4-5, 6+);
rollout-side `reward_mean`, `response_length`, `empty_reply_rate`, `no_tool_call_rate`,
`format_error_rate`, `repetition_fraction`, `success_rate` (environments that judge success),
`test_infra_touched_rate` (of the graded SWE patches, the share touching test files or test configuration) (the loop adds `uniform_group_fraction`, from the prompt
groups: trainer/advantages.py); and per group `group/<name>/token_share` and
`group/<name>/oor_share` (the group's share of all tokens vs of all out-of-range tokens); per group and for
the fleet the tokens the samplers answered invalid (`invalid_token_metrics`: `sampled_tokens`,
`dropped_invalid_tokens`, `trained_fraction`, `invalid_reason_<reason>`).

Token metrics (kl_k3, oor_fraction, ess, entropy, sc_tail_ratio, ...) are computed by the objective
itself (`LossOutput`, one implementation); this module names and flattens them, adds the per-view and
share breakdowns, and computes the rollout-side metrics.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rlfleet.records import INVALID_METRIC_PREFIX
from rlfleet.trainer.envs.environments import EpisodeOutcome
from rlfleet.trainer.objective import MEAN_METRICS

if TYPE_CHECKING:
    from rlfleet.trainer.publish.publisher import ViewPublished


def objective_metrics(
    loss_output: Any,
    group_names: Sequence[str],
    group_views: dict[str, str],
) -> dict[str, float]:
    """Flatten the objective's LossOutput (fleet metrics, per group id, per staleness bucket) and add
    the per-precision-view breakdown and each group's token share vs out-of-range share.

    `group_names[i]` is the name of group id i in the TokenBatch; `group_views` maps a group name to
    the precision view it serves (bf16 | fp8 | nvfp4 | mxfp4). View metrics are token-weighted means
    of the groups' means (exact for every mean metric; ESS is not decomposable and is left out)."""
    out: dict[str, float] = {k: float(v) for k, v in loss_output.metrics.items()}
    total = float(loss_output.metrics.get("num_tokens", 0.0))
    total_oor = total * float(loss_output.metrics.get("oor_fraction", 0.0))
    views: dict[str, dict[str, float]] = {}
    for gid, gm in loss_output.per_group.items():
        name = group_names[gid] if 0 <= gid < len(group_names) else f"group{gid}"
        for k, v in gm.items():
            out[f"group/{name}/{k}"] = float(v)
        n = float(gm.get("num_tokens", 0.0))
        out[f"group/{name}/token_share"] = n / total if total else 0.0
        out[f"group/{name}/oor_share"] = (n * gm.get("oor_fraction", 0.0)) / total_oor if total_oor else 0.0
        view = group_views.get(name, "unknown")
        acc = views.setdefault(view, {"num_tokens": 0.0})
        acc["num_tokens"] += n
        for k in MEAN_METRICS:
            if k in gm:
                acc[k] = acc.get(k, 0.0) + n * float(gm[k])
                acc["_n_" + k] = acc.get("_n_" + k, 0.0) + n
    for view, acc in views.items():
        out[f"view/{view}/num_tokens"] = acc["num_tokens"]
        for k in MEAN_METRICS:
            if acc.get("_n_" + k):
                out[f"view/{view}/{k}"] = acc[k] / acc["_n_" + k]
    for bucket, bm in loss_output.per_staleness.items():
        for k, v in bm.items():
            out[f"staleness/{bucket}/{k}"] = float(v)
    return out


# tokens that passed the sampler-side checks but the objective could not use (its q(y) or the trainer's
# logits not finite): counted under this reason beside the sampler-side ones
OBJECTIVE_REASON = "rejected_by_objective"


def invalid_token_metrics(
    sampled: Mapping[str, int],
    dropped: Mapping[str, int],
    reasons: Mapping[str, Mapping[str, int]],
    metrics: Mapping[str, float],
) -> dict[str, float]:
    """What each group's invalid tokens cost, from one batch's counts (trainer/rollout/batching.py FlatBatch
    `sampled_by_group`, `dropped_by_group`, `invalid_reasons_by_group`) and the objective's per-group
    `group/<g>/num_tokens` (trained) and `invalid_tokens` in `metrics`. Per group that sampled tokens:
    `sampled_tokens`, `dropped_invalid_tokens`, `trained_fraction` = tokens trained / tokens sampled (a
    group whose every token was dropped has no objective entry: 0), `invalid_reason_<reason>` per validation
    reason (a token failing several checks counts under each) and `invalid_reason_rejected_by_objective`; the
    same summed for the fleet."""
    out: dict[str, float] = {}
    fleet: dict[str, float] = {}
    trained_total = 0.0
    for group, count in sampled.items():
        p = f"group/{group}/"
        trained = float(metrics.get(p + "num_tokens", 0.0))
        trained_total += trained
        counts = {INVALID_METRIC_PREFIX + r: float(c) for r, c in (reasons.get(group) or {}).items() if c}
        if metrics.get(p + "invalid_tokens"):
            counts[INVALID_METRIC_PREFIX + OBJECTIVE_REASON] = float(metrics[p + "invalid_tokens"])
        counts["sampled_tokens"] = float(count)
        counts["dropped_invalid_tokens"] = float(dropped.get(group, 0))
        for key, value in counts.items():
            out[p + key] = value
            fleet[key] = fleet.get(key, 0.0) + value
        if count:
            out[p + "trained_fraction"] = trained / count
    out.update(
        {k: v for k, v in fleet.items() if k != "dropped_invalid_tokens"}
    )  # the loop's own, fleet-wide
    if fleet.get("sampled_tokens"):
        out["trained_fraction"] = trained_total / fleet["sampled_tokens"]
    return out


def repetition_fraction(ids: Sequence[int]) -> float:
    """Share of tokens that repeat the token right before them (loops show up as ~1)."""
    if len(ids) < 2:
        return 0.0
    a = np.asarray(ids)
    return float(np.mean(a[1:] == a[:-1]))


def rollout_metrics(
    outcomes: Sequence[EpisodeOutcome], completions: Sequence[Sequence[int]], groups: Sequence[str]
) -> dict[str, float]:
    """Rollout side: one outcome per episode, `completions` the model-generated ids per episode."""
    n = len(outcomes)
    if n == 0:
        return {}
    rewards = np.array([o.reward for o in outcomes], dtype=np.float64)
    out = {
        "episodes": float(n),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "response_length": float(np.mean([len(c) for c in completions])),
        "empty_reply_rate": float(np.mean([o.empty_final_reply for o in outcomes])),
        "no_tool_call_rate": float(np.mean([o.no_tool_call_termination for o in outcomes])),
        "format_error_rate": float(np.mean([o.format_errors > 0 for o in outcomes])),
        "tool_calls_per_episode": float(np.mean([o.tool_calls for o in outcomes])),
        "turns_per_episode": float(np.mean([o.num_turns for o in outcomes])),
        "repetition_fraction": float(np.mean([repetition_fraction(c) for c in completions])),
    }
    judged = [o.success for o in outcomes if o.success is not None]
    if judged:  # the task's own pass/fail beside the (possibly shaped) reward
        out["success_rate"] = float(np.mean(judged))
    touched = [o.touched_test_infra for o in outcomes if o.touched_test_infra is not None]
    if touched:  # of the graded patches, the share that touched test files or configuration
        out["test_infra_touched_rate"] = float(np.mean(touched))
    g = np.asarray(groups, dtype=object)
    for label in sorted(set(g.tolist())):
        sel = g == label
        out[f"group/{label}/reward_mean"] = float(rewards[sel].mean())
        out[f"group/{label}/episodes"] = float(sel.sum())
    return out


def finite(metrics: dict[str, float]) -> dict[str, float]:
    """Drop NaN/inf values (JSON and Prometheus friendly)."""
    return {
        k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))
    }


class PrometheusExporter:
    """Exposes the latest step's flat metrics as gauges `rlfleet_trainer_<metric>{scope,key}`.

    Binds 127.0.0.1 by default (metrics only, no control surface). port=0 picks a free port.
    """

    def __init__(self, port: int = 0, addr: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry()
        self._gauges: dict[str, Any] = {}
        self._risk_labels: set[tuple[str, str]] = set()
        self._stored_counted: dict[str, int] = {}  # per view, the stored bytes already added to the counter
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = int(self._server.server_address[1])

    def update(self, step: int, metrics: dict[str, float]) -> None:
        from prometheus_client import Gauge

        for key, value in finite({**metrics, "step": float(step)}).items():
            parts = key.split("/")
            if len(parts) == 3:
                scope, label, name = parts
            else:
                scope, label, name = "fleet", "", key
            metric = "rlfleet_trainer_" + "".join(c if c.isalnum() else "_" for c in name)
            gauge = self._gauges.get(metric)
            if gauge is None:
                gauge = Gauge(
                    metric, f"rlfleet trainer metric {name}", ["scope", "key"], registry=self.registry
                )
                self._gauges[metric] = gauge
            gauge.labels(scope=scope, key=label).set(value)

    def update_finished(self) -> None:
        """`rlfleet_trainer_finished` 1: the run reached spec.trainer.totalSteps (the operator's RLJob
        phase Succeeded, condition Complete)."""
        from prometheus_client import Gauge

        if "finished" not in self._gauges:
            self._gauges["finished"] = Gauge(
                "rlfleet_trainer_finished", "training reached its total steps", registry=self.registry
            )
        self._gauges["finished"].set(1.0)

    def update_collapse(self, alerts: Sequence[Any], quarantined: Sequence[str], pause: bool) -> None:
        """The collapse detector's state, for the operator (the trainer has no Kubernetes API rights):
        `rlfleet_trainer_collapse_risk{signal,group}` 1 for each alert of the latest step (0 once a
        signal stops), with `rlfleet_trainer_collapse_value` / `_baseline` for the message;
        `rlfleet_trainer_quarantine_requested{group}` 1 for every group the detector quarantined
        (cumulative, as the detector's state); `rlfleet_trainer_pause_requested` 0/1. group="" = fleet."""
        from prometheus_client import Gauge

        if "collapse_risk" not in self._gauges:
            names = ["signal", "group"]
            self._gauges["collapse_risk"] = Gauge(
                "rlfleet_trainer_collapse_risk",
                "collapse signal raised at the latest step",
                names,
                registry=self.registry,
            )
            self._gauges["collapse_value"] = Gauge(
                "rlfleet_trainer_collapse_value",
                "value of the raised collapse signal",
                names,
                registry=self.registry,
            )
            self._gauges["collapse_baseline"] = Gauge(
                "rlfleet_trainer_collapse_baseline",
                "baseline of the raised collapse signal",
                names,
                registry=self.registry,
            )
            self._gauges["quarantine_requested"] = Gauge(
                "rlfleet_trainer_quarantine_requested",
                "group quarantined by the collapse detector",
                ["group"],
                registry=self.registry,
            )
            self._gauges["pause_requested"] = Gauge(
                "rlfleet_trainer_pause_requested", "collapse detector paused training", registry=self.registry
            )
        risk = self._gauges["collapse_risk"]
        for labels in list(self._risk_labels):  # signals that stopped read 0 (a transition the operator sees)
            risk.labels(*labels).set(0.0)
        for a in alerts:
            labels = (a.signal, a.group or "")
            self._risk_labels.add(labels)
            risk.labels(*labels).set(1.0)
            if math.isfinite(float(a.value)):
                self._gauges["collapse_value"].labels(*labels).set(float(a.value))
            if math.isfinite(float(a.baseline)):
                self._gauges["collapse_baseline"].labels(*labels).set(float(a.baseline))
        for group in quarantined:
            self._gauges["quarantine_requested"].labels(group=group).set(1.0)
        self._gauges["pause_requested"].set(1.0 if pause else 0.0)

    def update_published(
        self, views: Iterable[ViewPublished], stored_bytes_total: Mapping[str, int] | None = None
    ) -> None:
        """How the latest published version stores each view (trainer/publish/publisher.py `ViewPublished`):
        `rlfleet_trainer_weights_published_bytes{view,kind}` the bytes the channel holds for it, kind
        `anchor` (the whole view) or `delta` (the other kind reads 0, so the sum over kinds is that
        version's bytes), `rlfleet_trainer_weights_view_bytes{view}` the complete view's size and
        `rlfleet_trainer_weights_encode_seconds{view}` the time its comparison with the previous version took.
        `stored_bytes_total` (the publisher's `stored_bytes_total`: per view, the bytes stored over every
        version it published) sets the counter `rlfleet_trainer_weights_stored_bytes_total{view}`: what each
        replica following the view has read since this trainer process started (the operator's rate of it
        charges a group's weight egress, docs/economics.md "Weight traffic"). Called again without a new
        version, the counter stays where it is."""
        from prometheus_client import Counter, Gauge

        if stored_bytes_total is not None:
            if "weights_stored_bytes" not in self._gauges:
                self._gauges["weights_stored_bytes"] = Counter(
                    "rlfleet_trainer_weights_stored_bytes",
                    "bytes the channel stored for the view, summed over the versions this trainer published",
                    ["view"],
                    registry=self.registry,
                )
            for view, total in stored_bytes_total.items():
                counted = self._stored_counted.get(view, 0)
                if total > counted:
                    self._gauges["weights_stored_bytes"].labels(view).inc(float(total - counted))
                    self._stored_counted[view] = total
        if "weights_published_bytes" not in self._gauges:
            self._gauges["weights_published_bytes"] = Gauge(
                "rlfleet_trainer_weights_published_bytes",
                "bytes the channel stores for the view at the latest version",
                ["view", "kind"],
                registry=self.registry,
            )
            self._gauges["weights_view_bytes"] = Gauge(
                "rlfleet_trainer_weights_view_bytes",
                "size of the complete view at the latest version",
                ["view"],
                registry=self.registry,
            )
            self._gauges["weights_encode_seconds"] = Gauge(
                "rlfleet_trainer_weights_encode_seconds",
                "time comparing the view with its previous version",
                ["view"],
                registry=self.registry,
            )
        for v in views:
            for kind in ("anchor", "delta"):
                self._gauges["weights_published_bytes"].labels(v.view, kind).set(
                    float(v.stored_bytes if v.kind == kind else 0)
                )
            self._gauges["weights_view_bytes"].labels(v.view).set(float(v.full_bytes))
            self._gauges["weights_encode_seconds"].labels(v.view).set(float(v.encode_seconds))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
