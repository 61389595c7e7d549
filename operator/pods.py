"""PURE: the operator's pods as it observes them (a kopf index on pods with the operator's labels), and
WHY a pod is not running, from what the API server already says about it.

- `pod_view(body)`: the few fields the operator needs from a pod (the index stores these, not the pod):
  readiness and IP (the rebalancer scrapes and the router's replicas), the scheduler's PodScheduled
  condition, and each container's waiting / last-terminated reason.
- `pod_problem(pod)`: the first reason a pod cannot run, in the words of the component that knows:
  the scheduler's message for an unschedulable pod (a missing PersistentVolumeClaim is one: the
  scheduler's volume binding says `persistentvolumeclaim "x" not found`), the kubelet's waiting reason
  for a container that cannot start (CreateContainerConfigError: a missing Secret or ConfigMap;
  ErrImagePull / ImagePullBackOff; CrashLoopBackOff, with the container's name), and for a pod still
  creating its containers, the kubelet's latest FailedMount Event on it (a Secret or ConfigMap missing
  from a VOLUME shows only there: `MountVolume.SetUp failed for volume "v" : secret "s" not found`).
- `event_view(body)`: the fields of a core/v1 Event the operator keeps (kopf indexes keyed by the involved
  object's (namespace, name): Events carry no labels): the kubelet's FailedMount on a pod, the StatefulSet
  controller's FailedCreate on a trainer StatefulSet; `latest_event_message(views)`.
- `creation_failure(created, desired, message)`: the controller cannot create the pods of a workload (a
  ResourceQuota, a missing PriorityClass, an admission webhook), from its latest FailedCreate Event: the
  StatefulSet's counterpart of a Deployment's ReplicaFailure condition (a StatefulSet has none).
- `workload_problem(pods)`: the problem of a set of pods (a Deployment's or StatefulSet's), naming the pod.
- `admission_wait(pods, kueue_message)`: pods held by scheduling gates, e.g. Kueue's until it admits their
  Workload (a queue's quota), with Kueue's own words from its `Pending` Event on the Workload when known:
  not a problem (the pods are queued as asked), the reason a workload is still Pending.
Reasons are CamelCase (docs/operations.md, "Conditions and reasons").
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rlfleet.api.scheduling import KUEUE_QUEUE_LABEL
from rlfleet.operator import naming as n

MESSAGE_LIMIT = 900
KUEUE_ADMISSION_GATE = "kueue.x-k8s.io/admission"  # Kueue's scheduling gate until it admits the Workload

# kubelet waiting reasons -> the operator's reason
IMAGE_PULL = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
CONFIG_ERRORS = ("CreateContainerConfigError", "CreateContainerError")
_MISSING = re.compile(r'(persistentvolumeclaim|secret|configmap)s? "([^"]+)" not found', re.IGNORECASE)
_MISSING_REASON = {
    "persistentvolumeclaim": "MissingPersistentVolumeClaim",
    "secret": "MissingSecret",
    "configmap": "MissingConfigMap",
}


@dataclass(frozen=True)
class PodProblem:
    reason: str  # CamelCase
    message: str  # names the pod (and the container / missing object)


def pod_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a pod the operator uses (stored in its pod index)."""
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    labels = meta.get("labels") or {}
    spec = body.get("spec") or {}

    def containers(key: str) -> list[dict[str, Any]]:
        out = []
        for c in status.get(key) or []:
            state, last = c.get("state") or {}, c.get("lastState") or {}
            out.append(
                {
                    "name": c.get("name"),
                    "ready": bool(c.get("ready")),
                    "restartCount": int(c.get("restartCount") or 0),
                    "waiting": dict(state["waiting"]) if state.get("waiting") else None,
                    "startedAt": (state.get("running") or {}).get("startedAt"),
                    "terminated": _termination(state.get("terminated")),
                    "lastTerminated": _termination(last.get("terminated")),
                }
            )
        return out

    return {
        "name": meta.get("name"),
        "labels": {
            k: labels[k] for k in (n.LABEL_SAMPLERGROUP, n.LABEL_JOB, n.LABEL_COMPONENT) if k in labels
        },
        "deleting": bool(meta.get("deletionTimestamp")),
        "schedulingGates": [g.get("name") for g in spec.get("schedulingGates") or []],
        "kueueQueue": labels.get(KUEUE_QUEUE_LABEL),
        "phase": status.get("phase"),
        "podIP": status.get("podIP"),
        "conditions": [
            {k: c.get(k) for k in ("type", "status", "reason", "message")}
            for c in status.get("conditions") or []
        ],
        "initContainers": containers("initContainerStatuses"),
        "containers": containers("containerStatuses"),
    }


def _termination(terminated: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return {k: terminated.get(k) for k in ("reason", "exitCode", "message")} if terminated else None


def event_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of an Event the operator keeps: its message (clipped) and when it was last seen."""
    return {
        "message": _clip(body.get("message") or ""),
        "at": str(body.get("lastTimestamp") or body.get("eventTime") or body.get("firstTimestamp") or ""),
    }


def latest_event_message(views: Iterable[Mapping[str, Any]]) -> str | None:
    """The message of the newest of an object's Event views (RFC 3339 UTC times sort as text)."""
    newest = max(views, key=lambda v: str(v.get("at")), default=None)
    return str(newest["message"]) if newest and newest.get("message") else None


def creation_failure(created: int, desired: int, message: str | None) -> PodProblem | None:
    """Why a workload has fewer pods than it wants: its controller's latest FailedCreate message (e.g. `create
    Pod j-trainer-0 in StatefulSet j-trainer failed error: pods "j-trainer-0" is forbidden: exceeded quota:
    ...`), or None (no such Event, or every pod exists: an older Event no longer matters). The reason is
    the one a Deployment's controller gives the same refusal (`ReplicaFailure`)."""
    if not message or created >= desired:
        return None
    return PodProblem("ReplicaFailure", _clip(f"{created}/{desired} pods created: FailedCreate: {message}"))


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """A pod view that is Running, with an IP, Ready=True and not being deleted."""
    if pod.get("phase") != "Running" or not pod.get("podIP") or pod.get("deleting"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in pod.get("conditions") or [])


def _last_line(text: str | None) -> str:
    """The last non-empty line of a termination message (a traceback's last line is the error)."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _clip(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."


def _missing(reason: str, message: str) -> str:
    found = _MISSING.search(message or "")
    return _MISSING_REASON[found.group(1).lower()] if found else reason


def pod_problem(pod: Mapping[str, Any], crash_settle: CrashSettle | None = None) -> PodProblem | None:
    """Why this pod (a `pod_view`) cannot run, or None (running, or simply starting). `crash_settle`: see
    `CrashSettle` (None: a crash loop is reported only while the kubelet says CrashLoopBackOff)."""
    if pod.get("deleting") or pod.get("phase") == "Succeeded":
        return None
    return _unschedulable(pod) or _container_problem(pod, crash_settle) or _mount_problem(pod)


def _unschedulable(pod: Mapping[str, Any]) -> PodProblem | None:
    """The scheduler found no node for the pod (PodScheduled False, Unschedulable)."""
    for c in pod.get("conditions") or []:
        if (
            c.get("type") == "PodScheduled"
            and c.get("status") == "False"
            and c.get("reason") == "Unschedulable"
        ):
            message = c.get("message") or "no node fits"
            return PodProblem(
                _missing("Unschedulable", message),
                _clip(f"pod {pod.get('name')} cannot be scheduled: {message}"),
            )
    return None


def _container_problem(pod: Mapping[str, Any], crash_settle: CrashSettle | None) -> PodProblem | None:
    """The first (init) container waiting for a reason that will not clear by itself, or (with
    `crash_settle`) restarted after an error and not yet settled."""
    for kind, key in (("init container", "initContainers"), ("container", "containers")):
        for c in pod.get(key) or []:
            where = f"pod {pod.get('name')} {kind} {c.get('name')}"
            problem = _waiting_problem(c, where) or (
                _unsettled_crash(c, where, crash_settle) if crash_settle else None
            )
            if problem is not None:
                return problem
    return None


@dataclass(frozen=True)
class CrashSettle:
    """When a container that exited with an error still counts as crash-looping between the kubelet's
    CrashLoopBackOff waits: while it is terminated, while it is not ready, and for `seconds` after it
    started again. The kubelet resets its back-off only after 10 minutes of running (KubeletConfiguration's
    crash-loop back-off), and a container without a readiness probe (the trainer's) is Ready the moment
    it starts: without this, a trainer that fails a minute after each start reads Running/AllReady most of
    the time (docs/operations.md, "Conditions and reasons"). `progress_at`: when the workload last showed
    progress (the trainer's reported metrics last changed): progress after the restart settles it at once,
    so a trainer that trains again is not Degraded for the rest of the 10 minutes."""

    now: datetime
    seconds: float = 600.0
    progress_at: datetime | None = None


def _unsettled_crash(c: Mapping[str, Any], where: str, settle: CrashSettle) -> PodProblem | None:
    """A container whose last run ended in an error, and that is not running steadily since."""
    failed = c.get("terminated") or c.get("lastTerminated") or {}
    if not c.get("restartCount") and not c.get("terminated"):
        return None
    if not failed or failed.get("exitCode") in (0, None):
        return None
    started = parse_time(c.get("startedAt"))
    progressed = started is not None and settle.progress_at is not None and settle.progress_at > started
    steady = started is not None and (settle.now - started).total_seconds() >= settle.seconds
    settled = c.get("ready") and (steady or progressed)
    if settled:
        return None
    state = (
        "restarting"
        if c.get("terminated") or not c.get("startedAt")
        else f"running again since {c.get('startedAt')}"
    )
    said = _last_line(failed.get("message"))
    said = f"; it said: {said}" if said else ""
    return PodProblem(
        "CrashLoopBackOff",
        _clip(
            f"{where}: CrashLoopBackOff (exit: {failed.get('reason') or 'Error'}, code {failed.get('exitCode')}; "
            f"{c.get('restartCount', 0)} restarts; {state}){said}"
        ),
    )


def parse_time(text: Any) -> datetime | None:
    """An RFC 3339 time of the API server (or None)."""
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")) if text else None
    except ValueError:
        return None


def _waiting_problem(c: Mapping[str, Any], where: str) -> PodProblem | None:
    """A container waiting on an image pull, a config error, or a crash loop (with its last words)."""
    waiting = c.get("waiting") or {}
    reason, message = waiting.get("reason") or "", waiting.get("message") or ""
    if reason in IMAGE_PULL:
        return PodProblem("ImagePullError", _clip(f"{where}: {reason}: {message}".rstrip(": ")))
    if reason in CONFIG_ERRORS:
        return PodProblem(_missing(reason, message), _clip(f"{where}: {reason}: {message}".rstrip(": ")))
    if reason == "CrashLoopBackOff":
        last = c.get("lastTerminated") or {}
        exited = f" (last exit: {last.get('reason') or 'Error'}, code {last.get('exitCode')})" if last else ""
        said = _last_line(last.get("message"))  # the log's tail (FallbackToLogsOnError): the error
        said = f"; it said: {said}" if said else ""
        return PodProblem(
            "CrashLoopBackOff", _clip(f"{where}: CrashLoopBackOff{exited}: {message}".rstrip(": ") + said)
        )
    return None


def _mount_problem(pod: Mapping[str, Any]) -> PodProblem | None:
    """A pending pod whose volumes cannot mount because a Secret or ConfigMap is missing."""
    mount = pod.get("mountFailure")
    if mount and pod.get("phase") == "Pending" and _creating(pod):
        found = _MISSING.search(mount)
        if found and found.group(1).lower() in ("secret", "configmap"):
            return PodProblem(
                _MISSING_REASON[found.group(1).lower()], _clip(f"pod {pod.get('name')} FailedMount: {mount}")
            )
    return None


def _creating(pod: Mapping[str, Any]) -> bool:
    """Every container (init ones too) is still waiting to be created: the kubelet is setting up volumes."""
    statuses = [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]
    return bool(statuses) and all(
        (c.get("waiting") or {}).get("reason") in ("ContainerCreating", "PodInitializing") for c in statuses
    )


def workload_problem(
    pods: Iterable[Mapping[str, Any]], crash_settle: CrashSettle | None = None
) -> PodProblem | None:
    """The first problem among a workload's pods (by pod name, so the message is stable), saying how many
    other pods have the same reason (one line for the workload, not one per pod)."""
    ordered = sorted(pods, key=lambda p: str(p.get("name")))
    problems = [p for p in (pod_problem(pod, crash_settle) for pod in ordered) if p]
    if not problems:
        return None
    first, same = problems[0], sum(p.reason == problems[0].reason for p in problems[1:])
    if same:
        return PodProblem(
            first.reason,
            _clip(f"{first.message} (and {same} more pod{'s' if same > 1 else ''}: {first.reason})"),
        )
    return first


def admission_wait(pods: Iterable[Mapping[str, Any]], kueue_message: str | None = None) -> PodProblem | None:
    """Why pods that exist are not scheduled yet although nothing is wrong: scheduling gates (the scheduler
    skips a gated pod). Kueue's gate names the LocalQueue (the pod's queue label) and, with
    `kueue_message` (the latest `Pending` Event of the pods' Workload), Kueue's reason, e.g. `insufficient
    quota for nvidia.com/gpu in flavor on-demand ...`. None: no pod is gated."""
    gated = sorted(
        (p for p in pods if p.get("schedulingGates") and not p.get("deleting")),
        key=lambda p: str(p.get("name")),
    )
    if not gated:
        return None
    names = ", ".join(str(p.get("name")) for p in gated)
    pods_word = f"pod{'s' if len(gated) > 1 else ''} {names}"
    first = gated[0]
    if KUEUE_ADMISSION_GATE in first["schedulingGates"]:
        queue = first.get("kueueQueue")
        where = f" from LocalQueue {queue}" if queue else ""
        said = f": Kueue: {kueue_message}" if kueue_message else ""
        return PodProblem(
            "WaitingForAdmission",
            _clip(
                f"{pods_word} wait{'' if len(gated) > 1 else 's'} for Kueue to admit {'their' if len(gated) > 1 else 'its'} "
                f"Workload{where} (scheduling gate {KUEUE_ADMISSION_GATE}){said}"
            ),
        )
    gates = ", ".join(str(g) for g in first["schedulingGates"])
    return PodProblem("SchedulingGated", _clip(f"{pods_word} held by scheduling gates: {gates}"))


def workload_crash(pods: Iterable[Mapping[str, Any]], settle: CrashSettle) -> PodProblem | None:
    """A Ready workload's crash loop (the first by pod name): a container restarted after an error and
    not yet settled (`CrashSettle`). A Ready workload's other past problems no longer matter."""
    for pod in sorted(pods, key=lambda p: str(p.get("name"))):
        if pod.get("deleting"):
            continue
        for c in pod.get("containers") or []:
            problem = _unsettled_crash(c, f"pod {pod.get('name')} container {c.get('name')}", settle)
            if problem is not None:
                return problem
    return None
