"""kopf handlers (thin): read what is needed, call the pure builders / status functions, apply.

Importing this module registers every handler of the operator (including the rebalancer's timer from
`rlfleet.operator.rebalance_timer`, owned by the router engineer, when present).

- RLJob create/update(spec)/resume -> server-side apply of every child (owner references, common
  labels), deletion of SamplerGroups no longer in the spec, status roll-up.
- SamplerGroup create/update(spec)/resume -> its Deployment + Service.
- Events of the children (sampler Deployments, trainer StatefulSets, SamplerGroups) -> status of the
  parent, written by server-side apply on the status subresource, only when it changed, with a
  Kubernetes Event on each phase transition. Timers re-check as a safety net.
- WeightChannel timer -> reads the channel (rlfleet.channel) and writes its status.
The operator never writes an RLJob's spec (Argo CD owns it).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import kopf
from pydantic import ValidationError
from rlfleet.operator import builders, kube, tokens
from rlfleet.operator import naming as n
from rlfleet.operator import status as st

from rlfleet.api import RLJob, SamplerGroup, StoreSpec, format_validation_error
from rlfleet.api.common import API_VERSION, GROUP, VERSION
from rlfleet.catalog import CatalogError, get_catalog

log = logging.getLogger("rlfleet.operator")

# Status refresh intervals of the safety-net timers (events do the fast path).
JOB_STATUS_INTERVAL = float(os.environ.get("RLFLEET_JOB_STATUS_INTERVAL", "30"))
GROUP_STATUS_INTERVAL = float(os.environ.get("RLFLEET_GROUP_STATUS_INTERVAL", "60"))
CHANNEL_STATUS_INTERVAL = float(os.environ.get("RLFLEET_CHANNEL_STATUS_INTERVAL", "10"))

# Reconcile metrics (exported by `rlfleet operator run --metrics-port`).
try:
    from prometheus_client import Counter, Histogram

    RECONCILES = Counter("rlfleet_operator_reconciles_total", "Reconciles", ["kind", "result"])
    RECONCILE_SECONDS = Histogram("rlfleet_operator_reconcile_seconds", "Reconcile duration", ["kind"])
    STATUS_WRITES = Counter(
        "rlfleet_operator_status_writes_total", "Status writes (only on change)", ["kind"]
    )
except ImportError:  # pragma: no cover - prometheus_client is in the operator extra
    RECONCILES = RECONCILE_SECONDS = STATUS_WRITES = None  # type: ignore[assignment]


def _count(metric: Any, *labels: str) -> None:
    if metric is not None:
        metric.labels(*labels).inc()


def plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """A kopf Body as a plain, deep-copied dict."""
    return copy.deepcopy({k: body[k] for k in body})


_locks: dict[tuple[int, str, str, str], asyncio.Lock] = {}


def _lock(kind: str, namespace: str, name: str) -> asyncio.Lock:
    """Serialise status refreshes of one object (events of many children race otherwise)."""
    key = (id(asyncio.get_running_loop()), kind, namespace, name)
    lock = _locks.get(key)
    if lock is None:
        lock = _locks[key] = asyncio.Lock()
    return lock


_queued: set[tuple[int, str, str, str]] = set()


async def _coalesced(kind: str, namespace: str, name: str, refresh: Any) -> None:
    """Run `refresh()` under the object's lock, but at most one waiter per object: a burst of child
    events becomes one refresh in flight plus one queued (which reads the state after the burst)."""
    key = (id(asyncio.get_running_loop()), kind, namespace, name)
    if key in _queued:
        return
    _queued.add(key)
    try:
        async with _lock(kind, namespace, name):
            _queued.discard(key)
            await refresh()
    finally:
        _queued.discard(key)


async def _none() -> None:
    return None


def _temporary(exc: kube.KubeError) -> kopf.TemporaryError:
    return kopf.TemporaryError(str(exc), delay=2 if exc.status in (409, 429, 500, 503, 504) else 5)


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
    settings.batching.batch_window = 0.2
    settings.execution.max_workers = 4
    # Our kinds are fixed: no CRD scanning (saves a cluster-wide list/watch on CRDs in RBAC).
    settings.scanning.disabled = True


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


def _parse_job(body: Mapping[str, Any]) -> tuple[RLJob | None, str | None]:
    try:
        return RLJob.from_manifest(plain(body)), None
    except ValidationError as exc:
        return None, "invalid RLJob: " + format_validation_error(exc).strip().replace("\n", ";")
    except (CatalogError, ValueError) as exc:
        return None, f"invalid RLJob: {exc}"


@kopf.on.resume(GROUP, VERSION, "rljobs")
@kopf.on.create(GROUP, VERSION, "rljobs")
@kopf.on.update(GROUP, VERSION, "rljobs", field="spec")
async def reconcile_rljob(body: kopf.Body, name: str, namespace: str, **_: Any) -> None:
    started = time.perf_counter()
    try:
        await reconcile_job(plain(body), namespace)
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


async def reconcile_job(body: dict[str, Any], namespace: str) -> None:
    """Apply every child of the job, delete removed groups, refresh the status."""
    api = kube.api()
    name = body["metadata"]["name"]
    job, invalid = _parse_job(body)
    if job is None:
        kopf.warn(body, reason="InvalidSpec", message=invalid or "")
        await refresh_job_status(namespace, name)
        raise kopf.PermanentError(invalid)
    catalog = get_catalog()
    selector = f"{n.LABEL_JOB}={name},{n.LABEL_COMPONENT}=sampler"
    observed = {
        sg["metadata"]["name"]: sg
        for sg in await api.list(API_VERSION, "SamplerGroup", namespace, selector)
        if _owned_by(sg, body)
    }
    children = builders.build_job_children(job, namespace, body, catalog, observed)
    if not job.spec.router.admin_token_secret:
        token = tokens.new_admin_token(body["metadata"]["uid"])
        await api.create(builders.build_router_secret(job, namespace, body, token))
    first = [c for c in children if c["kind"] != "SamplerGroup"]
    groups = [c for c in children if c["kind"] == "SamplerGroup"]
    for child in first:
        await api.apply(child)
    try:
        await asyncio.gather(*(api.apply(g) for g in groups))
    except kube.KubeError as exc:
        if exc.status == 422:  # e.g. the live CRD's CEL rejects what the runtime catalog allowed
            kopf.warn(body, reason="InvalidSpec", message=exc.message[:1000])
            raise kopf.PermanentError(exc.message) from None
        raise
    wanted = {g["metadata"]["name"] for g in groups}
    for sg_name in sorted(set(observed) - wanted):
        if await api.delete(API_VERSION, "SamplerGroup", namespace, sg_name):
            kopf.info(
                body, reason="GroupRemoved", message=f"deleted SamplerGroup {sg_name} (removed from spec)"
            )
    await refresh_job_status(namespace, name)


def _owned_by(child: Mapping[str, Any], owner: Mapping[str, Any]) -> bool:
    uid = owner["metadata"].get("uid")
    return any(ref.get("uid") == uid for ref in child.get("metadata", {}).get("ownerReferences", []) or [])


async def refresh_job_status(namespace: str, name: str) -> None:
    """Recompute an RLJob's status from its children; write it (and an Event) only when it changed."""
    await _coalesced("RLJob", namespace, name, lambda: _refresh_job_status(namespace, name))


async def _refresh_job_status(namespace: str, name: str) -> None:
    api = kube.api()
    job = await api.get(API_VERSION, "RLJob", namespace, name)
    if job is None or job["metadata"].get("deletionTimestamp"):
        return
    _, invalid = _parse_job(job)
    groups, trainer, channel = await asyncio.gather(
        api.list(API_VERSION, "SamplerGroup", namespace, f"{n.LABEL_JOB}={name}"),
        api.get("apps/v1", "StatefulSet", namespace, n.trainer_name(name)),
        api.get(API_VERSION, "WeightChannel", namespace, n.weightchannel_name(name)),
    )
    groups = [g for g in groups if _owned_by(g, job)]
    desired = st.rljob_status(job, groups, trainer, channel, invalid=invalid)
    await _write_status(job, desired, "RLJob")


async def _write_status(obj: dict[str, Any], desired: dict[str, Any], kind: str) -> bool:
    old = obj.get("status") or {}
    if not st.status_changed(old, desired):
        return False
    api = kube.api()
    try:
        await api.apply(
            st.status_apply_body(obj, desired), field_manager=n.STATUS_FIELD_MANAGER, subresource="status"
        )
    except kube.KubeError as exc:
        if exc.status == 404:
            return False
        raise
    _count(STATUS_WRITES, kind)
    before, after = old.get("phase"), desired.get("phase")
    if after and before != after:
        warn = after in ("Degraded", "Failed")
        kopf.event(
            obj,
            type="Warning" if warn else "Normal",
            reason=f"Phase{after}",
            message=f"{kind} phase {before or 'None'} -> {after}: {desired.get('message', '')}"[:1000],
        )
    return True


# --- SamplerGroup -> Deployment + Service ----------------------------------------------------------------


@kopf.on.resume(GROUP, VERSION, "samplergroups")
@kopf.on.create(GROUP, VERSION, "samplergroups")
@kopf.on.update(GROUP, VERSION, "samplergroups", field="spec")
async def reconcile_samplergroup(body: kopf.Body, name: str, namespace: str, **_: Any) -> None:
    started = time.perf_counter()
    api = kube.api()
    raw = plain(body)
    try:
        sg = SamplerGroup.from_manifest(raw)
    except (ValidationError, ValueError) as exc:
        message = format_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
        kopf.warn(body, reason="InvalidSpec", message=message[:1000])
        await refresh_samplergroup_status(namespace, name)
        _count(RECONCILES, "SamplerGroup", "invalid")
        raise kopf.PermanentError(message) from None
    try:
        store: StoreSpec | None = None
        if sg.spec.weight_channel:
            wc = await api.get(API_VERSION, "WeightChannel", namespace, sg.spec.weight_channel)
            if wc is None:
                raise kopf.TemporaryError(f"WeightChannel {sg.spec.weight_channel} not found yet", delay=2)
            store = StoreSpec.model_validate(wc["spec"]["store"])
        for child in builders.build_samplergroup_children(sg, namespace, raw, get_catalog(), store):
            await api.apply(child)
        await refresh_samplergroup_status(namespace, name)
        _count(RECONCILES, "SamplerGroup", "ok")
    except kube.KubeError as exc:
        _count(RECONCILES, "SamplerGroup", "error")
        kopf.warn(body, reason="ReconcileError", message=str(exc)[:1000])
        raise _temporary(exc) from None
    finally:
        if RECONCILE_SECONDS is not None:
            RECONCILE_SECONDS.labels("SamplerGroup").observe(time.perf_counter() - started)


async def refresh_samplergroup_status(namespace: str, name: str) -> None:
    await _coalesced("SamplerGroup", namespace, name, lambda: _refresh_samplergroup_status(namespace, name))


async def _refresh_samplergroup_status(namespace: str, name: str) -> None:
    api = kube.api()
    sg = await api.get(API_VERSION, "SamplerGroup", namespace, name)
    if sg is None or sg["metadata"].get("deletionTimestamp"):
        return
    channel_name = sg.get("spec", {}).get("weightChannel")
    deployment, wc = await asyncio.gather(
        api.get("apps/v1", "Deployment", namespace, name),
        api.get(API_VERSION, "WeightChannel", namespace, channel_name) if channel_name else _none(),
    )
    channel_status = (wc or {}).get("status")
    desired = st.samplergroup_status(sg, deployment, get_catalog(), channel_status)
    await _write_status(sg, desired, "SamplerGroup")


# --- children events -> parent status ----------------------------------------------------------------------


@kopf.on.event(
    "apps", "v1", "deployments", labels={n.LABEL_MANAGED_BY: n.MANAGED_BY, n.LABEL_COMPONENT: "sampler"}
)
async def sampler_deployment_event(body: kopf.Body, namespace: str, **_: Any) -> None:
    sg_name = body.get("metadata", {}).get("labels", {}).get(n.LABEL_SAMPLERGROUP)
    if sg_name:
        await _quietly(refresh_samplergroup_status(namespace, sg_name))


@kopf.on.event(GROUP, VERSION, "samplergroups")
async def samplergroup_event(body: kopf.Body, namespace: str, **_: Any) -> None:
    job = body.get("spec", {}).get("jobName")
    if job:
        await _quietly(refresh_job_status(namespace, job))


@kopf.on.event(
    "apps", "v1", "statefulsets", labels={n.LABEL_MANAGED_BY: n.MANAGED_BY, n.LABEL_COMPONENT: "trainer"}
)
async def trainer_event(body: kopf.Body, namespace: str, **_: Any) -> None:
    job = body.get("metadata", {}).get("labels", {}).get(n.LABEL_JOB)
    if job:
        await _quietly(refresh_job_status(namespace, job))


async def _quietly(coro: Any) -> None:
    """Event handlers must not fail the watch: log API errors, the next event or timer retries."""
    try:
        await coro
    except kube.KubeError as exc:
        log.warning("status refresh failed: %s", exc)


@kopf.timer(GROUP, VERSION, "rljobs", interval=JOB_STATUS_INTERVAL, initial_delay=JOB_STATUS_INTERVAL)
async def rljob_status_timer(name: str, namespace: str, **_: Any) -> None:
    await _quietly(refresh_job_status(namespace, name))


@kopf.timer(
    GROUP, VERSION, "samplergroups", interval=GROUP_STATUS_INTERVAL, initial_delay=GROUP_STATUS_INTERVAL
)
async def samplergroup_status_timer(name: str, namespace: str, **_: Any) -> None:
    await _quietly(refresh_samplergroup_status(namespace, name))


# --- WeightChannel status from the store ---------------------------------------------------------------------


def read_channel(spec: Mapping[str, Any]) -> tuple[Any | None, str | None]:
    """(ChannelStatus, None) or (None, why not). Blocking: run in a thread."""
    try:
        from rlfleet.channel import read_channel_status
        from rlfleet.store import StoreError, store_from_spec
    except ImportError as exc:  # the weights engineer's modules are not installed
        return None, f"channel reader unavailable ({exc})"
    try:
        store = store_from_spec(StoreSpec.model_validate(spec["store"]))
        try:
            return read_channel_status(store), None
        finally:
            close = getattr(store, "close", None)
            if close:
                close()
    except StoreError as exc:
        return None, str(exc)
    except (OSError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


@kopf.on.resume(GROUP, VERSION, "weightchannels")
@kopf.on.create(GROUP, VERSION, "weightchannels")
async def weightchannel_created(name: str, namespace: str, **_: Any) -> None:
    await _quietly(refresh_weightchannel_status(namespace, name))


@kopf.timer(
    GROUP, VERSION, "weightchannels", interval=CHANNEL_STATUS_INTERVAL, initial_delay=CHANNEL_STATUS_INTERVAL
)
async def weightchannel_timer(name: str, namespace: str, **_: Any) -> None:
    await _quietly(refresh_weightchannel_status(namespace, name))


async def refresh_weightchannel_status(namespace: str, name: str) -> None:
    api = kube.api()
    async with _lock("WeightChannel", namespace, name):
        wc = await api.get(API_VERSION, "WeightChannel", namespace, name)
        if wc is None or wc["metadata"].get("deletionTimestamp"):
            return
        channel, error = await asyncio.to_thread(read_channel, wc.get("spec", {}))
        desired = st.weightchannel_status(wc, channel, error)
        old_latest = (wc.get("status") or {}).get("latestVersion")
        changed = await _write_status(wc, desired, "WeightChannel")
    job = wc.get("spec", {}).get("jobName")
    if changed and job:
        # versions moved: group lags and the job's weight version follow
        for sg in await api.list(API_VERSION, "SamplerGroup", namespace, f"{n.LABEL_JOB}={job}"):
            await _quietly(refresh_samplergroup_status(namespace, sg["metadata"]["name"]))
        if desired.get("latestVersion") != old_latest:
            await _quietly(refresh_job_status(namespace, job))


# --- the rebalancer's timer (router engineer) registers itself on import -----------------------------------
try:
    import rlfleet.operator.rebalance_timer  # noqa: F401
except ModuleNotFoundError as _exc:
    if _exc.name != "rlfleet.operator.rebalance_timer":
        raise
