"""The SamplerGroup pipeline (operator/handlers.py): create / spec update / resume -> its Deployment and
Service applied, then the group's status; the events that re-run it (its Deployment, its pods, a pod's
FailedMount) and the one that heals it (its Deployment deleted by someone else). A group's own events
re-run its job's pipeline too (a job's group deleted by someone else is applied again by the job).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
from pydantic import ValidationError

from rlfleet.api import SamplerGroup, StoreSpec, format_validation_error
from rlfleet.api.common import API_VERSION, GROUP, VERSION
from rlfleet.catalog import get_catalog
from rlfleet.operator import builders, kube, rebalancer, tokens
from rlfleet.operator import naming as n
from rlfleet.operator import status as st
from rlfleet.operator.group_status import quarantine_reason, samplergroup_status
from rlfleet.operator.indexes import (
    POD_LABELS,
    SAMPLER_LABELS,
    View,
    alive,
    is_failed_mount,
    namespaced,
    owned_by,
    plain,
    pod_owner,
)
from rlfleet.operator.pipelines import coalesced, quietly, reconciled, rerun, write_status
from rlfleet.operator.rljob_pipeline import heal_job, refresh_job_status
from rlfleet.operator.trainer_report import trainer_job_status

log = logging.getLogger("rlfleet.operator")


@kopf.on.resume(GROUP, VERSION, "samplergroups")
@kopf.on.create(GROUP, VERSION, "samplergroups")
@kopf.on.update(GROUP, VERSION, "samplergroups", field="spec")
async def reconcile_samplergroup(body: kopf.Body, namespace: str | None, **kwargs: Any) -> None:
    namespace = namespaced(namespace)
    await reconciled("SamplerGroup", body, reconcile_group(plain(body), namespace, View.of(kwargs)))


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
    await coalesced(
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
    desired = samplergroup_status(
        sg,
        deployment,
        get_catalog(),
        (wc or {}).get("status"),
        pods=view.pods_of(namespace)("sampler", name),
        rebalance=group.status_patch() if group is not None else None,
        quarantine=quarantine_reason(
            sg, collapse, decision.held_quarantine if decision is not None else None
        ),
    )
    await write_status(sg, desired, "SamplerGroup")


async def heal_group(namespace: str, name: str, view: View) -> None:
    """The Deployment of a live SamplerGroup was deleted by someone else: the group's pipeline runs again."""
    sg = view.one(view.samplergroups, (namespace, name))
    if alive(sg):
        log.warning("Deployment of SamplerGroup %s/%s deleted: re-applying it", namespace, name)
        await coalesced(
            "SamplerGroup-heal", namespace, name, lambda: rerun(reconcile_group, sg, namespace, view)
        )


@kopf.on.event("apps", "v1", "deployments", labels=SAMPLER_LABELS)
async def sampler_deployment_event(
    body: kopf.Body, namespace: str | None, type: str | None, **kwargs: Any
) -> None:
    namespace = namespaced(namespace)
    sg_name = body.get("metadata", {}).get("labels", {}).get(n.LABEL_SAMPLERGROUP)
    if sg_name:
        view = View.of(kwargs)
        if type == "DELETED":
            await quietly(heal_group(namespace, sg_name, view))
        await quietly(refresh_samplergroup_status(namespace, sg_name, view))


@kopf.on.event(GROUP, VERSION, "samplergroups")
async def samplergroup_event(
    body: kopf.Body, name: str, namespace: str | None, type: str | None, **kwargs: Any
) -> None:
    namespace = namespaced(namespace)
    job = body.get("spec", {}).get("jobName")
    if type != "DELETED":  # the rebalancer moved the share: sharePercent follows (no write if unchanged)
        await quietly(refresh_samplergroup_status(namespace, name, View.of(kwargs)))
    if job:
        view = View.of(kwargs)
        if type == "DELETED":
            job_body = view.one(view.rljobs, (namespace, job))
            wanted = {g.get("name") for g in (job_body or {}).get("spec", {}).get("samplerGroups", [])}
            if body.get("spec", {}).get("name") in wanted and owned_by(body, job_body or {"metadata": {}}):
                await quietly(heal_job(namespace, job, view))
        await quietly(refresh_job_status(namespace, job, view))


@kopf.on.event("", "v1", "pods", labels=POD_LABELS)
async def pod_event(body: kopf.Body, namespace: str | None, **kwargs: Any) -> None:
    """A pod of the operator's moved (scheduled, ready, waiting on an image, crash-looping, gone): its
    owner's pipeline re-runs (the pod index has the new view; no write when the status is the same)."""
    namespace = namespaced(namespace)
    owner = pod_owner(body.get("metadata", {}).get("labels") or {})
    if owner is None:
        return
    view = View.of(kwargs)
    component, name = owner
    if component == "sampler":
        await quietly(refresh_samplergroup_status(namespace, name, view))
    elif component == "trainer":
        await quietly(refresh_job_status(namespace, name, view))


@kopf.on.event("", "v1", "events", when=is_failed_mount)
async def mount_failure_event(body: kopf.Body, namespace: str | None, **kwargs: Any) -> None:
    """The kubelet cannot mount a volume of one of the operator's pods (the pod itself does not change):
    its owner's pipeline re-runs with the new message in the index."""
    namespace = namespaced(namespace)
    view = View.of(kwargs)
    owner = view.owner_of_pod(namespace, body["involvedObject"]["name"])
    if owner is None:
        return
    component, name = owner
    if component == "sampler":
        await quietly(refresh_samplergroup_status(namespace, name, view))
    elif component == "trainer":
        await quietly(refresh_job_status(namespace, name, view))
