"""kopf handlers (thin): per resource ONE reconcile pipeline, KubeRay-shaped (docs/architecture.md):

    observe (kopf indexes + the rebalance tick's scrapes) -> pure compute (builders.py: children;
    rebalance.py: shares; status.py: the WHOLE status) -> apply once (one field manager per write kind)

- Observe: in-memory kopf indexes of the watched objects (RLJobs, SamplerGroups, WeightChannels, sampler
  Deployments, trainer StatefulSets, the operator's pods: `pods.pod_view`, and the kubelet's FailedMount
  Events by pod and the FailedCreate Events of StatefulSets: `pods.event_view`) replace list/get round
  trips; the rebalance tick (`rebalancer.rebalance_job`) adds what only a scrape can see
  (throughput, the trainer's report) and keeps it in memory.
- RLJob create/update(spec)/resume (`reconcile_job`) -> server-side apply of every child (owner
  references, common labels), deletion of SamplerGroups no longer in the spec, then the job's status
  pipeline. A child of a live job deleted by someone else runs it again (`heal_job`).
- SamplerGroup create/update(spec)/resume (`reconcile_group`) -> its Deployment + Service, then its
  status pipeline. Its Deployment deleted by someone else runs it again (`heal_group`).
- Status pipeline (`refresh_job_status`, `refresh_samplergroup_status`, `refresh_weightchannel_status`):
  the whole status from the indexes and the tick's memory, written by server-side apply on the status
  subresource as `STATUS_FIELD_MANAGER` (the only status writer), only when it changed, with a
  Kubernetes Event on each phase (and CollapseRisk) transition. Events of children and pods (and a
  FailedMount Event on a pod) re-run it.
- One timer, on each job's WeightChannel (kopf puts a finalizer on objects with timers; RLJobs must
  delete without the operator): it reads the channel's store, runs the rebalance tick, and re-runs the
  same pipelines. It writes nothing to the API itself.
- WeightChannel pipeline (`refresh_weightchannel_status`): observe (the sampler pods in the pod index,
  then the store: pointer, manifest, subscriber reports) -> pure compute (`channel.group_versions`
  with the age-out bound, `channel.subscribers_to_remove`, `status.weightchannel_status`) -> apply (the
  reports of gone replicas removed from the store with `WeightChannel.remove_subscriber`, the status
  written). docs/weights.md, "Subscriber reports".
- Each RLJob is parsed once per generation (`parsed_jobs.parse`), by the reconcile, the status pipeline and
  the rebalance tick alike.
- Runtime state per object (locks, the timer's read times, the rebalancer's memory, the parsed RLJob) is
  dropped when it is no longer needed: see `_locked` and the DELETED branches of `rljob_event` and
  `weightchannel_event`.
The operator never writes an RLJob's spec (Argo CD owns it).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeGuard

import kopf
from pydantic import ValidationError

from rlfleet.api import SamplerGroup, StoreSpec, format_validation_error
from rlfleet.api.common import API_VERSION, GROUP, VERSION
from rlfleet.catalog import get_catalog
from rlfleet.operator import builders, kube, network_policies, parsed_jobs, rebalancer, sandboxes, tokens
from rlfleet.operator import naming as n
from rlfleet.operator import status as st
from rlfleet.operator.admission import collision_message, in_namespace
from rlfleet.operator.model_shape import CONFIG_FILE, model_shape
from rlfleet.operator.pods import event_view, latest_event_message, pod_view
from rlfleet.operator.trainer_report import trainer_job_status

log = logging.getLogger("rlfleet.operator")

# How often the WeightChannel timer reads the store; the timer itself ticks at the shorter of this and
# the rebalance tick. No timer on RLJobs or SamplerGroups: kopf puts a finalizer on every object with a
# timer, and deleting an RLJob must not hang when the operator is gone (docs/operations.md).
CHANNEL_STATUS_INTERVAL = float(os.environ.get("RLFLEET_CHANNEL_STATUS_INTERVAL", "10"))
TIMER_INTERVAL = min(CHANNEL_STATUS_INTERVAL, rebalancer.TICK_SECONDS)

SAMPLER_LABELS = {n.LABEL_MANAGED_BY: n.MANAGED_BY, n.LABEL_COMPONENT: "sampler"}
TRAINER_LABELS = {n.LABEL_MANAGED_BY: n.MANAGED_BY, n.LABEL_COMPONENT: "trainer"}
POD_LABELS = {n.LABEL_MANAGED_BY: n.MANAGED_BY}

# Reconcile metrics (exported by `rlfleet operator run --metrics-port`).
try:
    from prometheus_client import Counter, Histogram

    RECONCILES = Counter("rlfleet_operator_reconciles_total", "Reconciles", ["kind", "result"])
    RECONCILE_SECONDS = Histogram("rlfleet_operator_reconcile_seconds", "Reconcile duration", ["kind"])
    STATUS_WRITES = Counter(
        "rlfleet_operator_status_writes_total", "Status writes (only on change)", ["kind"]
    )
    SUBSCRIBER_REMOVALS = Counter(
        "rlfleet_operator_subscriber_reports_removed_total",
        "Weight-channel subscriber reports of gone replicas the operator deleted from the store "
        "(result: removed, or error: a delete the store refused)",
        ["result"],
    )
except ImportError:  # pragma: no cover - prometheus_client is in the operator extra
    RECONCILES = RECONCILE_SECONDS = STATUS_WRITES = SUBSCRIBER_REMOVALS = None  # type: ignore[assignment]


def _count(metric: Any, *labels: str) -> None:
    if metric is not None:
        metric.labels(*labels).inc()


def plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """A kopf Body as a plain, deep-copied dict."""
    return copy.deepcopy({k: body[k] for k in body})


def _namespaced(namespace: str | None) -> str:
    """The namespace kopf passes to a handler. kopf types it optional (a cluster-scoped kind has none);
    every kind the operator handles is namespaced (its CRDs, pods, Events, Deployments, StatefulSets),
    so None would mean a handler registered on a kind it was not written for."""
    if namespace is None:
        raise kopf.PermanentError("the operator handles namespaced objects only; kopf passed none")
    return namespace


# --- indexes: in-memory views of what the operator watches ------------------------------------------------


@kopf.index(GROUP, VERSION, "rljobs")
def rljobs_idx(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(_namespaced(namespace), name): plain(body)}


@kopf.index(GROUP, VERSION, "samplergroups")
def samplergroups_idx(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(_namespaced(namespace), name): plain(body)}


@kopf.index(GROUP, VERSION, "samplergroups")
def samplergroups_by_job_idx(namespace: str | None, body: kopf.Body, **_: Any) -> dict | None:
    namespace = _namespaced(namespace)
    job = body.get("spec", {}).get("jobName")
    return {(namespace, job): plain(body)} if job else None


@kopf.index(GROUP, VERSION, "weightchannels")
def weightchannels_idx(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(_namespaced(namespace), name): plain(body)}


def _workload(body: kopf.Body) -> dict[str, Any]:
    return {
        "metadata": {"name": body["metadata"]["name"], "generation": body["metadata"].get("generation")},
        "spec": {"replicas": body.get("spec", {}).get("replicas")},
        "status": copy.deepcopy(dict(body.get("status") or {})),
    }


@kopf.index("apps", "v1", "deployments", labels=SAMPLER_LABELS)
def sampler_deployments_idx(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(_namespaced(namespace), name): _workload(body)}


@kopf.index("apps", "v1", "statefulsets", labels=TRAINER_LABELS)
def trainers_idx(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(_namespaced(namespace), name): _workload(body)}


def _pod_owner(labels: Mapping[str, str]) -> tuple[str, str] | None:
    """(component, owner): ("sampler", SamplerGroup name) or ("trainer" | "router", job name)."""
    component = labels.get(n.LABEL_COMPONENT)
    if component == "sampler" and labels.get(n.LABEL_SAMPLERGROUP):
        return component, labels[n.LABEL_SAMPLERGROUP]
    if component in ("trainer", "router") and labels.get(n.LABEL_JOB):
        return component, labels[n.LABEL_JOB]
    return None


@kopf.index("", "v1", "pods", labels=POD_LABELS)
def pods_idx(namespace: str | None, body: kopf.Body, **_: Any) -> dict | None:
    namespace = _namespaced(namespace)
    owner = _pod_owner(body.get("metadata", {}).get("labels") or {})
    return {(namespace, *owner): pod_view(body)} if owner else None


def _is_failed_mount(body: Mapping[str, Any], **_: Any) -> bool:
    involved = body.get("involvedObject") or {}
    return body.get("reason") == "FailedMount" and involved.get("kind") == "Pod" and bool(involved.get("name"))


# Events carry no labels: keyed by the involved pod; only FailedMount (a Secret or ConfigMap missing from a
# volume shows nowhere else). One small view per Event object: the index is bounded by the Events' own TTL.
@kopf.index("", "v1", "events", when=_is_failed_mount)
def mount_failures_idx(namespace: str | None, body: kopf.Body, **_: Any) -> dict:
    return {(_namespaced(namespace), body["involvedObject"]["name"]): event_view(body)}


def _is_failed_create(body: Mapping[str, Any], **_: Any) -> bool:
    involved = body.get("involvedObject") or {}
    return body.get("reason") == "FailedCreate" and involved.get("kind") == "StatefulSet" and bool(involved.get("name"))


# The StatefulSet controller's refusals to create a pod (a ResourceQuota, a missing PriorityClass, a
# webhook) show only as FailedCreate Events on the StatefulSet (it has no ReplicaFailure condition, unlike a
# Deployment): keyed by the StatefulSet's name, bounded by the Events' TTL like the FailedMount index.
@kopf.index("", "v1", "events", when=_is_failed_create)
def create_failures_idx(namespace: str | None, body: kopf.Body, **_: Any) -> dict:
    return {(_namespaced(namespace), body["involvedObject"]["name"]): event_view(body)}


def _is_kueue_pending(body: Mapping[str, Any], **_: Any) -> bool:
    involved = body.get("involvedObject") or {}
    return (
        body.get("reason") == "Pending"
        and involved.get("kind") == "Workload"
        and str(involved.get("apiVersion", "")).startswith("kueue.x-k8s.io/")
        and bool(involved.get("name"))
    )


# Kueue says why it does not admit a Workload (a queue's quota) on the Workload's status and in a `Pending`
# Event on it; the trainer's pod group is the Workload named after the StatefulSet (its pod-group-name).
# Watching Events needs no Kueue CRD in the cluster; bounded by the Events' TTL like the indexes above.
@kopf.index("", "v1", "events", when=_is_kueue_pending)
def kueue_pending_idx(namespace: str | None, body: kopf.Body, **_: Any) -> dict:
    return {(_namespaced(namespace), body["involvedObject"]["name"]): event_view(body)}


@dataclass(frozen=True)
class View:
    """The indexes, as handed to handlers by kopf (keyword arguments named after the index functions)."""

    rljobs: Any
    samplergroups: Any
    samplergroups_by_job: Any
    weightchannels: Any
    sampler_deployments: Any
    trainers: Any
    pods: Any
    mount_failures: Any
    create_failures: Any
    kueue_pending: Any

    @classmethod
    def of(cls, kwargs: Mapping[str, Any]) -> View:
        return cls(
            rljobs=kwargs["rljobs_idx"],
            samplergroups=kwargs["samplergroups_idx"],
            samplergroups_by_job=kwargs["samplergroups_by_job_idx"],
            weightchannels=kwargs["weightchannels_idx"],
            sampler_deployments=kwargs["sampler_deployments_idx"],
            trainers=kwargs["trainers_idx"],
            pods=kwargs["pods_idx"],
            mount_failures=kwargs["mount_failures_idx"],
            create_failures=kwargs["create_failures_idx"],
            kueue_pending=kwargs["kueue_pending_idx"],
        )

    def pods_of(self, namespace: str) -> Callable[[str, str], list[dict[str, Any]]]:
        """(component, owner) -> the pod views of that workload in `namespace`, each with its latest
        FailedMount message (`mountFailure`, None without one)."""

        def of(component: str, owner: str) -> list[dict[str, Any]]:
            return [
                {**pod, "mountFailure": latest_event_message(self.all(self.mount_failures, (namespace, pod["name"])))}
                for pod in self.all(self.pods, (namespace, component, owner))
            ]

        return of

    def sampler_replicas(self, namespace: str) -> dict[str, frozenset[str]]:
        """SamplerGroup name -> the names of its pods in the index (terminating ones included: their
        sidecars may still run). A sidecar's report is keyed by exactly these (group, pod name)."""
        return {
            key[2]: frozenset(p["name"] for p in store if p.get("name"))
            for key, store in list(self.pods.items())
            if key[0] == namespace and key[1] == "sampler"
        }

    def owner_of_pod(self, namespace: str, pod_name: str) -> tuple[str, str] | None:
        """(component, owner) of one of the operator's pods, by name (None: not one of ours)."""
        for key, store in self.pods.items():
            if key[0] == namespace and any(p.get("name") == pod_name for p in store):
                return key[1], key[2]
        return None

    @staticmethod
    def one(index: Any, key: tuple[str, ...]) -> dict[str, Any] | None:
        store = index.get(key)
        return next(iter(store), None) if store else None

    @staticmethod
    def all(index: Any, key: tuple[str, ...]) -> list[dict[str, Any]]:
        store = index.get(key)
        return list(store) if store else []


# --- helpers ---------------------------------------------------------------------------------------------

# Per-object runtime state lives in module dicts, not in kopf's per-object `memo`: an object's pipeline is
# run by the events of other objects (a pod's event runs its group's pipeline, the WeightChannel's timer
# the job's), and a memo belongs to the object being handled. So each entry is dropped as soon as it is
# not needed: a lock when no pipeline of its object runs or waits (`_locked`), the timer's read times, the
# rebalancer's memory and the parsed RLJob on the object's DELETED event (`rljob_event`,
# `weightchannel_event`).
_Key = tuple[int, str, str, str]  # (event loop, kind, namespace, name)
_locks: dict[_Key, asyncio.Lock] = {}
_lock_users: dict[_Key, int] = {}  # pipelines holding or waiting for each lock
_queued: set[_Key] = set()


def _key(kind: str, namespace: str, name: str) -> _Key:
    return id(asyncio.get_running_loop()), kind, namespace, name


@contextlib.asynccontextmanager
async def _locked(kind: str, namespace: str, name: str) -> AsyncIterator[None]:
    """One pipeline of an object at a time; the lock exists only while some pipeline holds or waits for it."""
    key = _key(kind, namespace, name)
    lock = _locks.setdefault(key, asyncio.Lock())
    _lock_users[key] = _lock_users.get(key, 0) + 1
    try:
        async with lock:
            yield
    finally:
        _lock_users[key] -= 1
        if not _lock_users[key]:
            del _lock_users[key], _locks[key]


async def _coalesced(kind: str, namespace: str, name: str, refresh: Callable[[], Awaitable[None]]) -> None:
    """Run `refresh()` under the object's lock, with at most one waiter per object: a burst of child
    events becomes one refresh in flight plus one queued (which sees the state after the burst)."""
    key = _key(kind, namespace, name)
    if key in _queued:
        return
    _queued.add(key)
    try:
        async with _locked(kind, namespace, name):
            _queued.discard(key)
            await refresh()
    finally:
        _queued.discard(key)


def _temporary(exc: kube.KubeError) -> kopf.TemporaryError:
    return kopf.TemporaryError(str(exc), delay=2 if exc.status in (409, 429, 500, 503, 504) else 5)


async def _quietly(coro: Awaitable[None]) -> None:
    """Event handlers must not fail the watch: log API errors, the next event or timer retries."""
    try:
        await coro
    except kube.KubeError as exc:
        log.warning("status refresh failed: %s", exc)


def _owned_by(child: Mapping[str, Any], owner: Mapping[str, Any]) -> bool:
    uid = owner["metadata"].get("uid")
    return any(ref.get("uid") == uid for ref in child.get("metadata", {}).get("ownerReferences", []) or [])


async def _write_status(obj: dict[str, Any], desired: dict[str, Any], kind: str) -> bool:
    """THE status writer: server-side apply of the whole status (as `STATUS_FIELD_MANAGER`) when a field
    changed; an Event on each phase and CollapseRisk transition."""
    old = obj.get("status") or {}
    if not st.status_changed(old, desired):
        return False
    if await kube.api().patch_status(obj, desired) is None:
        return False  # deleted meanwhile
    _count(STATUS_WRITES, kind)
    before, after = old.get("phase"), desired.get("phase")
    if after and before != after:
        kopf.event(
            kube.event_target(obj),
            type="Warning" if after in ("Degraded", "Failed") else "Normal",
            reason=f"Phase{after}",
            message=f"{kind} phase {before or 'None'} -> {after}: {desired.get('message', '')}"[:1000],
        )
    risk_before, risk_after = _condition(old, "CollapseRisk"), _condition(desired, "CollapseRisk")
    if risk_after and (risk_before or {}).get("status", "False") != risk_after["status"]:
        on = risk_after["status"] == "True"
        if on or risk_before:
            kopf.event(kube.event_target(obj), type="Warning" if on else "Normal",
                       reason=risk_after["reason"] if on else "CollapseRiskCleared",
                       message=risk_after.get("message", "")[:1000])  # fmt: skip
    obj["status"] = {**old, **desired}  # our copy now reflects the write (the index catches up on the event)
    return True


def _condition(status: Mapping[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)


# --- operator lifecycle --------------------------------------------------------------------------------


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # kopf's bookkeeping in annotations under our prefix; status stays strictly typed by the CRD.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=n.KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=n.KOPF_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = n.FINALIZER
    # Events are posted explicitly (transitions, errors), not for every log line.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    settings.execution.max_workers = 4
    # Our kinds are fixed: no CRD scanning (saves a cluster-wide list/watch on CRDs in RBAC).
    settings.scanning.disabled = True
    # HA: how long a silent peer still counts as alive (a standby takes over after at most this).
    settings.peering.lifetime = int(os.environ.get("RLFLEET_PEERING_LIFETIME", "60"))


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """Kubeconfig when one is named ($KUBECONFIG / --kubeconfig), else the in-cluster service account."""
    if os.environ.get("KUBECONFIG"):
        info = kopf.login_with_kubeconfig(settings=settings, **kwargs)
    else:
        info = kopf.login_with_service_account(settings=settings, **kwargs) or kopf.login_with_kubeconfig(
            settings=settings, **kwargs
        )
    if info is not None:
        kube.set_connection(info)
    return info


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    await kube.close_api()


# --- RLJob -> children ---------------------------------------------------------------------------------


@kopf.on.resume(GROUP, VERSION, "rljobs")
@kopf.on.create(GROUP, VERSION, "rljobs")
@kopf.on.update(GROUP, VERSION, "rljobs", field="spec")
async def reconcile_rljob(body: kopf.Body, namespace: str | None, **kwargs: Any) -> None:
    namespace = _namespaced(namespace)
    started = time.perf_counter()
    try:
        await reconcile_job(plain(body), namespace, View.of(kwargs))
        _count(RECONCILES, "RLJob", "ok")
    except kopf.PermanentError:
        _count(RECONCILES, "RLJob", "invalid")
        raise
    except kube.KubeError as exc:
        _count(RECONCILES, "RLJob", "error")
        kopf.warn(body, reason="ReconcileError", message=str(exc)[:1000])
        raise _temporary(exc) from None
    finally:
        if RECONCILE_SECONDS is not None:
            RECONCILE_SECONDS.labels("RLJob").observe(time.perf_counter() - started)


async def reconcile_job(body: dict[str, Any], namespace: str, view: View) -> None:
    """Apply every child of the job, delete removed groups, refresh the status."""
    api = kube.api()
    name = body["metadata"]["name"]
    job = parsed_jobs.parse(body)
    if isinstance(job, str):
        kopf.warn(kube.event_target(body), reason="InvalidSpec", message=job)
        await _refresh_job_status(namespace, name, view, body)
        raise kopf.PermanentError(job)
    collision = _name_collision(body, namespace, view)
    if collision:
        # Without the webhook (which refuses this at apply), never silent and never a tug of war: the job
        # whose children are named like another's applies nothing and says whose they are.
        kopf.warn(kube.event_target(body), reason="NameCollision", message=collision[:1000])
        await _refresh_job_status(namespace, name, view, body, invalid=collision)
        raise kopf.PermanentError(collision)
    observed = {
        sg["metadata"]["name"]: sg
        for sg in view.all(view.samplergroups_by_job, (namespace, name))
        if _owned_by(sg, body)
    }
    decisions = rebalancer.decisions_of(body)  # the decided weight formats (decide.py), else the RLJob's
    children = builders.build_job_children(job, namespace, body, get_catalog(), observed,
                                           network_policies.settings_from_env(), sandboxes.role_refs_from_env(),
                                           decisions.weight_formats(job) if decisions is not None else None)  # fmt: skip
    if not job.spec.router.admin_token_secret:
        token = tokens.new_admin_token(body["metadata"]["uid"])
        await api.create(builders.build_router_secret(job, namespace, body, token))
    # created once (a 409 leaves it as it is: never rotated by a reconcile), before any pod that reads it
    await api.create(builders.build_job_api_key_secret(job, namespace, body, tokens.new_api_key()))
    first = [c for c in children if c["kind"] != "SamplerGroup"]
    groups = [c for c in children if c["kind"] == "SamplerGroup"]
    try:
        # config, channel and trainer first (the trainer asks for whole GPU nodes), then the groups at once
        await asyncio.gather(*(api.apply(c) for c in first))
        await asyncio.gather(*(api.apply(g) for g in groups))
    except kube.KubeError as exc:
        # 422: the API server refuses a child (e.g. an older CRD without today's admission rules, or the
        # live CRD's CEL rejecting what the runtime catalog allowed). Retrying cannot help: say why in
        # status and stop, instead of a retry loop behind a status that says nothing is wrong.
        if exc.status == 422:
            message = f"invalid RLJob: the API server refused a child: {exc.message}"[:4000]
            kopf.warn(kube.event_target(body), reason="InvalidSpec", message=message[:1000])
            await _refresh_job_status(namespace, name, view, body, invalid=message)
            raise kopf.PermanentError(message) from None
        raise
    wanted = {g["metadata"]["name"] for g in groups}
    for sg_name in sorted(set(observed) - wanted):
        if await api.delete(API_VERSION, "SamplerGroup", namespace, sg_name):
            kopf.info(
                kube.event_target(body), reason="GroupRemoved", message=f"deleted SamplerGroup {sg_name} (removed from spec)"
            )
    await refresh_job_status(namespace, name, view)


def _name_collision(body: dict[str, Any], namespace: str, view: View) -> str | None:
    """Why this job's children would take another's (a SamplerGroup of another job or a standalone one
    under a name this job wants, or a group named like another job's trainer, router, ...), from the
    operator's indexes of the namespace: job `ab` with group `cd-ef` and job `ab-cd` with group `ef` both
    want SamplerGroup `ab-cd-ef`. The job that finds the name taken is the one refused."""
    return collision_message(body, in_namespace(view.rljobs, namespace), in_namespace(view.samplergroups, namespace))


async def refresh_job_status(namespace: str, name: str, view: View) -> None:
    """Recompute an RLJob's status from its children; write it (and an Event) only when it changed."""
    await _coalesced("RLJob", namespace, name, lambda: _refresh_job_status(namespace, name, view))


async def _refresh_job_status(
    namespace: str, name: str, view: View, job: dict[str, Any] | None = None, invalid: str | None = None
) -> None:
    """The RLJob's pipeline: observe (indexes + the tick's memory) -> status.rljob_status -> one apply."""
    job = job or view.one(view.rljobs, (namespace, name))
    if job is None or job["metadata"].get("deletionTimestamp"):
        return
    if invalid is None and isinstance(parsed := parsed_jobs.parse(job), str):
        invalid = parsed
    groups = [g for g in view.all(view.samplergroups_by_job, (namespace, name)) if _owned_by(g, job)]
    trainer = view.one(view.trainers, (namespace, n.trainer_name(name)))
    channel = view.one(view.weightchannels, (namespace, n.weightchannel_name(name)))
    memory = rebalancer.observed(job)
    now = st.now_iso()
    desired = st.rljob_status(
        job, groups, trainer, channel, now=now, invalid=invalid,
        trainer_pods=view.pods_of(namespace)("trainer", name),
        trainer_create_failure=latest_event_message(view.all(view.create_failures, (namespace, n.trainer_name(name)))),
        costs=rebalancer.fleet_costs(result) if (result := memory.decisions and memory.decisions.result) else None,
        trainer_report=trainer_job_status(job, groups, memory.report, now).status,
        fleet_plan=rebalancer.fleet_plan_status(memory),
        precision_autopilot=rebalancer.precision_autopilot_status(memory),
        decisions=rebalancer.decisions_status(memory),
        trainer_admission=latest_event_message(view.all(view.kueue_pending, (namespace, n.trainer_name(name)))),
    )  # fmt: skip
    await _write_status(job, desired, "RLJob")


@kopf.on.event(GROUP, VERSION, "rljobs")
async def rljob_event(name: str, namespace: str | None, type: str | None, **_: Any) -> None:
    """A deleted RLJob's rebalancer memory (shares, EMA, the trainer's report) and its parse are dropped: a
    job created again under the same name starts from its own status. (An event handler, not `on.delete`:
    that would put a finalizer on RLJobs, which must delete without the operator.)"""
    namespace = _namespaced(namespace)
    if type == "DELETED":
        rebalancer.forget(namespace, name)
        parsed_jobs.forget(namespace, name)


# --- SamplerGroup -> Deployment + Service ----------------------------------------------------------------


@kopf.on.resume(GROUP, VERSION, "samplergroups")
@kopf.on.create(GROUP, VERSION, "samplergroups")
@kopf.on.update(GROUP, VERSION, "samplergroups", field="spec")
async def reconcile_samplergroup(body: kopf.Body, namespace: str | None, **kwargs: Any) -> None:
    namespace = _namespaced(namespace)
    started = time.perf_counter()
    try:
        await reconcile_group(plain(body), namespace, View.of(kwargs))
        _count(RECONCILES, "SamplerGroup", "ok")
    except kopf.PermanentError:
        _count(RECONCILES, "SamplerGroup", "invalid")
        raise
    except kube.KubeError as exc:
        _count(RECONCILES, "SamplerGroup", "error")
        kopf.warn(body, reason="ReconcileError", message=str(exc)[:1000])
        raise _temporary(exc) from None
    finally:
        if RECONCILE_SECONDS is not None:
            RECONCILE_SECONDS.labels("SamplerGroup").observe(time.perf_counter() - started)


async def reconcile_group(raw: dict[str, Any], namespace: str, view: View) -> None:
    """The SamplerGroup pipeline: parse -> its channel's store -> Deployment + Service applied -> the
    group's status. kopf runs it on create / spec update / resume, and the Deployment's DELETED event
    runs it again when someone else deleted the Deployment of a live group (`sampler_deployment_event`)."""
    api = kube.api()
    name = raw["metadata"]["name"]
    try:
        sg = SamplerGroup.from_manifest(raw)
    except (ValidationError, ValueError) as exc:
        message = format_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
        kopf.warn(kube.event_target(raw), reason="InvalidSpec", message=message[:1000])
        await _refresh_samplergroup_status(namespace, name, view, raw)
        raise kopf.PermanentError(message) from None
    store: StoreSpec | None = None
    if sg.spec.weight_channel:
        wc = view.one(view.weightchannels, (namespace, sg.spec.weight_channel))
        wc = wc or await api.get(API_VERSION, "WeightChannel", namespace, sg.spec.weight_channel)
        if wc is None:
            raise kopf.TemporaryError(f"WeightChannel {sg.spec.weight_channel} not found yet", delay=2)
        store = StoreSpec.model_validate(wc["spec"]["store"])
    children = builders.build_samplergroup_children(sg, namespace, raw, get_catalog(), store)
    if not sg.spec.job_name:  # a group outside any job: its own key (a job's groups share the job's)
        await api.create(builders.build_group_api_key_secret(sg, namespace, raw, tokens.new_api_key()))
    await asyncio.gather(*(api.apply(c) for c in children))
    await refresh_samplergroup_status(namespace, name, view)


async def refresh_samplergroup_status(namespace: str, name: str, view: View) -> None:
    await _coalesced(
        "SamplerGroup", namespace, name, lambda: _refresh_samplergroup_status(namespace, name, view)
    )


async def _refresh_samplergroup_status(
    namespace: str, name: str, view: View, sg: dict[str, Any] | None = None
) -> None:
    sg = sg or view.one(view.samplergroups, (namespace, name))
    if sg is None or sg["metadata"].get("deletionTimestamp"):
        return
    deployment = view.one(view.sampler_deployments, (namespace, name))
    channel_name = sg.get("spec", {}).get("weightChannel")
    wc = view.one(view.weightchannels, (namespace, channel_name)) if channel_name else None
    job_name = sg.get("spec", {}).get("jobName")
    job = view.one(view.rljobs, (namespace, job_name)) if job_name else None
    memory = rebalancer.observed(job) if job else rebalancer.JobMemory()
    group_name = sg.get("spec", {}).get("name")
    result = memory.decisions.result if memory.decisions is not None else None
    group = result.groups.get(group_name) if result is not None and group_name else None
    collapse = trainer_job_status(job, [], memory.report, st.now_iso()).quarantine if job else frozenset()
    decided = (rebalancer.decisions_of(job) if job else None) or None
    decision = decided.groups.get(group_name) if decided is not None and group_name else None
    desired = st.samplergroup_status(
        sg, deployment, get_catalog(), (wc or {}).get("status"),
        pods=view.pods_of(namespace)("sampler", name),
        rebalance=group.status_patch() if group is not None else None,
        quarantine=st.quarantine_reason(sg, collapse, decision.held_quarantine if decision is not None else None),
    )  # fmt: skip
    await _write_status(sg, desired, "SamplerGroup")


# --- children events -> parent status ----------------------------------------------------------------------


def _alive(obj: Mapping[str, Any] | None) -> TypeGuard[Mapping[str, Any]]:
    return obj is not None and not obj["metadata"].get("deletionTimestamp")


async def heal_job(namespace: str, name: str, view: View) -> None:
    """A child of a live job was deleted by someone else: the job's pipeline applies its children again."""
    job = view.one(view.rljobs, (namespace, name))
    if _alive(job):
        log.warning("child of RLJob %s/%s deleted: re-applying its children", namespace, name)
        await _coalesced("RLJob-heal", namespace, name, lambda: _rerun(reconcile_job, job, namespace, view))


async def heal_group(namespace: str, name: str, view: View) -> None:
    """The Deployment of a live SamplerGroup was deleted by someone else: the group's pipeline runs again."""
    sg = view.one(view.samplergroups, (namespace, name))
    if _alive(sg):
        log.warning("Deployment of SamplerGroup %s/%s deleted: re-applying it", namespace, name)
        await _coalesced("SamplerGroup-heal", namespace, name, lambda: _rerun(reconcile_group, sg, namespace, view))


async def _rerun(pipeline: Callable[[dict[str, Any], str, View], Awaitable[None]], body: Mapping[str, Any],
                 namespace: str, view: View) -> None:  # fmt: skip
    """A pipeline run by an event: an invalid spec or a missing channel is the kopf handler's to report
    (and retry); here it is logged."""
    try:
        await pipeline(copy.deepcopy(dict(body)), namespace, view)
    except (kopf.PermanentError, kopf.TemporaryError) as exc:
        log.info("%s/%s not re-applied: %s", namespace, body["metadata"]["name"], exc)


@kopf.on.event("apps", "v1", "deployments", labels=SAMPLER_LABELS)
async def sampler_deployment_event(body: kopf.Body, namespace: str | None, type: str | None, **kwargs: Any) -> None:
    namespace = _namespaced(namespace)
    sg_name = body.get("metadata", {}).get("labels", {}).get(n.LABEL_SAMPLERGROUP)
    if sg_name:
        view = View.of(kwargs)
        if type == "DELETED":
            await _quietly(heal_group(namespace, sg_name, view))
        await _quietly(refresh_samplergroup_status(namespace, sg_name, view))


@kopf.on.event(GROUP, VERSION, "samplergroups")
async def samplergroup_event(
    body: kopf.Body, name: str, namespace: str | None, type: str | None, **kwargs: Any
) -> None:
    namespace = _namespaced(namespace)
    job = body.get("spec", {}).get("jobName")
    if type != "DELETED":  # the rebalancer moved the share: sharePercent follows (no write if unchanged)
        await _quietly(refresh_samplergroup_status(namespace, name, View.of(kwargs)))
    if job:
        view = View.of(kwargs)
        if type == "DELETED":
            job_body = view.one(view.rljobs, (namespace, job))
            wanted = {g.get("name") for g in (job_body or {}).get("spec", {}).get("samplerGroups", [])}
            if body.get("spec", {}).get("name") in wanted and _owned_by(body, job_body or {"metadata": {}}):
                await _quietly(heal_job(namespace, job, view))
        await _quietly(refresh_job_status(namespace, job, view))


@kopf.on.event("apps", "v1", "statefulsets", labels=TRAINER_LABELS)
async def trainer_event(body: kopf.Body, namespace: str | None, type: str | None, **kwargs: Any) -> None:
    namespace = _namespaced(namespace)
    job = body.get("metadata", {}).get("labels", {}).get(n.LABEL_JOB)
    if job:
        view = View.of(kwargs)
        if type == "DELETED":
            await _quietly(heal_job(namespace, job, view))
        await _quietly(refresh_job_status(namespace, job, view))


@kopf.on.event("", "v1", "pods", labels=POD_LABELS)
async def pod_event(body: kopf.Body, namespace: str | None, **kwargs: Any) -> None:
    """A pod of the operator's moved (scheduled, ready, waiting on an image, crash-looping, gone): its
    owner's pipeline re-runs (the pod index has the new view; no write when the status is the same)."""
    namespace = _namespaced(namespace)
    owner = _pod_owner(body.get("metadata", {}).get("labels") or {})
    if owner is None:
        return
    view = View.of(kwargs)
    component, name = owner
    if component == "sampler":
        await _quietly(refresh_samplergroup_status(namespace, name, view))
    elif component == "trainer":
        await _quietly(refresh_job_status(namespace, name, view))


@kopf.on.event("", "v1", "events", when=_is_failed_mount)
async def mount_failure_event(body: kopf.Body, namespace: str | None, **kwargs: Any) -> None:
    """The kubelet cannot mount a volume of one of the operator's pods (the pod itself does not change):
    its owner's pipeline re-runs with the new message in the index."""
    namespace = _namespaced(namespace)
    view = View.of(kwargs)
    owner = view.owner_of_pod(namespace, body["involvedObject"]["name"])
    if owner is None:
        return
    component, name = owner
    if component == "sampler":
        await _quietly(refresh_samplergroup_status(namespace, name, view))
    elif component == "trainer":
        await _quietly(refresh_job_status(namespace, name, view))


@kopf.on.event("", "v1", "events", when=_is_failed_create)
async def create_failure_event(body: kopf.Body, namespace: str | None, **kwargs: Any) -> None:
    """The StatefulSet controller cannot create a trainer pod (the StatefulSet itself does not change): the
    job's pipeline re-runs with the Event's message in the index."""
    namespace = _namespaced(namespace)
    view = View.of(kwargs)
    statefulset = body["involvedObject"]["name"]
    job = statefulset.removesuffix("-trainer")
    if n.trainer_name(job) == statefulset and view.one(view.rljobs, (namespace, job)) is not None:
        await _quietly(refresh_job_status(namespace, job, view))


@kopf.on.event("", "v1", "events", when=_is_kueue_pending)
async def kueue_pending_event(body: kopf.Body, namespace: str | None, **kwargs: Any) -> None:
    """Kueue did not admit a Workload (the trainer's pods do not change while gated): when it is a trainer's
    pod group, the job's pipeline re-runs with Kueue's message in the index."""
    namespace = _namespaced(namespace)
    view = View.of(kwargs)
    workload = body["involvedObject"]["name"]
    job = workload.removesuffix("-trainer")
    if n.trainer_name(job) == workload and view.one(view.rljobs, (namespace, job)) is not None:
        await _quietly(refresh_job_status(namespace, job, view))


# --- WeightChannel status from the store ---------------------------------------------------------------------


@dataclass(frozen=True)
class ChannelRead:
    """What one read of a channel's store gave: its status (None: unreadable, `error` says why), the
    reports of gone replicas deleted meanwhile, and how many deletes the store refused (and why)."""

    status: Any | None
    error: str | None = None
    removed: tuple[Any, ...] = ()
    removal_failures: int = 0
    removal_error: str | None = None
    model: dict[str, Any] | None = None  # model_shape.model_shape of a published config.json, when read now


def read_channel(spec: Mapping[str, Any], live_replicas: Mapping[str, frozenset[str]] | None = None,
                 now: datetime | None = None, want_model: bool = False) -> ChannelRead:  # fmt: skip
    """Read a channel's status (groups from reports not older than SUBSCRIBER_STALE_AFTER_SECONDS) and,
    given the live pods of each sampler group, delete the reports `subscribers_to_remove` picks (each
    only if not rewritten since it was read); with `want_model`, the published model's head counts from a
    view's config.json (`model_shape`). Blocking: run in a thread."""
    try:
        from rlfleet.channel import SUBSCRIBER_STALE_AFTER_SECONDS, read_channel_status
        from rlfleet.store import StoreError, store_from_spec
    except ImportError as exc:  # the weights engineer's modules are not installed
        return ChannelRead(None, f"channel reader unavailable ({exc})")
    now = now or datetime.now(UTC)
    try:
        store = store_from_spec(StoreSpec.model_validate(spec["store"]))
        try:
            status = read_channel_status(store, stale_after_seconds=SUBSCRIBER_STALE_AFTER_SECONDS, now=now)
            removed: list[Any] = []
            failures, removal_error = 0, None
            if live_replicas is not None:
                removed, failures, removal_error = _remove_gone_subscribers(store, status, live_replicas, now)
            model = None
            if want_model and status.latest_version is not None:
                model = _published_model(store, status.latest_version)
            return ChannelRead(status, None, tuple(removed), failures, removal_error, model)
        finally:
            close = getattr(store, "close", None)
            if close:
                close()
    except StoreError as exc:
        return ChannelRead(None, str(exc))
    except (OSError, ValueError) as exc:
        return ChannelRead(None, f"{type(exc).__name__}: {exc}")



def _remove_gone_subscribers(
    store: Any, status: Any, live_replicas: Mapping[str, frozenset[str]], now: datetime
) -> tuple[list[Any], int, str | None]:
    """Delete the reports `subscribers_to_remove` picks, each only if not rewritten since it was read:
    (the removed reports, how many deletes the store refused, the last refusal)."""
    from rlfleet.channel import WeightChannel, subscribers_to_remove
    from rlfleet.store import StoreError

    removed: list[Any] = []
    failures, removal_error = 0, None
    channel = WeightChannel(store, publisher_id="operator")
    for report in subscribers_to_remove(status.subscribers, live_replicas, now):
        try:
            judged = report.updated_at  # deleted only if not rewritten since it was read
            if channel.remove_subscriber(report.group, report.replica, if_updated_at=judged):
                removed.append(report)
        except (StoreError, OSError) as exc:  # e.g. a read-only mount: the next read retries
            failures, removal_error = failures + 1, f"{type(exc).__name__}: {exc}"
    return removed, failures, removal_error


def _published_model(store: Any, version: int) -> dict[str, Any] | None:
    """model_shape of the first view's config.json in the version's manifest (None: no config.json,
    or one that is not an object)."""
    from rlfleet.channel import WeightChannel, manifest_key

    manifest = WeightChannel(store, publisher_id="operator").manifest(version)
    folder = manifest_key(version).rsplit("/", 1)[0]  # the version's folder in the store
    for view, files in sorted(manifest.views.items()):
        if CONFIG_FILE in files.files:
            config = json.loads(store.get(f"{folder}/{view}/{CONFIG_FILE}"))
            return model_shape(config, version) if isinstance(config, dict) else None
    return None

_removal_failing: set[tuple[str, str]] = set()


def _log_removals(namespace: str, name: str, read: ChannelRead, now: datetime) -> None:
    """INFO per removed report, a metric per removal; a failure to remove: WARNING once per streak."""
    from rlfleet.channel import report_age_seconds

    for report in read.removed:
        _count(SUBSCRIBER_REMOVALS, "removed")
        log.info(
            "WeightChannel %s/%s: removed the subscriber report of %s/%s (no such pod in its group, last "
            "report %.0f s ago, applied v%s)",
            namespace, name, report.group, report.replica, report_age_seconds(report, now),
            report.applied_version,
        )  # fmt: skip
    key = (namespace, name)
    for _ in range(read.removal_failures):
        _count(SUBSCRIBER_REMOVALS, "error")
    if read.removal_failures:
        if key not in _removal_failing:
            _removal_failing.add(key)
            log.warning(
                "WeightChannel %s/%s: cannot remove subscriber reports of gone replicas from the store: %s "
                "(the operator needs write access to subscribers/; those reports pin nothing and count in "
                "no status meanwhile; retried at every read, logged again once it works)",
                namespace, name, read.removal_error,
            )  # fmt: skip
    elif key in _removal_failing and read.status is not None:
        _removal_failing.discard(key)  # nothing refused this time: a later failure warns again
        if read.removed:
            log.info("WeightChannel %s/%s: removing subscriber reports works again", namespace, name)


@kopf.on.resume(GROUP, VERSION, "weightchannels")
@kopf.on.create(GROUP, VERSION, "weightchannels")
async def weightchannel_created(name: str, namespace: str | None, body: kopf.Body, **kwargs: Any) -> None:
    namespace = _namespaced(namespace)
    await _quietly(refresh_weightchannel_status(namespace, name, View.of(kwargs), plain(body)))


_channel_read: dict[tuple[int, str, str], float] = {}


@kopf.timer(GROUP, VERSION, "weightchannels", interval=TIMER_INTERVAL, initial_delay=TIMER_INTERVAL)
async def weightchannel_timer(name: str, namespace: str | None, body: kopf.Body, **kwargs: Any) -> None:
    """The tick of the job's pipelines: read the store (every CHANNEL_STATUS_INTERVAL), run the rebalance
    tick (observe: scrapes, shares, router push), then the same status pipelines the events run."""
    namespace = _namespaced(namespace)
    view = View.of(kwargs)
    key = (id(asyncio.get_running_loop()), namespace, name)
    if time.monotonic() - _channel_read.get(key, -math.inf) >= CHANNEL_STATUS_INTERVAL - TIMER_INTERVAL / 2:
        _channel_read[key] = time.monotonic()
        await _quietly(refresh_weightchannel_status(namespace, name, view))
    job_name = body.get("spec", {}).get("jobName")
    job = view.one(view.rljobs, (namespace, job_name)) if job_name else None
    if not _alive(job):
        return
    groups = [g for g in view.all(view.samplergroups_by_job, (namespace, job_name)) if _owned_by(g, job)]
    try:
        decided = await rebalancer.rebalance_job(copy.deepcopy(job), namespace, groups, view.pods_of(namespace))
        if decided is not None:  # written into the RLJob's status first, then carried out
            await _quietly(refresh_job_status(namespace, job_name, view))
            await rebalancer.act(copy.deepcopy(job), namespace, groups, view.pods_of(namespace), decided)
    except kube.KubeError as exc:
        log.warning("rebalance of %s/%s failed: %s", namespace, job_name, exc)
        decided = None
    if decided is not None:
        for sg in groups:
            await _quietly(refresh_samplergroup_status(namespace, sg["metadata"]["name"], view))
    await _quietly(refresh_job_status(namespace, job_name, view))  # also the safety net of the roll-up


async def refresh_weightchannel_status(
    namespace: str, name: str, view: View, wc: dict[str, Any] | None = None
) -> None:
    async with _locked("WeightChannel", namespace, name):
        wc = wc or view.one(view.weightchannels, (namespace, name))
        if wc is None or wc["metadata"].get("deletionTimestamp"):
            return
        # the pods first, then the store: a report written by a pod the index does not hold yet is
        # fresh, and fresh reports are never removed (channel.subscribers_to_remove)
        live = view.sampler_replicas(namespace)
        now = datetime.now(UTC)
        known = (wc.get("status") or {}).get("model")  # every version is the same model: read it once
        read = await asyncio.to_thread(read_channel, wc.get("spec", {}), live, now, not known)
        _log_removals(namespace, name, read, now)
        desired = st.weightchannel_status(wc, read.status, read.error, model=read.model)
        await _write_status(wc, desired, "WeightChannel")


@kopf.on.event(GROUP, VERSION, "weightchannels")
async def weightchannel_event(body: kopf.Body, name: str, namespace: str | None, type: str | None, **kwargs: Any) -> None:
    """Channel status moved (new version, a group applied one): group lags and the job's version follow.
    Deleted: what the operator kept for the channel (its timer's last store read, a removal failure
    streak) is dropped."""
    namespace = _namespaced(namespace)
    if type == "DELETED":
        for key in [k for k in _channel_read if k[1:] == (namespace, name)]:
            del _channel_read[key]
        _removal_failing.discard((namespace, name))
    job = body.get("spec", {}).get("jobName")
    if not job:
        return
    view = View.of(kwargs)
    for sg in view.all(view.samplergroups_by_job, (namespace, job)):
        await _quietly(refresh_samplergroup_status(namespace, sg["metadata"]["name"], view))
    await _quietly(refresh_job_status(namespace, job, view))
