"""How the operator's pipelines run (operator/handlers.py): one at a time per object, a burst of events
coalesced into one run in flight plus one queued, API errors mapped to kopf's retries or logged, and THE
status writer, the one place a status is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import kopf

from rlfleet.operator import kube
from rlfleet.operator import status as st
from rlfleet.operator.indexes import View
from rlfleet.operator.metrics import RECONCILE_SECONDS, RECONCILES, STATUS_WRITES, count

log = logging.getLogger("rlfleet.operator")

# Per-object runtime state lives in module dicts, not in kopf's per-object `memo`: an object's pipeline is
# run by the events of other objects (a pod's event runs its group's pipeline, the WeightChannel's timer
# the job's), and a memo belongs to the object being handled. So each entry is dropped as soon as it is
# not needed: a lock when no pipeline of its object runs or waits (`locked`), the timer's read times, the
# rebalancer's memory and the parsed RLJob on the object's DELETED event (`rljob_event`,
# `weightchannel_event`).
_Key = tuple[int, str, str, str]  # (event loop, kind, namespace, name)
_locks: dict[_Key, asyncio.Lock] = {}
_lock_users: dict[_Key, int] = {}  # pipelines holding or waiting for each lock
_queued: set[_Key] = set()


def _key(kind: str, namespace: str, name: str) -> _Key:
    return id(asyncio.get_running_loop()), kind, namespace, name


@contextlib.asynccontextmanager
async def locked(kind: str, namespace: str, name: str) -> AsyncIterator[None]:
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


async def coalesced(kind: str, namespace: str, name: str, refresh: Callable[[], Awaitable[None]]) -> None:
    """Run `refresh()` under the object's lock, with at most one waiter per object: a burst of child
    events becomes one refresh in flight plus one queued (which sees the state after the burst)."""
    key = _key(kind, namespace, name)
    if key in _queued:
        return
    _queued.add(key)
    try:
        async with locked(kind, namespace, name):
            _queued.discard(key)
            await refresh()
    finally:
        _queued.discard(key)


def temporary_error(exc: kube.KubeError) -> kopf.TemporaryError:
    return kopf.TemporaryError(str(exc), delay=2 if exc.status in (409, 429, 500, 503, 504) else 5)


async def reconciled(kind: str, body: kopf.Body, reconcile: Awaitable[None]) -> None:
    """Run a kopf reconcile handler's pipeline of one `kind` object, counting its result (ok, invalid: a
    kopf.PermanentError, error: an API error) and its seconds; an API error is posted on the object as a
    ReconcileError Event and retried (`temporary_error`)."""
    started = time.perf_counter()
    try:
        await reconcile
        count(RECONCILES, kind, "ok")
    except kopf.PermanentError:
        count(RECONCILES, kind, "invalid")
        raise
    except kube.KubeError as exc:
        count(RECONCILES, kind, "error")
        kopf.warn(body, reason="ReconcileError", message=str(exc)[:1000])
        raise temporary_error(exc) from None
    finally:
        if RECONCILE_SECONDS is not None:
            RECONCILE_SECONDS.labels(kind).observe(time.perf_counter() - started)


async def quietly(coro: Awaitable[None]) -> None:
    """Event handlers must not fail the watch: log API errors, the next event or timer retries."""
    try:
        await coro
    except kube.KubeError as exc:
        log.warning("status refresh failed: %s", exc)


async def write_status(obj: dict[str, Any], desired: dict[str, Any], kind: str) -> bool:
    """THE status writer: server-side apply of the whole status (as `STATUS_FIELD_MANAGER`) when a field
    changed; an Event on each phase and CollapseRisk transition."""
    old = obj.get("status") or {}
    if not st.status_changed(old, desired):
        return False
    if await kube.api().patch_status(obj, desired) is None:
        return False  # deleted meanwhile
    count(STATUS_WRITES, kind)
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
            kopf.event(
                kube.event_target(obj),
                type="Warning" if on else "Normal",
                reason=risk_after["reason"] if on else "CollapseRiskCleared",
                message=risk_after.get("message", "")[:1000],
            )
    obj["status"] = {**old, **desired}  # our copy now reflects the write (the index catches up on the event)
    return True


def _condition(status: Mapping[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)


async def rerun(
    pipeline: Callable[[dict[str, Any], str, View], Awaitable[None]],
    body: Mapping[str, Any],
    namespace: str,
    view: View,
) -> None:
    """A pipeline run by an event: an invalid spec or a missing channel is the kopf handler's to report
    (and retry); here it is logged."""
    try:
        await pipeline(copy.deepcopy(dict(body)), namespace, view)
    except (kopf.PermanentError, kopf.TemporaryError) as exc:
        log.info("%s/%s not re-applied: %s", namespace, body["metadata"]["name"], exc)
