"""The RLJob pipeline (operator/handlers.py): create / spec update / resume -> every child applied (owner
references, common labels), the SamplerGroups no longer in the spec deleted, then the job's status; the
events that re-run it (its trainer StatefulSet, the StatefulSet's FailedCreate, Kueue's Pending on the
trainer's Workload) and the one that heals it (a child of a live job deleted by someone else).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from rlfleet.api import RLJob
from rlfleet.api.common import API_VERSION, GROUP, VERSION
from rlfleet.catalog import get_catalog
from rlfleet.operator import (
    builders,
    kube,
    network_policies,
    parsed_jobs,
    rebalancer,
    replicas,
    sandboxes,
    tokens,
)
from rlfleet.operator import naming as n
from rlfleet.operator import status as st
from rlfleet.operator.admission import collision_message, in_namespace
from rlfleet.operator.decide import replicas_changed_in_rljob, rljob_replicas_reason
from rlfleet.operator.indexes import (
    TRAINER_LABELS,
    View,
    alive,
    is_failed_create,
    is_kueue_pending,
    namespaced,
    owned_by,
    plain,
)
from rlfleet.operator.job_status import rljob_status
from rlfleet.operator.pipelines import coalesced, quietly, reconciled, rerun, write_status
from rlfleet.operator.pods import latest_event_message
from rlfleet.operator.trainer_report import trainer_job_status

log = logging.getLogger("rlfleet.operator")


@kopf.on.resume(GROUP, VERSION, "rljobs")
@kopf.on.create(GROUP, VERSION, "rljobs")
@kopf.on.update(GROUP, VERSION, "rljobs", field="spec")
async def reconcile_rljob(body: kopf.Body, namespace: str | None, reason: str, **kwargs: Any) -> None:
    namespace = namespaced(namespace)
    # an update handler on field "spec" is given that field: `old` is the spec kopf last handled
    old_spec = kwargs.get("old") if reason == kopf.Reason.UPDATE else None
    await reconciled("RLJob", body, reconcile_job(plain(body), namespace, View.of(kwargs), old_spec))


async def reconcile_job(
    body: dict[str, Any], namespace: str, view: View, old_spec: Mapping[str, Any] | None = None
) -> None:
    """Apply every child of the job, delete removed groups, scale the groups whose replicas the RLJob
    changed since `old_spec` (its spec as kopf last handled it), refresh the status."""
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
        if owned_by(sg, body)
    }
    decisions = rebalancer.decisions_of(body)  # the decided weight formats (decide.py), else the RLJob's
    children = builders.build_job_children(
        job,
        namespace,
        body,
        get_catalog(),
        observed,
        network_policies.settings_from_env(),
        sandboxes.role_refs_from_env(),
        decisions.weight_formats(job) if decisions is not None else None,
    )
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
        await _apply_groups(groups, observed)
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
                kube.event_target(body),
                reason="GroupRemoved",
                message=f"deleted SamplerGroup {sg_name} (removed from spec)",
            )
    await _scale_changed(job, namespace, old_spec, observed)
    await refresh_job_status(namespace, name, view)


async def _apply_groups(groups: list[dict[str, Any]], observed: Mapping[str, Mapping[str, Any]]) -> None:
    """The job's SamplerGroups, at once. An existing one is built without replicas: first the operator's
    apply hands them over if it still owns them (an older operator's); a new one is created with the
    RLJob's and released right after (replicas.py)."""
    api = kube.api()
    await asyncio.gather(
        *(
            replicas.hand_over(observed[g["metadata"]["name"]])
            for g in groups
            if g["metadata"]["name"] in observed
        )
    )
    applied = await asyncio.gather(*(api.apply(g) for g in groups))
    await asyncio.gather(
        *(
            replicas.release_after_creation(g, sg)
            for g, sg in zip(groups, applied, strict=True)
            if "replicas" in g["spec"]
        )
    )


async def _scale_changed(
    job: RLJob, namespace: str, old_spec: Mapping[str, Any] | None, observed: Mapping[str, Mapping[str, Any]]
) -> None:
    """The RLJob's change of a group's replicas wins over the group's own (a kubectl scale, the optimizer's):
    through its scale subresource, with a Scaled Event."""
    for group, (before, after) in replicas_changed_in_rljob(old_spec, job).items():
        sg = observed.get(n.samplergroup_name(job.name, group))
        current = ((sg or {}).get("spec") or {}).get("replicas")
        if sg is None or current == after:
            continue
        if (
            await kube.api().scale(API_VERSION, "SamplerGroup", namespace, sg["metadata"]["name"], after)
            is not None
        ):
            # kopf.event, not kopf.info: info is dropped below the operator's posting level (WARNING)
            kopf.event(
                kube.event_target(sg),
                type="Normal",
                reason="Scaled",
                message=f"replicas {current} -> {after}: {rljob_replicas_reason(before, after)}",
            )


def _name_collision(body: dict[str, Any], namespace: str, view: View) -> str | None:
    """Why this job's children would take another's (a SamplerGroup of another job or a standalone one
    under a name this job wants, or a group named like another job's trainer, router, ...), from the
    operator's indexes of the namespace: job `ab` with group `cd-ef` and job `ab-cd` with group `ef` both
    want SamplerGroup `ab-cd-ef`. The job that finds the name taken is the one refused."""
    return collision_message(
        body, in_namespace(view.rljobs, namespace), in_namespace(view.samplergroups, namespace)
    )


async def refresh_job_status(namespace: str, name: str, view: View) -> None:
    """Recompute an RLJob's status from its children; write it (and an Event) only when it changed."""
    await coalesced("RLJob", namespace, name, lambda: _refresh_job_status(namespace, name, view))


async def _refresh_job_status(
    namespace: str, name: str, view: View, job: dict[str, Any] | None = None, invalid: str | None = None
) -> None:
    """The RLJob's pipeline: observe (indexes + the tick's memory) -> job_status.rljob_status -> one apply."""
    job = job or view.one(view.rljobs, (namespace, name))
    if job is None or job["metadata"].get("deletionTimestamp"):
        return
    if invalid is None and isinstance(parsed := parsed_jobs.parse(job), str):
        invalid = parsed
    groups = [g for g in view.all(view.samplergroups_by_job, (namespace, name)) if owned_by(g, job)]
    trainer = view.one(view.trainers, (namespace, n.trainer_name(name)))
    channel = view.one(view.weightchannels, (namespace, n.weightchannel_name(name)))
    memory = rebalancer.observed(job)
    now = st.now_iso()
    desired = rljob_status(
        job,
        groups,
        trainer,
        channel,
        now=now,
        invalid=invalid,
        trainer_pods=view.pods_of(namespace)("trainer", name),
        trainer_create_failure=latest_event_message(
            view.all(view.create_failures, (namespace, n.trainer_name(name)))
        ),
        costs=rebalancer.fleet_costs(result)
        if (result := memory.decisions and memory.decisions.result)
        else None,
        trainer_report=trainer_job_status(job, groups, memory.report, now).status,
        fleet_plan=rebalancer.fleet_plan_status(memory),
        precision_autopilot=rebalancer.precision_autopilot_status(memory),
        decisions=rebalancer.decisions_status(memory),
        trainer_admission=latest_event_message(
            view.all(view.kueue_pending, (namespace, n.trainer_name(name)))
        ),
    )
    await write_status(job, desired, "RLJob")


@kopf.on.event(GROUP, VERSION, "rljobs")
async def rljob_event(name: str, namespace: str | None, type: str | None, **_: Any) -> None:
    """A deleted RLJob's rebalancer memory (shares, EMA, the trainer's report) and its parse are dropped: a
    job created again under the same name starts from its own status. (An event handler, not `on.delete`:
    that would put a finalizer on RLJobs, which must delete without the operator.)"""
    namespace = namespaced(namespace)
    if type == "DELETED":
        rebalancer.forget(namespace, name)
        parsed_jobs.forget(namespace, name)


async def heal_job(namespace: str, name: str, view: View) -> None:
    """A child of a live job was deleted by someone else: the job's pipeline applies its children again."""
    job = view.one(view.rljobs, (namespace, name))
    if alive(job):
        log.warning("child of RLJob %s/%s deleted: re-applying its children", namespace, name)
        await coalesced("RLJob-heal", namespace, name, lambda: rerun(reconcile_job, job, namespace, view))


@kopf.on.event("apps", "v1", "statefulsets", labels=TRAINER_LABELS)
async def trainer_event(body: kopf.Body, namespace: str | None, type: str | None, **kwargs: Any) -> None:
    namespace = namespaced(namespace)
    job = body.get("metadata", {}).get("labels", {}).get(n.LABEL_JOB)
    if job:
        view = View.of(kwargs)
        if type == "DELETED":
            await quietly(heal_job(namespace, job, view))
        await quietly(refresh_job_status(namespace, job, view))


@kopf.on.event("", "v1", "events", when=is_failed_create)
async def create_failure_event(body: kopf.Body, namespace: str | None, **kwargs: Any) -> None:
    """The StatefulSet controller cannot create a trainer pod (the StatefulSet itself does not change): the
    job's pipeline re-runs with the Event's message in the index."""
    await _trainer_event(body, namespaced(namespace), View.of(kwargs))


@kopf.on.event("", "v1", "events", when=is_kueue_pending)
async def kueue_pending_event(body: kopf.Body, namespace: str | None, **kwargs: Any) -> None:
    """Kueue did not admit a Workload (the trainer's pods do not change while gated): when it is a trainer's
    pod group, the job's pipeline re-runs with Kueue's message in the index."""
    await _trainer_event(body, namespaced(namespace), View.of(kwargs))


async def _trainer_event(body: kopf.Body, namespace: str, view: View) -> None:
    """An Event about an object named like a job's trainer (its StatefulSet, its Kueue Workload): that job's
    pipeline re-runs (the Event's message is in the index); any other object's Event is not the
    operator's."""
    involved = body["involvedObject"]["name"]
    job = involved.removesuffix("-trainer")
    if n.trainer_name(job) == involved and view.one(view.rljobs, (namespace, job)) is not None:
        await quietly(refresh_job_status(namespace, job, view))
