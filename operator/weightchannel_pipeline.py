"""The WeightChannel pipeline (operator/handlers.py): observe (the sampler pods in the pod index, then the
store: `channel_read.read_channel`) -> pure compute (`channel.group_versions` with the age-out bound,
`channel.subscribers_to_remove`, `channel_status.weightchannel_status`) -> apply (the reports of gone replicas
removed from the store with `WeightChannel.remove_subscriber`, the status written). Run on create /
resume and by the timer (operator/timer.py) every CHANNEL_STATUS_INTERVAL; a change of the channel's
status re-runs its groups' and its job's pipelines. docs/weights.md, "Subscriber reports".
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from datetime import UTC, datetime
from typing import Any

import kopf

from rlfleet.api.common import GROUP, VERSION
from rlfleet.operator.channel_read import ChannelRead, read_channel
from rlfleet.operator.channel_status import weightchannel_status
from rlfleet.operator.indexes import View, namespaced, plain
from rlfleet.operator.metrics import SUBSCRIBER_REMOVALS, count
from rlfleet.operator.pipelines import locked, quietly, write_status
from rlfleet.operator.rljob_pipeline import refresh_job_status
from rlfleet.operator.samplergroup_pipeline import refresh_samplergroup_status

log = logging.getLogger("rlfleet.operator")

# How often the WeightChannel timer reads the store (the timer itself ticks at the shorter of this and the
# rebalance tick: operator/timer.py).
CHANNEL_STATUS_INTERVAL = float(os.environ.get("RLFLEET_CHANNEL_STATUS_INTERVAL", "10"))

_removal_failing: set[tuple[str, str]] = set()


def _log_removals(namespace: str, name: str, read: ChannelRead, now: datetime) -> None:
    """INFO per removed report, a metric per removal; a failure to remove: WARNING once per streak."""
    from rlfleet.channel import report_age_seconds

    for report in read.removed:
        count(SUBSCRIBER_REMOVALS, "removed")
        log.info(
            "WeightChannel %s/%s: removed the subscriber report of %s/%s (no such pod in its group, last "
            "report %.0f s ago, applied v%s)",
            namespace,
            name,
            report.group,
            report.replica,
            report_age_seconds(report, now),
            report.applied_version,
        )
    key = (namespace, name)
    for _ in range(read.removal_failures):
        count(SUBSCRIBER_REMOVALS, "error")
    if read.removal_failures:
        if key not in _removal_failing:
            _removal_failing.add(key)
            log.warning(
                "WeightChannel %s/%s: cannot remove subscriber reports of gone replicas from the store: %s "
                "(the operator needs write access to subscribers/; those reports pin nothing and count in "
                "no status meanwhile; retried at every read, logged again once it works)",
                namespace,
                name,
                read.removal_error,
            )
    elif key in _removal_failing and read.status is not None:
        _removal_failing.discard(key)  # nothing refused this time: a later failure warns again
        if read.removed:
            log.info("WeightChannel %s/%s: removing subscriber reports works again", namespace, name)


@kopf.on.resume(GROUP, VERSION, "weightchannels")
@kopf.on.create(GROUP, VERSION, "weightchannels")
async def weightchannel_created(name: str, namespace: str | None, body: kopf.Body, **kwargs: Any) -> None:
    namespace = namespaced(namespace)
    await quietly(refresh_weightchannel_status(namespace, name, View.of(kwargs), plain(body)))


_channel_read: dict[tuple[int, str, str], float] = {}


async def refresh_weightchannel_status_when_due(namespace: str, name: str, view: View, tick: float) -> None:
    """The timer's read of the store: when CHANNEL_STATUS_INTERVAL has passed since the last one, less half
    the timer's `tick` (a tick that comes a little early does not put the read off by a whole tick)."""
    key = (id(asyncio.get_running_loop()), namespace, name)
    if time.monotonic() - _channel_read.get(key, -math.inf) >= CHANNEL_STATUS_INTERVAL - tick / 2:
        _channel_read[key] = time.monotonic()
        await refresh_weightchannel_status(namespace, name, view)


async def refresh_weightchannel_status(
    namespace: str, name: str, view: View, wc: dict[str, Any] | None = None
) -> None:
    async with locked("WeightChannel", namespace, name):
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
        desired = weightchannel_status(wc, read.status, read.error, model=read.model)
        await write_status(wc, desired, "WeightChannel")


@kopf.on.event(GROUP, VERSION, "weightchannels")
async def weightchannel_event(
    body: kopf.Body, name: str, namespace: str | None, type: str | None, **kwargs: Any
) -> None:
    """Channel status moved (new version, a group applied one): group lags and the job's version follow.
    Deleted: what the operator kept for the channel (its timer's last store read, a removal failure
    streak) is dropped."""
    namespace = namespaced(namespace)
    if type == "DELETED":
        for key in [k for k in _channel_read if k[1:] == (namespace, name)]:
            del _channel_read[key]
        _removal_failing.discard((namespace, name))
    job = body.get("spec", {}).get("jobName")
    if not job:
        return
    view = View.of(kwargs)
    for sg in view.all(view.samplergroups_by_job, (namespace, job)):
        await quietly(refresh_samplergroup_status(namespace, sg["metadata"]["name"], view))
    await quietly(refresh_job_status(namespace, job, view))
