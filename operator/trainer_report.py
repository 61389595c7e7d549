"""PURE: the trainer's exporter text -> the RLJob status fields the trainer reports, and the actions.

The trainer has no Kubernetes API rights (least privilege: its pods mount no ServiceAccount token). It
exports its step, the weight version it published, the fleet metrics and the collapse detector's state
(`rlfleet.trainer.metrics.PrometheusExporter`); the operator's tick (every 5 s) scrapes trainer pod 0
(`rebalancer.py`) and the RLJob's reconcile pipeline puts these fields into the job's whole status
(`job_status.rljob_status(..., trainer_report=...)`, one apply, only on change):

- `status.step`, `status.weightVersion` (never lowered: the WeightChannel status is the other source),
  `status.metrics` (reward, kl, oorFraction, entropy, scTailRatio, updatedAt);
- the `CollapseRisk` condition of the RLJob: True with the trainer's signals (reason = the first signal
  in CamelCase, e.g. `KlSurge`, or `TrainingPaused`) and/or the SamplerGroups' own CollapseRisk
  conditions (reason `GroupCollapseRisk`), else False / `NoSignal`; observedGeneration = the job's;
- the quarantine decision: with `spec.safety.action: quarantine-group`, the groups the detector
  quarantined (`rlfleet_trainer_quarantine_requested{group}`) are quarantined through the one quarantine
  path (`group_status.quarantine_reason`: share 0, the router sends them no new sessions, status.quarantined);
- `pause`: the trainer stops stepping by itself; the operator reports it (CollapseRisk reason
  `TrainingPaused` + a Warning Event) and never writes the RLJob spec (resume = fix, then restart the
  trainer pod or set `spec.suspend`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "rlfleet_trainer_"
# RLJob status.metrics field <- fleet metric name in the exporter
RUN_METRICS = {
    "reward": "reward_mean",
    "kl": "kl_k3",
    "oorFraction": "oor_fraction",
    "entropy": "entropy",
    "scTailRatio": "sc_tail_ratio",
}


@dataclass(frozen=True)
class CollapseSignal:
    signal: str  # kl_surge, reward_cliff, ... (trainer/collapse.py)
    group: str  # "" = fleet-wide
    value: float | None = None
    baseline: float | None = None

    def message(self) -> str:
        scope = f"group {self.group}" if self.group else "fleet"
        text = f"{self.signal} ({scope})"
        if self.value is not None:
            text += f": {self.value:.4g}"
            if self.baseline is not None:
                text += f" vs baseline {self.baseline:.4g}"
        return text


@dataclass(frozen=True)
class TrainerReport:
    step: int | None = None
    weight_version: int | None = None
    fleet: Mapping[str, float] = field(default_factory=dict)  # scope="fleet" metrics by name
    signals: tuple[CollapseSignal, ...] = ()  # raised at the trainer's latest step
    quarantine_requested: tuple[str, ...] = ()  # cumulative (the detector's state)
    pause_requested: bool = False
    finished: bool = False  # the run reached spec.trainer.totalSteps (`rlfleet_trainer_finished`)
    external_version: int | None = None  # an external trainer's newest version (the slime bridge's report)


@dataclass
class _ReportSamples:
    """The exporter's samples as parse_trainer_report collects them, by metric."""

    fleet: dict[str, float] = field(default_factory=dict)
    risk: dict[tuple[str, str], float] = field(default_factory=dict)
    values: dict[tuple[str, str], float] = field(default_factory=dict)
    baselines: dict[tuple[str, str], float] = field(default_factory=dict)
    quarantine: set[str] = field(default_factory=set)
    pause: bool = False
    finished: bool = False

    def add(self, name: str, labels: Mapping[str, str], value: float) -> None:
        """File one sample (its name without the prefix) under what it reports."""
        key = (labels.get("signal", ""), labels.get("group", ""))
        if name == "collapse_risk":
            self.risk[key] = value
        elif name == "collapse_value":
            self.values[key] = value
        elif name == "collapse_baseline":
            self.baselines[key] = value
        elif name == "quarantine_requested":
            if value > 0 and labels.get("group"):
                self.quarantine.add(labels["group"])
        elif name == "pause_requested":
            self.pause = value > 0
        elif name == "finished":
            self.finished = value > 0
        elif labels.get("scope") == "fleet":
            self.fleet[name] = value


def parse_trainer_report(text: str) -> TrainerReport:
    """Parse the trainer exporter's text format (ValueError on text that is not Prometheus text)."""
    got = _ReportSamples()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(PREFIX) and math.isfinite(sample.value):
                got.add(sample.name[len(PREFIX) :], sample.labels, sample.value)
    signals = tuple(
        CollapseSignal(signal, group, got.values.get((signal, group)), got.baselines.get((signal, group)))
        for (signal, group), raised in sorted(got.risk.items())
        if raised > 0 and signal
    )
    step = got.fleet.get("step")
    version = got.fleet.get("weight_version")
    external = got.fleet.get("external_version")
    return TrainerReport(
        step=int(step) if step is not None and step >= 0 else None,
        weight_version=int(version) if version is not None and version >= 0 else None,
        fleet=got.fleet,
        signals=signals,
        quarantine_requested=tuple(sorted(got.quarantine)),
        pause_requested=got.pause,
        finished=got.finished,
        external_version=int(external) if external is not None and external >= 0 else None,
    )


def _camel(signal: str) -> str:
    return "".join(p.title() for p in signal.split("_")) or "CollapseSignal"


def _get(d: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(d, Mapping) or key not in d:
            return None
        d = d[key]
    return d


@dataclass(frozen=True)
class TrainerStatusResult:
    status: dict[str, Any]  # RLJob status fields to apply (camelCase)
    quarantine: frozenset[str]  # group names (spec names) to quarantine
    risk: bool  # CollapseRisk status True
    risk_changed: bool  # CollapseRisk status differs from the observed one (-> an Event)


def trainer_job_status(
    job: Mapping[str, Any], samplergroups: Sequence[Mapping[str, Any]], report: TrainerReport | None, now: str
) -> TrainerStatusResult:
    """RLJob status fields from the trainer's report and the SamplerGroups' CollapseRisk conditions.

    `report` None = the trainer was not readable: step/metrics are re-sent as observed, the condition
    then only reflects the groups. `now` (RFC 3339) is used for updatedAt and a changed lastTransitionTime."""
    generation = _get(job, "metadata", "generation")
    old = job.get("status") or {}
    action = _get(job, "spec", "safety", "action") or "alert"
    wanted = {g.get("name") for g in _get(job, "spec", "samplerGroups") or []}
    # one server-side apply owns all of these fields: what is not re-sent would be removed, so a
    # trainer that cannot be read right now leaves the last reported values in place
    status: dict[str, Any] = {
        k: old[k] for k in ("step", "metrics", "externalVersion") if report is None and old.get(k) is not None
    }
    if report is not None:
        status.update(_reported_progress(report, old, now))
    reason, parts = _risk_reason(report, samplergroups)
    quarantine: frozenset[str] = frozenset()
    if report is not None and action == "quarantine-group":
        quarantine = frozenset(g for g in report.quarantine_requested if g in wanted)
        if quarantine:
            parts.append(f"quarantined: {', '.join(sorted(quarantine))}")
    risk_on = reason != "NoSignal"
    previous = next((c for c in old.get("conditions") or [] if c.get("type") == "CollapseRisk"), None)
    was_on = bool(previous and previous.get("status") == "True")
    condition: dict[str, Any] = {
        "type": "CollapseRisk",
        "status": "True" if risk_on else "False",
        "reason": reason,
        "message": "; ".join(parts)[:4000] if parts else "no collapse precursor reported",
        "lastTransitionTime": (previous or {}).get("lastTransitionTime")
        if previous and was_on == risk_on
        else now,
    }
    if condition["lastTransitionTime"] is None:
        condition["lastTransitionTime"] = now
    if generation is not None:
        condition["observedGeneration"] = generation
    status["conditions"] = [condition]
    complete = _complete_condition(report, old, generation, now)
    if complete is not None:
        status["conditions"].append(complete)
    return TrainerStatusResult(
        status=status, quarantine=quarantine, risk=risk_on, risk_changed=was_on != risk_on
    )


def _reported_progress(report: TrainerReport, old: Mapping[str, Any], now: str) -> dict[str, Any]:
    """step, weightVersion (never lower than observed) and the run metrics (updatedAt moves only
    when a value changed) from a readable trainer."""
    status: dict[str, Any] = {}
    if report.step is not None:
        status["step"] = report.step
    if report.weight_version is not None:
        status["weightVersion"] = max(report.weight_version, int(old.get("weightVersion") or 0))
    if report.external_version is not None:  # slime's newest version (trainer.external), never lowered
        status["externalVersion"] = max(report.external_version, int(old.get("externalVersion") or 0))
    metrics = {k: round(report.fleet[v], 6) for k, v in RUN_METRICS.items() if v in report.fleet}
    if "oorFraction" in metrics:
        metrics["oorFraction"] = min(max(metrics["oorFraction"], 0.0), 1.0)
    if metrics:
        same = {k: v for k, v in (old.get("metrics") or {}).items() if k != "updatedAt"} == metrics
        updated = (old.get("metrics") or {}).get("updatedAt") if same else None
        status["metrics"] = {**metrics, "updatedAt": updated or now}
    return status


def _risk_reason(
    report: TrainerReport | None, samplergroups: Sequence[Mapping[str, Any]]
) -> tuple[str, list[str]]:
    """The CollapseRisk reason (the first cause in the order pause, trainer signal, group risk;
    NoSignal when none) and the message parts of every cause."""
    parts: list[str] = []
    reason = "NoSignal"
    if report is not None and report.pause_requested:
        reason = "TrainingPaused"
        parts.append("training paused by the collapse detector")
    if report is not None and report.signals:
        reason = reason if reason != "NoSignal" else _camel(report.signals[0].signal)
        parts.extend(s.message() for s in report.signals)
    for sg in samplergroups:
        risk = next(
            (c for c in _get(sg, "status", "conditions") or [] if c.get("type") == "CollapseRisk"), None
        )
        if risk and risk.get("status") == "True":
            reason = reason if reason != "NoSignal" else "GroupCollapseRisk"
            parts.append(f"{_get(sg, 'spec', 'name')}: {risk.get('message', '')}".strip())
    return reason, parts


def _complete_condition(
    report: TrainerReport | None, old: Mapping[str, Any], generation: Any, now: str
) -> dict[str, Any] | None:
    """Complete (as a Kubernetes Job's): True once the trainer reports its last step; kept while the
    trainer cannot be read (a finished run does not become unfinished)."""
    old_complete = next((c for c in old.get("conditions") or [] if c.get("type") == "Complete"), None)
    if report is not None and report.finished:
        since = (
            old_complete.get("lastTransitionTime")
            if old_complete and old_complete.get("status") == "True"
            else None
        )
        return {
            "type": "Complete",
            "status": "True",
            "reason": "TrainingFinished",
            "message": f"training finished at step {report.step}",
            "lastTransitionTime": since or now,
            **({"observedGeneration": generation} if generation is not None else {}),
        }
    if report is None and old_complete is not None and old_complete.get("status") == "True":
        return dict(old_complete)
    return None
