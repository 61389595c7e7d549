"""The one timer: on each job's WeightChannel, the tick of the job's pipelines (operator/handlers.py).

No timer on RLJobs or SamplerGroups: kopf puts a finalizer on every object with a timer, and deleting an
RLJob must not hang when the operator is gone (docs/operations.md). It writes nothing to the API itself:
the pipelines it runs do.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import kopf

from rlfleet.api.common import GROUP, VERSION
from rlfleet.operator import kube, rebalancer
from rlfleet.operator.indexes import View, alive, namespaced, owned_by
from rlfleet.operator.pipelines import quietly
from rlfleet.operator.rljob_pipeline import refresh_job_status
from rlfleet.operator.samplergroup_pipeline import refresh_samplergroup_status
from rlfleet.operator.weightchannel_pipeline import (
    CHANNEL_STATUS_INTERVAL,
    refresh_weightchannel_status_when_due,
)

log = logging.getLogger("rlfleet.operator")

TIMER_INTERVAL = min(CHANNEL_STATUS_INTERVAL, rebalancer.TICK_SECONDS)


@kopf.timer(GROUP, VERSION, "weightchannels", interval=TIMER_INTERVAL, initial_delay=TIMER_INTERVAL)
async def weightchannel_timer(
    name: str,
    namespace: str | None,
    body: kopf.Body,
    stopped: kopf.DaemonStopped | None = None,
    **kwargs: Any,
) -> None:
    """The tick of the job's pipelines (`_tick`). A tick the operator's stop cuts short is not a failure:
    kopf leaves a timer that is mid-tick at stop orphaned (timers have no cancellation timeout) and the
    cleanup then closes the API client under it; the tick's writes are idempotent, the next operator's
    first tick does them again. `stopped` is kopf's stop flag of this timer."""
    namespace = namespaced(namespace)
    try:
        await _tick(name, namespace, body, View.of(kwargs))
    except Exception as exc:
        if not stopped:
            raise
        log.info("tick of %s/%s cut short by the operator's stop: %r", namespace, name, exc)


async def _tick(name: str, namespace: str, body: kopf.Body, view: View) -> None:
    """Read the store (every CHANNEL_STATUS_INTERVAL), run the rebalance tick (observe: scrapes, shares,
    router push), then the same status pipelines the events run."""
    await quietly(refresh_weightchannel_status_when_due(namespace, name, view, TIMER_INTERVAL))
    job_name = body.get("spec", {}).get("jobName")
    job = view.one(view.rljobs, (namespace, job_name)) if job_name else None
    if not alive(job):
        return
    groups = [g for g in view.all(view.samplergroups_by_job, (namespace, job_name)) if owned_by(g, job)]
    try:
        decided = await rebalancer.rebalance_job(
            copy.deepcopy(job), namespace, groups, view.pods_of(namespace)
        )
        if decided is not None:  # written into the RLJob's status first, then carried out
            await quietly(refresh_job_status(namespace, job_name, view))
            await rebalancer.act(copy.deepcopy(job), namespace, groups, view.pods_of(namespace), decided)
    except kube.KubeError as exc:
        log.warning("rebalance of %s/%s failed: %s", namespace, job_name, exc)
        decided = None
    if decided is not None:
        for sg in groups:
            await quietly(refresh_samplergroup_status(namespace, sg["metadata"]["name"], view))
    await quietly(refresh_job_status(namespace, job_name, view))  # also the safety net of the roll-up
