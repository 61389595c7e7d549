"""PURE status of an RLJob (operator/status.py: the conventions): rolled up from its SamplerGroups, its
trainer StatefulSet and pods, its WeightChannel, the rebalance tick's fleet figures, the trainer's report
and the job's decisions.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from rlfleet.operator import naming as n
from rlfleet.operator.pods import (
    CrashSettle,
    PodProblem,
    admission_wait,
    creation_failure,
    parse_time,
    workload_crash,
    workload_problem,
)
from rlfleet.operator.status import (
    Manifest,
    clip,
    condition,
    merge_conditions,
    nested,
    now_iso,
    object_condition,
)

# RLJob status fields that come from the rebalance tick (fleet cost) and the trainer's exporter
JOB_COST_FIELDS = ("costPer1MTokens", "baselineCostPer1MTokens", "savingPercent", "baselineSource")


def _owned_by_block(
    spec: Manifest, old: Manifest, block: str, key: str, value: Manifest | None
) -> dict[str, Any]:
    """A status field of an opt-in `router.<block>` (fleetPlan: the optimizer; precisionAutopilot: the
    autopilot) while the block is enabled: this operator's value, else the observed one (after a
    restart); none when the block is off."""
    if not nested(spec, "router", block, "enabled"):
        return {}
    return _kept(old, key, value)


def _kept(old: Manifest, key: str, value: Manifest | None) -> dict[str, Any]:
    """A status field from this operator's `value`, else the observed one (after a restart); none if neither."""
    current = value if value is not None else old.get(key)
    return {key: current} if current is not None else {}


def rljob_status(
    job: Manifest,
    groups: list[Manifest],
    trainer: Manifest | None,
    channel: Manifest | None,
    now: str | None = None,
    invalid: str | None = None,
    trainer_pods: list[Manifest] | tuple[Manifest, ...] = (),
    costs: Manifest | None = None,
    trainer_report: Manifest | None = None,
    trainer_create_failure: str | None = None,
    fleet_plan: Manifest | None = None,
    precision_autopilot: Manifest | None = None,
    trainer_admission: str | None = None,
    decisions: Manifest | None = None,
) -> dict[str, Any]:
    """The whole status of an RLJob: rolled up from its SamplerGroups, trainer StatefulSet and its pods
    (`pods.pod_view`s: why the trainer does not run; `trainer_create_failure`: the message of the
    StatefulSet's latest FailedCreate Event, e.g. a ResourceQuota's refusal; `trainer_admission`: the
    message of the latest Kueue `Pending` Event of the trainer's Workload, e.g. insufficient quota, shown
    while Kueue's scheduling gate holds the trainer pods), the channel (not Ready while
    it is Degraded, e.g. its store unreachable), the rebalance tick's fleet `costs`
    (None: not rebalanced since the operator started: the observed values are kept) and the trainer's
    report (`trainer_report.trainer_job_status(...).status`: step, metrics, weightVersion, CollapseRisk)
    and the fleet-mix optimizer's last decision (`fleet_plan`, rebalancer.fleet_plan_status; None: none
    since the operator started: the observed one is kept while `router.optimize` is enabled), and the
    precision autopilot's last change per group (`precision_autopilot`, the same way under `router.autopilot`),
    and the job's decisions (`decisions`, decide.py `Decisions.status`; None: none since the operator
    started: the observed ones are kept, the next decision goes on from them). `groups` are the SamplerGroups the spec asks for (missing ones count as not ready)."""
    now = now or now_iso()
    generation = nested(job, "metadata", "generation")
    old = job.get("status") or {}
    spec = job.get("spec", {})
    suspended = bool(spec.get("suspend"))
    wanted = [g.get("name") for g in spec.get("samplerGroups", [])]
    by_group = {nested(g, "spec", "name"): g for g in groups}
    summaries, ready_groups, degraded_groups = _group_summaries(wanted, by_group)
    t_desired = 0 if suspended else int(nested(spec, "trainer", "replicas", default=1))
    t_ready = int(nested(trainer, "status", "readyReplicas", default=0) or 0)
    trainer_ready = trainer is not None and t_ready >= t_desired
    trainer_problem: PodProblem | None = None
    if not suspended:
        created = int(nested(trainer, "status", "replicas", default=0) or 0)
        # a trainer that crashes a while after each start is Ready (no readiness probe) between crashes:
        # CrashSettle keeps it Degraded until it runs steadily or reports new metrics (operator/pods.py)
        reported = [
            parse_time(nested(source, "metrics", "updatedAt")) for source in (old, trainer_report or {})
        ]
        settle = CrashSettle(
            now=parse_time(now) or datetime.now(UTC),
            progress_at=max((t for t in reported if t is not None), default=None),
        )
        if trainer_ready:
            trainer_problem = workload_crash(trainer_pods, settle)
        else:
            trainer_problem = (
                creation_failure(created, t_desired, trainer_create_failure) if trainer is not None else None
            ) or workload_problem(trainer_pods, settle)
    channel_degraded = object_condition(channel, "Degraded")
    if channel_degraded is not None and channel_degraded.get("status") != "True":
        channel_degraded = None
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "readyGroups": f"{ready_groups}/{len(wanted)}",
        "groups": summaries,
        "trainer": {"replicas": t_desired, "readyReplicas": t_ready, "ready": f"{t_ready}/{t_desired}"},
    }
    observed_costs = {k: old[k] for k in JOB_COST_FIELDS if old.get(k) is not None}
    status.update(
        observed_costs
        if costs is None
        else {k: costs[k] for k in JOB_COST_FIELDS if costs.get(k) is not None}
    )
    status.update(_owned_by_block(spec, old, "optimize", "fleetPlan", fleet_plan))
    status.update(_owned_by_block(spec, old, "autopilot", "precisionAutopilot", precision_autopilot))
    status.update(_kept(old, "decisions", decisions))
    report = dict(trainer_report or {})
    report_conditions = report.pop("conditions", [])
    status.update(report)
    latest = nested(channel, "status", "latestVersion")
    if latest is not None or report.get("weightVersion") is not None:
        # the channel's pointer or the trainer's report, whichever is newer (never lowered)
        status["weightVersion"] = max(v for v in (latest, report.get("weightVersion")) if v is not None)
    complete = next(
        (c for c in report_conditions if c.get("type") == "Complete" and c.get("status") == "True"), None
    )
    if invalid:
        phase, reason, message = "Failed", "InvalidSpec", invalid
    elif complete is not None and not suspended:
        phase, reason = "Succeeded", "TrainingFinished"
        message = (
            f"{complete.get('message', 'training finished')}; the sampler groups keep running until the "
            "RLJob is deleted or suspended (spec.suspend: true)"
        )
    elif suspended:
        phase, reason, message = _suspension_phase(wanted, by_group, trainer)
    elif trainer_problem is not None or degraded_groups or channel_degraded is not None:
        phase = "Degraded"
        reason, message = _degradation(job, channel, trainer_problem, degraded_groups, channel_degraded)
    elif ready_groups == len(wanted) and trainer_ready:
        phase, reason, message = (
            "Running",
            "AllReady",
            f"{ready_groups}/{len(wanted)} groups and trainer ready",
        )
    else:
        queued = None if trainer_ready else admission_wait(trainer_pods, trainer_admission)
        phase, reason, message = _pending(
            job, f"{ready_groups}/{len(wanted)} groups ready, trainer {t_ready}/{t_desired}", queued
        )
    message = clip(message)
    status.update(phase=phase, reason=reason, message=message)
    conditions = _job_conditions(phase, reason, message, generation)
    status["conditions"] = merge_conditions(old.get("conditions"), conditions, now) + [
        dict(c)
        for c in report_conditions  # CollapseRisk: its transition time is kept by trainer_report.py
    ]
    return status


def _pending(job: Manifest, progress: str, queued: PodProblem | None) -> tuple[str, str, str]:
    """(phase, reason, message) of a job on its way: `queued` (pods.admission_wait) when scheduling gates
    hold the trainer's pods, e.g. Kueue's until the queue has the quota for the whole gang."""
    if queued is None:
        return "Pending", "Reconciling", progress
    trainer = n.trainer_name(str(nested(job, "metadata", "name", default="")))
    return "Pending", queued.reason, f"{progress}: trainer StatefulSet {trainer}: {queued.message}"


def _group_summaries(
    wanted: list[Any], by_group: dict[Any, Manifest]
) -> tuple[list[dict[str, Any]], int, list[tuple[str, str, str, str]]]:
    """Per wanted group: its summary entry; how many are ready (status current); and the degraded ones
    as (group, reason, message with the group's object names masked, message)."""
    summaries: list[dict[str, Any]] = []
    ready_groups = 0
    degraded_groups: list[tuple[str, str, str, str]] = []
    for name in wanted:
        sg = by_group.get(name)
        phase = nested(sg, "status", "phase")
        stale = sg is None or nested(sg, "status", "observedGeneration") != nested(
            sg, "metadata", "generation"
        )
        entry: dict[str, Any] = {"name": name, "phase": phase or "Pending"}
        if nested(sg, "status", "ready") is not None:
            entry["ready"] = nested(sg, "status", "ready")
        if nested(sg, "status", "share") is not None:
            entry["share"] = nested(sg, "status", "share")
        summaries.append(entry)
        if not stale and phase in ("Running", "Quarantined"):
            ready_groups += 1
        if phase in ("Degraded", "Failed"):
            why = str(nested(sg, "status", "message", default="") or "")
            masked = re.sub(
                rf"\b{re.escape(str(nested(sg, 'metadata', 'name', default=name)))}(?:-[a-z0-9]+)*(?![a-z0-9])",
                "<group>",
                why,
            )
            degraded_groups.append(
                (name, str(nested(sg, "status", "reason", default="") or phase), masked, why)
            )
    return summaries, ready_groups, degraded_groups


def _suspension_phase(
    wanted: list[Any], by_group: dict[Any, Manifest], trainer: Manifest | None
) -> tuple[str, str, str]:
    """Suspended once every group and the trainer are at zero pods, else Suspending."""
    groups_down = all(nested(by_group.get(g), "status", "phase") == "Suspended" for g in wanted)
    t_pods = int(nested(trainer, "status", "replicas", default=0) or 0)
    if groups_down and t_pods == 0:
        return "Suspended", "Suspended", "suspended: samplers and trainer scaled to zero"
    return "Pending", "Suspending", "suspending: scaling samplers and trainer to zero"


def _degradation(
    job: Manifest,
    channel: Manifest | None,
    trainer_problem: PodProblem | None,
    degraded_groups: list[tuple[str, str, str, str]],
    channel_degraded: dict[str, Any] | None,
) -> tuple[str, str]:
    """(reason, message) of a Degraded job: every cause in the message, the first (trainer, groups,
    channel) as the reason."""
    parts = []
    if trainer_problem is not None:
        job_name = nested(job, "metadata", "name", default="")
        parts.append(f"trainer StatefulSet {n.trainer_name(job_name)}: {trainer_problem.message}")
    if degraded_groups:
        parts.append(f"degraded groups: {_merge_groups(degraded_groups)}")
    if channel_degraded is not None:
        parts.append(
            f"WeightChannel {nested(channel, 'metadata', 'name')}: {channel_degraded.get('message', '')}"
        )
    if trainer_problem is not None:
        reason = trainer_problem.reason
    elif degraded_groups:
        reason = "GroupsDegraded"
    else:
        assert channel_degraded is not None  # the third cause of a Degraded job
        reason = str(channel_degraded.get("reason") or "ChannelDegraded")
    return reason, "; ".join(parts)


def _job_conditions(phase: str, reason: str, message: str, generation: Any) -> list[dict[str, Any]]:
    """Ready, Progressing and Degraded of an RLJob."""
    blocked = phase in ("Degraded", "Failed")
    return [
        condition("Ready", phase == "Running", reason, message, generation),
        condition(  # a blocked job is not "Stable": it names the reason and leaves the text to Degraded
            "Progressing",
            phase == "Pending",
            reason if phase == "Pending" or blocked else "Stable",
            "blocked: see the Degraded condition" if blocked else message,
            generation,
        ),
        condition(
            "Degraded",
            phase in ("Degraded", "Failed"),
            reason if phase in ("Degraded", "Failed") else "AsExpected",
            message,
            generation,
        ),
    ]


def _merge_groups(degraded: list[tuple[str, str, str, str]]) -> str:
    """`a (Reason: message); b (...)`, groups with the same reason and message (their own object and pod
    names masked as `<group>`) merged into one entry: `a, b, c (Reason, each: message)`."""
    merged: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for name, reason, masked, message in degraded:
        merged.setdefault((reason, masked), []).append((name, message))
    out = []
    for (reason, message), members in merged.items():
        names = [name for name, _ in members]
        if len(members) == 1:  # alone: its own words, pod names included
            out.append(f"{names[0]} ({reason}: {members[0][1]})" if members[0][1] else names[0])
        else:
            out.append(f"{', '.join(names)} ({reason}, each: {message})" if message else ", ".join(names))
    return "; ".join(out)
