"""PURE status of a SamplerGroup (operator/status.py: the conventions): from the group, its Deployment, its
pods, its WeightChannel's status, the rebalance tick's figures for it and the one quarantine rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from rlfleet.api import SamplerGroupSpec
from rlfleet.api.common import FOREIGN_WEIGHTS_PREFIX, GROUP, SUBSCRIBERS_DIR
from rlfleet.catalog import Catalog, CatalogError, group_precision
from rlfleet.channel import SUBSCRIBER_STALE_AFTER_SECONDS
from rlfleet.operator import naming as n
from rlfleet.operator.model_shape import tensor_parallel_problem
from rlfleet.operator.pods import admission_wait, parse_time, workload_problem
from rlfleet.operator.status import Manifest, condition, merge_conditions, nested, now_iso, object_condition

ANN_QUARANTINED = f"{GROUP}/quarantined"
# A replica's engine served weights its sidecar had not applied (the channel's were applied again)
FOREIGN_WEIGHTS_REASON = "ForeignWeightVersion"
NO_REPORT_REASON = "NoSubscriberReport"
# SamplerGroup status fields that come from the rebalance tick (operator/rebalance.py GroupResult)
REBALANCE_FIELDS = ("tokensPerSecond", "share", "costPerHour", "egressCostPerHour", "costPer1MTokens", "kl", "oorFraction",
                    "tokenShare", "oorShare", "routingMismatch", "usableFraction", "invalidTokens", "shareHistory")  # fmt: skip


def quarantine_reason(
    sg: Manifest, collapse_quarantine: frozenset[str] = frozenset(), held: str | None = None
) -> str | None:
    """THE quarantine decision of a group (share 0, no new sessions), or None: `quarantine_source` of a
    SamplerGroup object (its `spec.quarantined`, which the RLJob's samplerGroups[].quarantined sets, and its
    annotation), the trainer's collapse detector with `safety.action: quarantine-group`
    (`collapse_quarantine`: group spec names) and the precision autopilot's `held` quarantine (decide.py)."""
    annotation = (nested(sg, "metadata", "annotations", default={}) or {}).get(ANN_QUARANTINED)
    return quarantine_source(
        bool(nested(sg, "spec", "quarantined")),
        annotation,
        nested(sg, "spec", "name") in collapse_quarantine,
        held,
    )


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
    ready = int(nested(deployment, "status", "readyReplicas", default=0) or 0)
    replicas = int(nested(deployment, "status", "replicas", default=0) or 0)
    updated = int(nested(deployment, "status", "updatedReplicas", default=0) or 0)
    dep_generation_seen = deployment is not None and nested(
        deployment, "status", "observedGeneration"
    ) == nested(deployment, "metadata", "generation")
    deadline = object_condition(deployment, "Progressing")
    stalled = bool(deadline and deadline.get("reason") == "ProgressDeadlineExceeded")
    failure = object_condition(deployment, "ReplicaFailure")
    replica_failure = bool(failure and failure.get("status") == "True")
    return _Rollout(
        desired=desired,
        ready=ready,
        replicas=replicas,
        updated=updated,
        suspended=suspended,
        scaled_to_zero=nested(deployment, "spec", "replicas") == 0,
        stalled=stalled,
        replica_failure=replica_failure,
        failure_message=(failure or deadline or {}).get("message", ""),
        rolled_out=dep_generation_seen and updated >= desired and ready >= desired and replicas <= desired,
    )


def samplergroup_status(
    sg: Manifest,
    deployment: Manifest | None,
    catalog: Catalog,
    channel_status: Manifest | None = None,
    now: str | None = None,
    pods: list[Manifest] | tuple[Manifest, ...] = (),
    rebalance: Manifest | None = None,
    quarantine: str | None = None,
) -> dict[str, Any]:
    """The whole status of a SamplerGroup from the SG, its Deployment, its pods (`pods.pod_view`s), its
    WeightChannel status, the rebalance tick's fields for it (`GroupResult.status_patch()`; None: not
    rebalanced since the operator started: the observed values are kept) and `quarantine_reason`."""
    now = now or now_iso()
    name = nested(sg, "metadata", "name", default="")
    generation = nested(sg, "metadata", "generation")
    spec = sg.get("spec", {})
    old = sg.get("status") or {}
    balanced = (
        {k: old[k] for k in REBALANCE_FIELDS if old.get(k) is not None}
        if rebalance is None
        else {k: rebalance[k] for k in REBALANCE_FIELDS if rebalance.get(k) is not None}
    )
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
    elif (
        sync_error
    ):  # the replicas keep serving the version they have (sampler/sync.py): say what they refused
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
    r: _Rollout,
    no_deployment: bool,
    name: str,
    spec: Manifest,
    pods: list[Manifest] | tuple[Manifest, ...],
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
        return (
            "Degraded",
            problem.reason,
            f"{ready}/{desired} replicas ready: Deployment {name}: {problem.message}",
        )
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
            if view == "mxfp4"
            else ""
        )
        return (
            f"waiting for version 0 of view {view} in channel {channel}: {why} "
            f"(the trainer publishes version 0 of every view before step 1){refused}"
        )[:1000]
    views = sorted({a.get("view") for a in channel_status.get("artifacts") or [] if a.get("view")})
    if view in (channel_status.get("loraBase") or {}):
        return None  # a LoRA job's base view, stored once at an earlier version (docs/weights.md, "LoRA")
    if view not in views:
        return (
            f"waiting for view {view} in channel {channel}: version {channel_status['latestVersion']} "
            f"has views {', '.join(views) or 'none'}"
        )
    return None
