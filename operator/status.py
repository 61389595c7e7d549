"""PURE status computation: everything the operator observed -> the WHOLE status of an object.

One writer per resource (docs/architecture.md, "Operator"): the reconcile pipeline observes (kopf
indexes of the objects and of the operator's pods, plus the rebalance tick's scrapes held in memory),
calls these functions, and applies the result once under one field manager (`STATUS_FIELD_MANAGER`).
So every status field, the rebalancer's shares and the trainer's step included, comes out of here; a
field the pipeline has not observed yet (after a restart, before the first rebalance) is carried over
from the observed status, never dropped.

Conventions (KubeRay / LWS): a phase plus Ready / Progressing / Degraded conditions, each with
observedGeneration, a CamelCase reason and a message; lastTransitionTime changes only when a
condition's status changes; the pipeline writes status only when `status_changed` says so. Degraded
says WHY and names the object: the scheduler's message for an unschedulable pod or a missing PVC, the
kubelet's reason for a missing Secret, an image that does not pull or a crash loop (`pods.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from rlfleet.api import SamplerGroupSpec
from rlfleet.api.common import FOREIGN_WEIGHTS_PREFIX, GROUP, SUBSCRIBERS_DIR
from rlfleet.catalog import Catalog, CatalogError, group_precision
from rlfleet.channel import SUBSCRIBER_STALE_AFTER_SECONDS
from rlfleet.operator import naming as n
from rlfleet.operator.model_shape import tensor_parallel_problem
from rlfleet.operator.pods import (
    CrashSettle,
    PodProblem,
    admission_wait,
    creation_failure,
    parse_time,
    workload_crash,
    workload_problem,
)

Manifest = dict[str, Any]
OPERATOR_CONDITIONS = ("Ready", "Progressing", "Degraded")
ANN_QUARANTINED = f"{GROUP}/quarantined"
# A replica's engine served weights its sidecar had not applied (the channel's were applied again)
FOREIGN_WEIGHTS_REASON = "ForeignWeightVersion"
NO_REPORT_REASON = "NoSubscriberReport"
# SamplerGroup status fields that come from the rebalance tick (operator/rebalance.py GroupResult)
REBALANCE_FIELDS = ("tokensPerSecond", "share", "costPerHour", "egressCostPerHour", "costPer1MTokens", "kl", "oorFraction",
                    "tokenShare", "oorShare", "routingMismatch", "usableFraction", "invalidTokens", "shareHistory")  # fmt: skip
# RLJob status fields that come from the rebalance tick (fleet cost) and the trainer's exporter
JOB_COST_FIELDS = ("costPer1MTokens", "baselineCostPer1MTokens", "savingPercent", "baselineSource")
# A condition's message and an RLJob's status.message stay short: `kubectl describe` and Argo CD show them
# whole, and one reason repeated per group and per condition made a 10 KB status (identical reasons of
# groups are merged instead, `_merge_groups`).
MESSAGE_LIMIT = 1024


def now_iso(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def clip(text: str, limit: int = MESSAGE_LIMIT) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def condition(type_: str, ok: bool, reason: str, message: str, generation: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": clip(message),
    }
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def merge_conditions(
    old: list[dict[str, Any]] | None, new: list[dict[str, Any]], now: str
) -> list[dict[str, Any]]:
    """`new` conditions with lastTransitionTime kept from `old` when the status did not change."""
    previous = {c.get("type"): c for c in old or []}
    out = []
    for c in new:
        prev = previous.get(c["type"])
        ltt = prev.get("lastTransitionTime") if prev and prev.get("status") == c["status"] else None
        out.append({**c, "lastTransitionTime": ltt or now})
    return out


def _get(d: Any, *path: str, default: Any = None) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


def _deployment_condition(deployment: Manifest | None, type_: str) -> dict[str, Any] | None:
    for c in _get(deployment, "status", "conditions", default=[]) or []:
        if c.get("type") == type_:
            return c
    return None


def quarantine_reason(sg: Manifest, collapse_quarantine: frozenset[str] = frozenset(), held: str | None = None) -> str | None:
    """THE quarantine decision of a group (share 0, no new sessions), or None: `quarantine_source` of a
    SamplerGroup object (its `spec.quarantined`, which the RLJob's samplerGroups[].quarantined sets, and its
    annotation), the trainer's collapse detector with `safety.action: quarantine-group`
    (`collapse_quarantine`: group spec names) and the precision autopilot's `held` quarantine (decide.py)."""
    annotation = (_get(sg, "metadata", "annotations", default={}) or {}).get(ANN_QUARANTINED)
    return quarantine_source(bool(_get(sg, "spec", "quarantined")), annotation,
                             _get(sg, "spec", "name") in collapse_quarantine, held)  # fmt: skip


def quarantine_source(spec: bool, annotation: str | None, collapse: bool, held: str | None) -> str | None:
    """Which source quarantines a group, the first that holds (None: none): the spec, the annotation
    `rlfleet.dev/quarantined: "true"` (on call: `kubectl annotate sg/...`), the collapse detector, the
    precision autopilot's held quarantine (`held`: its reason)."""
    if spec:
        return "spec.quarantined"
    if annotation == "true":
        return f"annotation {ANN_QUARANTINED}"
    if collapse:
        return "the trainer's collapse detector"
    if held is not None:
        return f"the precision autopilot: {held}"
    return None


@dataclass(frozen=True)
class _Rollout:
    """What a SamplerGroup's Deployment says about its rollout."""

    desired: int  # 0 while suspended
    ready: int
    replicas: int
    updated: int
    suspended: bool
    scaled_to_zero: bool  # spec.replicas 0 on the Deployment
    stalled: bool  # Progressing: ProgressDeadlineExceeded
    replica_failure: bool  # ReplicaFailure True
    failure_message: str  # the message of either of those conditions
    rolled_out: bool


def _rollout(spec: Manifest, deployment: Manifest | None) -> _Rollout:
    suspended = bool(spec.get("suspend"))
    desired = 0 if suspended else int(spec.get("replicas", 1))
    ready = int(_get(deployment, "status", "readyReplicas", default=0) or 0)
    replicas = int(_get(deployment, "status", "replicas", default=0) or 0)
    updated = int(_get(deployment, "status", "updatedReplicas", default=0) or 0)
    dep_generation_seen = deployment is not None and _get(deployment, "status", "observedGeneration") == _get(
        deployment, "metadata", "generation"
    )
    deadline = _deployment_condition(deployment, "Progressing")
    stalled = bool(deadline and deadline.get("reason") == "ProgressDeadlineExceeded")
    failure = _deployment_condition(deployment, "ReplicaFailure")
    replica_failure = bool(failure and failure.get("status") == "True")
    return _Rollout(
        desired=desired,
        ready=ready,
        replicas=replicas,
        updated=updated,
        suspended=suspended,
        scaled_to_zero=_get(deployment, "spec", "replicas") == 0,
        stalled=stalled,
        replica_failure=replica_failure,
        failure_message=(failure or deadline or {}).get("message", ""),
        rolled_out=dep_generation_seen and updated >= desired and ready >= desired and replicas <= desired,
    )


def samplergroup_status(sg: Manifest, deployment: Manifest | None, catalog: Catalog,
                        channel_status: Manifest | None = None, now: str | None = None,
                        pods: list[Manifest] | tuple[Manifest, ...] = (), rebalance: Manifest | None = None,
                        quarantine: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The whole status of a SamplerGroup from the SG, its Deployment, its pods (`pods.pod_view`s), its
    WeightChannel status, the rebalance tick's fields for it (`GroupResult.status_patch()`; None: not
    rebalanced since the operator started: the observed values are kept) and `quarantine_reason`."""
    now = now or now_iso()
    name = _get(sg, "metadata", "name", default="")
    generation = _get(sg, "metadata", "generation")
    spec = sg.get("spec", {})
    old = sg.get("status") or {}
    balanced = {k: old[k] for k in REBALANCE_FIELDS if old.get(k) is not None} if rebalance is None else {
        k: rebalance[k] for k in REBALANCE_FIELDS if rebalance.get(k) is not None
    }  # fmt: skip
    r = _rollout(spec, deployment)
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "replicas": r.replicas,
        "readyReplicas": r.ready,
        "ready": f"{r.ready}/{r.desired}",
        "selector": n.selector_string(n.sampler_selector(name)),
        **balanced,
        "quarantined": quarantine is not None,
    }
    # What runs where, and whether the precision is degraded on this class.
    try:
        _place(status, spec, catalog, channel_status)
    except (CatalogError, ValueError) as exc:  # a class the runtime catalog cannot run, a TP the model cannot
        message = _invalid_spec_message(exc)
        status.update(
            phase="Failed",
            reason="InvalidSpec",
            message=message,
            conditions=merge_conditions(
                old.get("conditions"),
                [
                    condition("Ready", False, "InvalidSpec", message, generation),
                    condition("Progressing", False, "InvalidSpec", message, generation),
                    condition("Degraded", True, "InvalidSpec", message, generation),
                ],
                now,
            ),
        )
        return status
    # Weight version of the group, from the channel status (sidecars report into the store).
    sync_error = _weight_sync(status, channel_status, name)
    phase, reason, message = _group_phase(r, deployment is None, name, spec, pods, channel_status)
    if quarantine is not None and phase == "Running":
        phase, message = "Quarantined", f"{message}; quarantined by {quarantine} (no new sessions)"
    if status.get("degradedPrecision"):
        message += f"; {spec.get('weightFormat')} runs degraded on {spec.get('accelerator')}: {status['precisionNote']}"
    foreign = sync_error is not None and sync_error.startswith(FOREIGN_WEIGHTS_PREFIX)
    silent = silent_replicas(pods, channel_status, name, now)
    synced: tuple[bool, str, str] = (True, "AsExpected", "no replica reports a failing weight sync")
    if foreign:  # another client loaded weights into an engine; its sidecar applied the channel's again
        message += f"; {sync_error}"
        reason = FOREIGN_WEIGHTS_REASON if phase == "Running" else reason
        synced = (True, FOREIGN_WEIGHTS_REASON, str(sync_error))
    elif sync_error:  # the replicas keep serving the version they have (sampler/sync.py): say what they refused
        message += f"; weight sync failing (serving v{status.get('appliedWeightVersion')}): {sync_error}"
        synced = (False, "SyncFailing", sync_error)
    elif silent:  # serving, but invisible to retention and VERSION/LAG: say which pod and where to look
        note = silent_replicas_message(silent, name)
        message += f"; {note}"
        reason = NO_REPORT_REASON if phase == "Running" else reason
        synced = (False, NO_REPORT_REASON, note)
    status["phase"] = phase
    status["reason"] = reason
    status["message"] = message[:4096]
    # share is 0..1; the printer column shows it as a percentage
    if status.get("share") is not None:
        status["sharePercent"] = round(100.0 * float(status["share"]), 1)
    status["conditions"] = merge_conditions(
        old.get("conditions"), _group_conditions(r, phase, reason, message, synced, generation), now
    )
    return status


def _place(status: dict[str, Any], spec: Manifest, catalog: Catalog, channel_status: Manifest | None) -> None:
    """Write the accelerator class the group runs on and its precision into `status`; then ValueError
    when the model's heads cannot be split over the group's tensorParallel (CatalogError /
    ValidationError from the spec before anything is written)."""
    precision = group_precision(SamplerGroupSpec.model_validate(spec), catalog)
    status.update(
        selectedAccelerator=precision.accelerator,
        selectionReason=precision.selection_reason[:1024],
        degradedPrecision=precision.degraded,
        precisionNote=precision.note,
    )
    tensor_parallel = spec.get("tensorParallel") or catalog.get(precision.accelerator).default_tensor_parallel
    misfit = tensor_parallel_problem((channel_status or {}).get("model"), int(tensor_parallel))
    if misfit is not None:
        raise ValueError(misfit)


def _invalid_spec_message(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())[:1000]
    return str(exc).splitlines()[0][:1000]


def _weight_sync(status: dict[str, Any], channel_status: Manifest | None, name: str) -> str | None:
    """Copy the group's applied version, lag and sync failures from the channel status into `status`;
    returns a replica's weight sync error now (its subscriber report says why), or None."""
    sync_error: str | None = None
    for g in (channel_status or {}).get("groups") or []:
        if g.get("group") == name:
            if g.get("appliedVersion") is not None:
                status["appliedWeightVersion"] = g["appliedVersion"]
            if g.get("lag") is not None:
                status["versionLag"] = g["lag"]
            if g.get("syncFailures"):
                status["weightSyncFailures"] = g["syncFailures"]
            sync_error = g.get("lastError")
    return sync_error


def _group_phase(
    r: _Rollout, no_deployment: bool, name: str, spec: Manifest, pods: list[Manifest] | tuple[Manifest, ...],
    channel_status: Manifest | None,
) -> tuple[str, str, str]:
    """(phase, reason, message) of the group's rollout, before quarantine and notes are added."""
    ready, desired = r.ready, r.desired
    if r.suspended:
        if r.replicas == 0 and r.scaled_to_zero:
            return "Suspended", "Suspended", "suspended: scaled to zero (spec.replicas kept)"
        return "Pending", "Suspending", f"suspending: {r.replicas} pods left"
    if no_deployment:
        return "Pending", "Creating", "creating the Deployment"
    if r.stalled or r.replica_failure:
        reason = "ReplicaFailure" if r.replica_failure else "ProgressDeadlineExceeded"
        return "Degraded", reason, f"{ready}/{desired} replicas ready: {r.failure_message}"[:1000]
    if ready >= desired:
        return "Running", "AllReplicasReady", f"{ready}/{desired} replicas ready"
    if (problem := workload_problem(pods)) is not None:
        return "Degraded", problem.reason, f"{ready}/{desired} replicas ready: Deployment {name}: {problem.message}"
    message = f"{ready}/{desired} replicas ready"
    if (queued := admission_wait(pods)) is not None:  # e.g. Kueue's gate: queued for quota, not broken
        return "Pending", queued.reason, f"{message}: Deployment {name}: {queued.message}"
    waiting = weights_wait_reason(spec, channel_status)
    if waiting is not None:
        return "Pending", "WaitingForWeights", f"{message}: {waiting}"
    return "Pending", "ReplicasNotReady", message


def _group_conditions(
    r: _Rollout, phase: str, reason: str, message: str, synced: tuple[bool, str, str], generation: Any
) -> list[dict[str, Any]]:
    """Ready, Progressing, Degraded and WeightsSynced of a SamplerGroup; `synced` is WeightsSynced's
    (status, reason, message): True after a foreign weight load (its sidecar applied the channel's version
    again; the reason says so until a newer version is applied), False while a sync fails or a replica
    cannot write its report."""
    return [
        condition("Ready", phase in ("Running", "Quarantined"), reason, message, generation),
        condition(
            "Progressing",
            not r.suspended and not r.rolled_out and not r.stalled,
            "RollingOut"
            if not r.rolled_out and not r.suspended
            else ("Suspended" if r.suspended else "RolledOut"),
            f"{r.updated}/{r.desired} updated, {r.ready}/{r.desired} ready",
            generation,
        ),
        condition(
            "Degraded",
            phase == "Degraded",
            reason if phase == "Degraded" else "AsExpected",
            message,
            generation,
        ),
        condition("WeightsSynced", synced[0], synced[1], synced[2][:1024], generation),
    ]


def silent_replicas(
    pods: list[Manifest] | tuple[Manifest, ...], channel_status: Manifest | None, group: str, now: str
) -> list[str]:
    """The group's pods whose weight-sync sidecar has run for SUBSCRIBER_STALE_AFTER_SECONDS and is ready,
    yet have no fresh subscriber report in the channel's status (its `groups[].replicas`): their report
    writes fail (a store they cannot write, S3 credentials without PutObject on subscribers/). A live
    sidecar writes one at start and every 30 s and the channel is read every 10 s, so within that window
    every writing sidecar is listed. Judged only on a channel status read from the store (phase Ready)."""
    if not channel_status or channel_status.get("phase") != "Ready":
        return []
    reporting: set[str] = set()
    for g in channel_status.get("groups") or []:
        if g.get("group") == group:
            reporting = set(g.get("replicas") or [])
    at = parse_time(now)
    silent = []
    for pod in pods:
        sync = next((c for c in pod.get("containers") or [] if c.get("name") == n.SYNC_CONTAINER), None)
        started = parse_time(sync.get("startedAt")) if sync and sync.get("ready") else None
        if pod.get("deleting") or started is None or at is None or pod.get("name") in reporting:
            continue
        if (at - started).total_seconds() >= SUBSCRIBER_STALE_AFTER_SECONDS:
            silent.append(str(pod.get("name")))
    return sorted(silent)


def silent_replicas_message(silent: list[str], group: str) -> str:
    more = f" (and {len(silent) - 1} more)" if len(silent) > 1 else ""
    return (
        f"no subscriber report from pod {silent[0]}{more} for {SUBSCRIBER_STALE_AFTER_SECONDS:.0f}s: its "
        f"weight-sync sidecar cannot write {SUBSCRIBERS_DIR}/{group}/ in the store, so retention does not "
        f"see the version it serves (kubectl logs {silent[0]} -c {n.SYNC_CONTAINER})"
    )


def weights_wait_reason(spec: Manifest, channel_status: Manifest | None) -> str | None:
    """Why a group's pods cannot start SGLang yet, from the WeightChannel status (None: they can).

    Sampler pods launch from the newest published version of their own view (their init container
    waits for it), so until the channel has one the group cannot become ready; say so."""
    channel = spec.get("weightChannel")
    if not channel:
        return None
    view = spec.get("weightFormat", "bf16")
    if not channel_status:
        return f"waiting for version 0 of view {view} in channel {channel} (channel status not read yet)"
    if channel_status.get("latestVersion") is None:
        why = channel_status.get("message") or "nothing published yet"
        refused = (  # its refusal is the trainer's exit message, in the RLJob's status (CrashLoopBackOff)
            "; the trainer refuses an mxfp4 view of a dense or Qwen3-family model before publishing anything "
            "(docs/weights.md): see the RLJob's status"
            if view == "mxfp4" else ""
        )  # fmt: skip
        return (
            f"waiting for version 0 of view {view} in channel {channel}: {why} "
            f"(the trainer publishes version 0 of every view before step 1){refused}"
        )[:1000]
    views = sorted({a.get("view") for a in channel_status.get("artifacts") or [] if a.get("view")})
    if view not in views:
        return (
            f"waiting for view {view} in channel {channel}: version {channel_status['latestVersion']} "
            f"has views {', '.join(views) or 'none'}"
        )
    return None


def _cond(obj: Manifest, type_: str) -> dict[str, Any] | None:
    for c in _get(obj, "status", "conditions", default=[]) or []:
        if c.get("type") == type_:
            return c
    return None


def _owned_by_block(spec: Manifest, old: Manifest, block: str, key: str, value: Manifest | None) -> dict[str, Any]:
    """A status field of an opt-in `router.<block>` (fleetPlan: the optimizer; precisionAutopilot: the
    autopilot) while the block is enabled: this operator's value, else the observed one (after a
    restart); none when the block is off."""
    if not _get(spec, "router", block, "enabled"):
        return {}
    return _kept(old, key, value)


def _kept(old: Manifest, key: str, value: Manifest | None) -> dict[str, Any]:
    """A status field from this operator's `value`, else the observed one (after a restart); none if neither."""
    current = value if value is not None else old.get(key)
    return {key: current} if current is not None else {}


def rljob_status(job: Manifest, groups: list[Manifest], trainer: Manifest | None, channel: Manifest | None,
                 now: str | None = None, invalid: str | None = None,
                 trainer_pods: list[Manifest] | tuple[Manifest, ...] = (), costs: Manifest | None = None,
                 trainer_report: Manifest | None = None,
                 trainer_create_failure: str | None = None, fleet_plan: Manifest | None = None,
                 precision_autopilot: Manifest | None = None,
                 trainer_admission: str | None = None, decisions: Manifest | None = None) -> dict[str, Any]:  # fmt: skip
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
    generation = _get(job, "metadata", "generation")
    old = job.get("status") or {}
    spec = job.get("spec", {})
    suspended = bool(spec.get("suspend"))
    wanted = [g.get("name") for g in spec.get("samplerGroups", [])]
    by_group = {_get(g, "spec", "name"): g for g in groups}
    summaries, ready_groups, degraded_groups = _group_summaries(wanted, by_group)
    t_desired = 0 if suspended else int(_get(spec, "trainer", "replicas", default=1))
    t_ready = int(_get(trainer, "status", "readyReplicas", default=0) or 0)
    trainer_ready = trainer is not None and t_ready >= t_desired
    trainer_problem: PodProblem | None = None
    if not suspended:
        created = int(_get(trainer, "status", "replicas", default=0) or 0)
        # a trainer that crashes a while after each start is Ready (no readiness probe) between crashes:
        # CrashSettle keeps it Degraded until it runs steadily or reports new metrics (operator/pods.py)
        reported = [parse_time(_get(source, "metrics", "updatedAt")) for source in (old, trainer_report or {})]
        settle = CrashSettle(now=parse_time(now) or datetime.now(UTC),
                             progress_at=max((t for t in reported if t is not None), default=None))  # fmt: skip
        if trainer_ready:
            trainer_problem = workload_crash(trainer_pods, settle)
        else:
            trainer_problem = (creation_failure(created, t_desired, trainer_create_failure) if trainer is not None
                               else None) or workload_problem(trainer_pods, settle)  # fmt: skip
    channel_degraded = _cond(channel or {}, "Degraded")
    if channel_degraded is not None and channel_degraded.get("status") != "True":
        channel_degraded = None
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "readyGroups": f"{ready_groups}/{len(wanted)}",
        "groups": summaries,
        "trainer": {"replicas": t_desired, "readyReplicas": t_ready, "ready": f"{t_ready}/{t_desired}"},
    }
    observed_costs = {k: old[k] for k in JOB_COST_FIELDS if old.get(k) is not None}
    status.update(observed_costs if costs is None else {k: costs[k] for k in JOB_COST_FIELDS if costs.get(k) is not None})
    status.update(_owned_by_block(spec, old, "optimize", "fleetPlan", fleet_plan))
    status.update(_owned_by_block(spec, old, "autopilot", "precisionAutopilot", precision_autopilot))
    status.update(_kept(old, "decisions", decisions))
    report = dict(trainer_report or {})
    report_conditions = report.pop("conditions", [])
    status.update(report)
    latest = _get(channel, "status", "latestVersion")
    if latest is not None or report.get("weightVersion") is not None:
        # the channel's pointer or the trainer's report, whichever is newer (never lowered)
        status["weightVersion"] = max(v for v in (latest, report.get("weightVersion")) if v is not None)
    complete = next((c for c in report_conditions if c.get("type") == "Complete" and c.get("status") == "True"), None)
    if invalid:
        phase, reason, message = "Failed", "InvalidSpec", invalid
    elif complete is not None and not suspended:
        phase, reason = "Succeeded", "TrainingFinished"
        message = (f"{complete.get('message', 'training finished')}; the sampler groups keep running until the "
                   "RLJob is deleted or suspended (spec.suspend: true)")  # fmt: skip
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
        phase, reason, message = _pending(job, f"{ready_groups}/{len(wanted)} groups ready, trainer {t_ready}/{t_desired}", queued)
    message = clip(message)
    status.update(phase=phase, reason=reason, message=message)
    conditions = _job_conditions(phase, reason, message, generation)
    status["conditions"] = merge_conditions(old.get("conditions"), conditions, now) + [
        dict(c) for c in report_conditions  # CollapseRisk: its transition time is kept by trainer_report.py
    ]
    return status


def _pending(job: Manifest, progress: str, queued: PodProblem | None) -> tuple[str, str, str]:
    """(phase, reason, message) of a job on its way: `queued` (pods.admission_wait) when scheduling gates
    hold the trainer's pods, e.g. Kueue's until the queue has the quota for the whole gang."""
    if queued is None:
        return "Pending", "Reconciling", progress
    trainer = n.trainer_name(str(_get(job, "metadata", "name", default="")))
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
        phase = _get(sg, "status", "phase")
        stale = sg is None or _get(sg, "status", "observedGeneration") != _get(sg, "metadata", "generation")
        entry: dict[str, Any] = {"name": name, "phase": phase or "Pending"}
        if _get(sg, "status", "ready") is not None:
            entry["ready"] = _get(sg, "status", "ready")
        if _get(sg, "status", "share") is not None:
            entry["share"] = _get(sg, "status", "share")
        summaries.append(entry)
        if not stale and phase in ("Running", "Quarantined"):
            ready_groups += 1
        if phase in ("Degraded", "Failed"):
            why = str(_get(sg, "status", "message", default="") or "")
            masked = re.sub(rf"\b{re.escape(str(_get(sg, 'metadata', 'name', default=name)))}(?:-[a-z0-9]+)*(?![a-z0-9])", "<group>", why)
            degraded_groups.append((name, str(_get(sg, "status", "reason", default="") or phase), masked, why))
    return summaries, ready_groups, degraded_groups


def _suspension_phase(wanted: list[Any], by_group: dict[Any, Manifest], trainer: Manifest | None) -> tuple[str, str, str]:
    """Suspended once every group and the trainer are at zero pods, else Suspending."""
    groups_down = all(_get(by_group.get(g), "status", "phase") == "Suspended" for g in wanted)
    t_pods = int(_get(trainer, "status", "replicas", default=0) or 0)
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
        job_name = _get(job, "metadata", "name", default="")
        parts.append(f"trainer StatefulSet {n.trainer_name(job_name)}: {trainer_problem.message}")
    if degraded_groups:
        parts.append(f"degraded groups: {_merge_groups(degraded_groups)}")
    if channel_degraded is not None:
        parts.append(f"WeightChannel {_get(channel, 'metadata', 'name')}: {channel_degraded.get('message', '')}")
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
            "Progressing", phase == "Pending", reason if phase == "Pending" or blocked else "Stable",
            "blocked: see the Degraded condition" if blocked else message, generation,
        ),
        condition(
            "Degraded",
            phase in ("Degraded", "Failed"),
            reason if phase in ("Degraded", "Failed") else "AsExpected",
            message,
            generation,
        ),  # fmt: skip
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


def weightchannel_status(
    wc: Manifest, channel: Any | None, error: str | None, now: str | None = None, model: Manifest | None = None
) -> dict[str, Any]:
    """Status of a WeightChannel from `rlfleet.channel.read_channel_status(...)` (or the error reading it)
    and the published model's head counts (`model_shape.model_shape`; None: not read now, the observed
    ones are kept). Per view of the latest version: anchor or delta, stored and complete bytes; and the
    bytes stored for the version over its complete views in % (`kubectl get wc`'s Stored%)."""
    now = now or now_iso()
    generation = _get(wc, "metadata", "generation")
    old = wc.get("status") or {}
    status: dict[str, Any] = {"observedGeneration": generation}
    if model or old.get("model"):
        status["model"] = model or old["model"]
    unreachable: str | None = None
    if channel is None:
        message = f"latest version unknown: {error or 'store not readable from the operator'}"[:4096]
        status.update(phase="Pending", message=message)
        ok, reason = False, "StoreUnreadable"
        unreachable = f"store {store_description(wc)} unreachable from the operator: {error or 'not readable'}"
    else:
        latest = channel.latest_version
        status["artifacts"] = [
            {
                k: v
                for k, v in {
                    "view": a.view,
                    "version": a.version,
                    "uri": a.uri,
                    "sha256": a.sha256,
                    "bytes": a.bytes,
                    "time": a.time,
                    "kind": a.kind,
                    "storedBytes": a.stored_bytes,
                    "base": a.base,
                }.items()
                if v is not None
            }  # fmt: skip
            for a in channel.artifacts
        ][:16]
        share = channel.stored_share
        if share is not None:
            status["storedPercent"] = round(100.0 * share, 3)
        status["groups"] = [
            {
                k: v
                for k, v in {
                    "group": g.group,
                    "view": g.view,
                    "appliedVersion": g.applied_version,
                    "lag": g.lag,
                    "syncFailures": g.sync_failures or None,
                    "lastError": g.last_error[:512] if g.last_error else None,
                    "replicas": sorted(g.replicas)[:256] or None,
                }.items()
                if v is not None
            }  # fmt: skip
            for g in channel.groups
        ][:64]
        if latest is None:
            status.update(phase="Pending", message="no version published yet")
            ok, reason = False, "NothingPublished"
        else:
            status.update(phase="Ready", latestVersion=latest, message=f"version {latest} published")
            ok, reason = True, "Published"
    status["conditions"] = merge_conditions(
        old.get("conditions"),
        [
            condition("Ready", ok, reason, status["message"], generation),
            condition("Degraded", unreachable is not None, "StoreUnreachable" if unreachable else "AsExpected",
                      (unreachable or "store readable")[:4096], generation),  # fmt: skip
        ],
        now,
    )
    return status


def store_description(wc: Manifest) -> str:
    """The channel's store in words (names the object a Degraded condition is about)."""
    store = _get(wc, "spec", "store", default={}) or {}
    if store.get("type") == "s3":
        return f"s3://{store.get('bucket', '')}/{store.get('prefix', '')}".rstrip("/")
    return f"{store.get('type', 'filesystem')} {store.get('path', '')}".strip()


def _strip_times(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_times(v) for k, v in value.items() if k != "lastTransitionTime"}
    if isinstance(value, list):
        return [_strip_times(v) for v in value]
    return value


def status_changed(observed: Manifest | None, desired: dict[str, Any]) -> bool:
    """True when any operator-owned field differs from the observed status (transition times ignored;
    conditions owned by others, e.g. CollapseRisk on a SamplerGroup, are not compared)."""
    observed = observed or {}
    for key, value in desired.items():
        have = observed.get(key)
        if key == "conditions":
            mine = {c["type"] for c in value}
            have = [c for c in have or [] if c.get("type") in mine]
            if _strip_times(sorted(have, key=lambda c: c["type"])) != _strip_times(
                sorted(value, key=lambda c: c["type"])
            ):
                return True
        elif _strip_times(have) != _strip_times(value):
            return True
    return False
