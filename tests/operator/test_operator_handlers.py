"""The kopf handlers without a cluster, as KubeRay's fake-client tests: the handlers run for real against a
fake `KubeApi` (it records every write and answers reads from a dict) and hand-built index views; kopf's
own event poster runs into a queue the test reads.

What is held: the RLJob pipeline (children in apply order, the admin Secret, removed groups deleted, an
invalid spec or a child the API refuses ends in a status that says so), the SamplerGroup pipeline (its
channel's store from the index or the API, a Deployment deleted by someone else applied again), the one
status writer (a status differing only in one condition IS written, an unchanged one is not), the
rebalancer's state after a restart (seeded from the NEWEST history entry), and the runtime state per object
(locks, the timer's read times, the rebalancer's memory) gone once its object is."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kopf
import pytest
from kopf._core.engines import posting
from support.fake_kube import FakeKube

from rlfleet.api import RLJob
from rlfleet.catalog import get_catalog
from rlfleet.operator import (
    kube,
    parsed_jobs,
    pipelines,
    rebalancer,
    rljob_pipeline,
    samplergroup_pipeline,
    timer,
    weightchannel_pipeline,
)
from rlfleet.operator.group_status import samplergroup_status
from rlfleet.operator.indexes import (
    View,
    create_failures_idx,
    is_failed_create,
    is_kueue_pending,
    kueue_pending_idx,
    pods_idx,
)

NS = "team-a"
API = "rlfleet.dev/v1alpha1"


@pytest.fixture()
async def api(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeKube]:
    fake = FakeKube()
    monkeypatch.setattr(kube, "api", lambda: fake)
    yield fake
    await rljob_pipeline.rljob_event(
        name="j", namespace=NS, type="DELETED"
    )  # what the operator keeps of job j goes


def posted() -> asyncio.Queue:
    """kopf's event poster pointed at a queue in this task's context (what the operator's poster drains)."""
    queue: asyncio.Queue = asyncio.Queue()
    posting.settings_var.set(kopf.OperatorSettings())
    posting.event_queue_var.set(queue)
    posting.event_queue_loop_var.set(asyncio.get_running_loop())
    return queue


def drain(queue: asyncio.Queue) -> list[Any]:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


def rljob(name: str = "j", groups: tuple[str, ...] = ("a", "b"), **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "RLJob",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1},
        "spec": {
            "model": {"name": "m", "path": "/m"},
            "samplerGroups": [
                {"name": g, "accelerator": "h100", "replicas": 1, "weightFormat": "bf16"} for g in groups
            ],
            "weightChannel": {"store": {"type": "filesystem", "path": "/w"}},
            **spec,
        },
    }


def samplergroup(
    name: str, job: dict[str, Any] | None = None, status: dict[str, Any] | None = None, **meta: Any
) -> dict[str, Any]:
    """A SamplerGroup as the job's builder makes it (owned by `job` when given)."""
    spec = {
        "name": name,
        "accelerator": "h100",
        "replicas": 1,
        "weightFormat": "bf16",
        "model": {"name": "m", "path": "/m"},
    }
    metadata: dict[str, Any] = {
        "name": f"j-{name}",
        "namespace": NS,
        "uid": f"uid-sg-{name}",
        "generation": 1,
        **meta,
    }
    if job is not None:
        spec |= {"jobName": job["metadata"]["name"], "weightChannel": "j-weights"}
        metadata["ownerReferences"] = [
            {
                "apiVersion": API,
                "kind": "RLJob",
                "name": job["metadata"]["name"],
                "uid": job["metadata"]["uid"],
                "controller": True,
            }
        ]
    return {
        "apiVersion": API,
        "kind": "SamplerGroup",
        "metadata": metadata,
        "spec": spec,
        "status": status or {},
    }


def weightchannel(path: str = "/w") -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "WeightChannel",
        "metadata": {"name": "j-weights", "namespace": NS, "uid": "uid-wc", "generation": 1},
        "spec": {"jobName": "j", "store": {"type": "filesystem", "path": path}},
    }


def indexes(*objects: dict[str, Any]) -> dict[str, dict]:
    """The handlers' index kwargs (named as kopf passes them) holding `objects`."""
    idx: dict[str, dict] = {
        name: {}
        for name in (
            "rljobs_idx",
            "samplergroups_idx",
            "samplergroups_by_job_idx",
            "weightchannels_idx",
            "sampler_deployments_idx",
            "trainers_idx",
            "pods_idx",
            "mount_failures_idx",
            "create_failures_idx",
            "kueue_pending_idx",
        )
    }
    for obj in objects:
        key = (obj["metadata"].get("namespace", NS), obj["metadata"]["name"])
        kind = obj["kind"]
        if kind == "RLJob":
            idx["rljobs_idx"][key] = [obj]
        elif kind == "WeightChannel":
            idx["weightchannels_idx"][key] = [obj]
        elif kind == "SamplerGroup":
            idx["samplergroups_idx"][key] = [obj]
            if obj["spec"].get("jobName"):
                idx["samplergroups_by_job_idx"].setdefault((NS, obj["spec"]["jobName"]), []).append(obj)
        elif kind == "Deployment":
            idx["sampler_deployments_idx"][key] = [obj]
    return idx


# --- the RLJob pipeline ----------------------------------------------------------------------------------


async def test_reconcile_job_applies_children_in_order_creates_the_secret_and_deletes_removed_groups(
    api: FakeKube,
) -> None:
    events = posted()
    job = rljob(groups=("a", "b"))
    removed = samplergroup("old", job)  # owned, no longer in the spec: deleted
    foreign = samplergroup("x", {**job, "metadata": {**job["metadata"], "uid": "another-job"}})  # kept
    api.objects.update({("SamplerGroup", "j-old"): removed, ("SamplerGroup", "j-x"): foreign})
    view = View.of(indexes(job, removed, foreign))

    await rljob_pipeline.reconcile_job(copy.deepcopy(job), NS, view)

    kinds = api.kinds_applied()
    assert sorted(kinds[:8]) == sorted(
        [
            "NetworkPolicy",
            "NetworkPolicy",
            "ConfigMap",
            "WeightChannel",
            "Service",
            "StatefulSet",
            "Service",
            "Deployment",
        ]
    )
    assert kinds[8:] == ["SamplerGroup", "SamplerGroup"]  # the groups only once the trainer was applied
    assert {b["metadata"]["name"] for b in api.applied[8:]} == {"j-a", "j-b"}
    assert all(b["metadata"]["ownerReferences"][0]["uid"] == "uid-j" for b in api.applied)
    assert [(b["kind"], b["metadata"]["name"]) for b in api.created] == [
        ("Secret", "j-router-admin"),
        ("Secret", "j-api-key"),
    ]
    assert all(b["metadata"]["ownerReferences"][0]["uid"] == "uid-j" for b in api.created)
    assert len(api.created[1]["stringData"]["key"]) >= 43  # 32 random bytes
    assert api.deleted == [("SamplerGroup", "j-old")]
    assert [e.reason for e in drain(events)] == ["GroupRemoved", "PhasePending"]
    ((kind, name, status),) = api.statuses
    assert (kind, name, status["phase"]) == ("RLJob", "j", "Pending")

    secret, key = api.objects[("Secret", "j-router-admin")], api.objects[("Secret", "j-api-key")]
    await rljob_pipeline.reconcile_job(copy.deepcopy(job), NS, view)
    # never replaced: the key is never rotated by a reconcile
    assert api.objects[("Secret", "j-router-admin")] == secret and len(api.created) == 2
    assert api.objects[("Secret", "j-api-key")] == key


async def test_an_invalid_rljob_ends_in_a_failed_status_and_a_warning(api: FakeKube) -> None:
    events = posted()
    job = rljob()
    job["spec"]["samplerGroups"][1]["name"] = "a"  # two groups of one name: two SamplerGroups j-a
    with pytest.raises(kopf.PermanentError, match="invalid RLJob"):
        await rljob_pipeline.reconcile_job(copy.deepcopy(job), NS, View.of(indexes(job)))
    assert api.applied == [] and api.created == []
    ((_, _, status),) = api.statuses
    assert status["phase"] == "Failed" and status["message"].startswith("invalid RLJob")
    assert [(e.type, e.reason) for e in drain(events)] == [
        ("Warning", "InvalidSpec"),
        ("Warning", "PhaseFailed"),
    ]


async def test_a_job_whose_group_name_another_jobs_group_took_is_failed_naming_the_owner(
    api: FakeKube,
) -> None:
    """Job `ab` with group `cd-ef` and job `ab-cd` with group `ef` both want SamplerGroup `ab-cd-ef`. Without
    the webhook, the job that finds it taken applies nothing and is Failed naming the owner; the owner's
    next reconcile goes on (no ownership flip on every reconcile)."""
    events = posted()
    first, second = rljob("ab", groups=("cd-ef",)), rljob("ab-cd", groups=("ef",))
    taken = samplergroup("cd-ef", first)
    taken["metadata"]["name"] = "ab-cd-ef"
    taken["spec"]["jobName"] = "ab"
    view = View.of(indexes(first, second, taken))
    with pytest.raises(kopf.PermanentError, match="taken by SamplerGroup ab-cd-ef of RLJob ab"):
        await rljob_pipeline.reconcile_job(copy.deepcopy(second), NS, view)
    assert api.applied == [] and api.created == []
    ((kind, name, status),) = api.statuses
    assert (kind, name, status["phase"]) == ("RLJob", "ab-cd", "Failed")
    assert "taken by SamplerGroup ab-cd-ef of RLJob ab: rename this job or its group" in status["message"]
    assert [(e.type, e.reason) for e in drain(events)] == [
        ("Warning", "NameCollision"),
        ("Warning", "PhaseFailed"),
    ]
    await rljob_pipeline.reconcile_job(copy.deepcopy(first), NS, view)  # the owner is not refused
    assert ("SamplerGroup", "ab-cd-ef") in [(b["kind"], b["metadata"]["name"]) for b in api.applied]
    for name in ("ab", "ab-cd"):
        await rljob_pipeline.rljob_event(name=name, namespace=NS, type="DELETED")


async def test_a_child_the_api_server_refuses_stops_the_job_with_the_api_s_reason(api: FakeKube) -> None:
    posted()
    job = rljob()
    api.refuse["SamplerGroup"] = kube.KubeError(
        422, 'SamplerGroup "j-a" is invalid: spec.accelerator', "Invalid"
    )
    with pytest.raises(kopf.PermanentError, match="the API server refused a child"):
        await rljob_pipeline.reconcile_job(copy.deepcopy(job), NS, View.of(indexes(job)))
    ((_, _, status),) = api.statuses
    assert status["phase"] == "Failed" and 'SamplerGroup "j-a" is invalid' in status["message"]


async def test_a_transient_api_error_is_retried_by_kopf_not_reported_as_invalid(api: FakeKube) -> None:
    posted()
    job = rljob()
    api.refuse["ConfigMap"] = kube.KubeError(503, "etcd leader changed", "ServiceUnavailable")
    body = kopf.Body(copy.deepcopy(job))
    with pytest.raises(kopf.TemporaryError) as retried:
        await rljob_pipeline.reconcile_rljob(
            body=body, namespace=NS, reason="create", old=None, **indexes(job)
        )
    assert retried.value.delay == 2 and api.statuses == []


async def test_the_rljobs_change_of_a_groups_replicas_scales_it_at_once_other_reconciles_leave_them(
    api: FakeKube,
) -> None:
    """kopf hands the update handler (field "spec") the spec it last handled as `old`: a group whose replicas
    the RLJob changed is scaled through /scale (a Scaled Event), whatever it runs now (a kubectl scale to
    5 here); a create or resume (old: none, or the whole body) scales nothing, and no apply carries them."""
    events = posted()
    job = rljob(groups=("a", "b"))
    groups = [samplergroup(g, job) for g in ("a", "b")]
    groups[0]["spec"]["replicas"] = 5
    changed = copy.deepcopy(job)
    changed["spec"]["samplerGroups"][0]["replicas"] = 3
    await rljob_pipeline.reconcile_rljob(
        body=kopf.Body(copy.deepcopy(changed)),
        namespace=NS,
        reason="resume",
        old=copy.deepcopy(job),
        **indexes(changed, *groups),
    )
    assert api.scaled == [] and all(
        "replicas" not in b["spec"] for b in api.applied if b["kind"] == "SamplerGroup"
    )
    await rljob_pipeline.reconcile_rljob(
        body=kopf.Body(copy.deepcopy(changed)),
        namespace=NS,
        reason="update",
        old=copy.deepcopy(job["spec"]),
        **indexes(changed, *groups),
    )
    assert api.scaled == [("SamplerGroup", "j-a", 3)]
    scaled = [e.message for e in drain(events) if e.reason == "Scaled"]
    assert scaled == ["replicas 5 -> 3: the RLJob's samplerGroups[].replicas changed: 1 -> 3"]


async def test_a_group_of_the_spec_deleted_by_someone_else_is_applied_again_by_the_job_pipeline(
    api: FakeKube,
) -> None:
    posted()
    job = rljob(groups=("a",))
    for deleted, applied in ((samplergroup("a", job), True), (samplergroup("old", job), False)):
        api.applied.clear()
        await samplergroup_pipeline.samplergroup_event(
            body=kopf.Body(deleted),
            name=deleted["metadata"]["name"],
            namespace=NS,
            type="DELETED",
            **indexes(job),
        )
        names = {b["metadata"]["name"] for b in api.applied if b["kind"] == "SamplerGroup"}
        assert names == ({"j-a"} if applied else set()), deleted["metadata"]["name"]


# --- the SamplerGroup pipeline ---------------------------------------------------------------------------


def job_and_group_a_posting() -> tuple[dict[str, Any], dict[str, Any]]:
    """Job j and its SamplerGroup a, with kopf's event poster set in the calling test's task (`posted`:
    context variables, which a fixture's task would not pass on)."""
    posted()
    job = rljob()
    return job, samplergroup("a", job)


async def test_reconcile_group_takes_the_store_from_the_index_or_the_api(
    api: FakeKube, tmp_path: Path
) -> None:
    job, sg = job_and_group_a_posting()
    wc = weightchannel(str(tmp_path))
    await samplergroup_pipeline.reconcile_group(copy.deepcopy(sg), NS, View.of(indexes(job, sg, wc)))
    assert api.kinds_applied() == ["Service", "Deployment"]
    deployment = api.applied[1]
    sync = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "weight-sync")
    assert sync["args"][sync["args"].index("--store") + 1] == str(tmp_path)

    api.applied.clear()
    api.objects[("WeightChannel", "j-weights")] = wc  # not in the index yet: read from the API
    await samplergroup_pipeline.reconcile_group(copy.deepcopy(sg), NS, View.of(indexes(job, sg)))
    assert api.kinds_applied() == ["Service", "Deployment"]

    api.applied.clear()
    del api.objects[("WeightChannel", "j-weights")]
    with pytest.raises(kopf.TemporaryError, match="WeightChannel j-weights not found yet"):
        await samplergroup_pipeline.reconcile_group(copy.deepcopy(sg), NS, View.of(indexes(job, sg)))
    assert api.applied == []
    assert api.created == []  # a job's group uses the job's key Secret


async def test_a_group_outside_any_job_gets_its_own_key_secret_once(api: FakeKube) -> None:
    posted()
    sg = samplergroup("solo")
    for _ in range(2):
        await samplergroup_pipeline.reconcile_group(copy.deepcopy(sg), NS, View.of(indexes(sg)))
    ((secret),) = api.created  # created once, never replaced
    assert (secret["kind"], secret["metadata"]["name"]) == ("Secret", "j-solo-api-key")
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-sg-solo"
    engine = api.applied[-1]["spec"]["template"]["spec"]["containers"][0]
    assert {
        "name": "RLFLEET_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "j-solo-api-key", "key": "key"}},
    } in engine["env"]


async def test_a_deployment_deleted_under_a_live_group_is_applied_again_by_the_group_pipeline(
    api: FakeKube, tmp_path: Path
) -> None:
    job, sg = job_and_group_a_posting()
    gone = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "j-a", "namespace": NS, "labels": {"rlfleet.dev/samplergroup": "j-a"}},
    }
    idx = indexes(job, sg, weightchannel(str(tmp_path)))
    await samplergroup_pipeline.sampler_deployment_event(
        body=kopf.Body(gone), namespace=NS, type="DELETED", **idx
    )
    assert api.kinds_applied() == ["Service", "Deployment"]
    assert api.applied[1]["metadata"]["ownerReferences"][0]["uid"] == "uid-sg-a"
    assert [k for k, _, _ in api.statuses] == ["SamplerGroup"]

    api.applied.clear()
    deleting = samplergroup("a", job, deletionTimestamp="2026-01-01T00:00:00Z")  # the group itself is going
    idx = indexes(job, deleting, weightchannel(str(tmp_path)))
    await samplergroup_pipeline.sampler_deployment_event(
        body=kopf.Body(gone), namespace=NS, type="DELETED", **idx
    )
    modified = {**gone, "status": {"readyReplicas": 1}}
    await samplergroup_pipeline.sampler_deployment_event(
        body=kopf.Body(modified),
        namespace=NS,
        type="MODIFIED",
        **indexes(job, sg, weightchannel(str(tmp_path))),
    )
    assert api.applied == []  # neither a deleting group nor a Deployment that only changed is re-applied


# --- the one status writer -------------------------------------------------------------------------------


def current_status(sg: dict[str, Any]) -> dict[str, Any]:
    """What the group's pipeline computes for `sg` with nothing else observed."""
    return samplergroup_status(sg, None, get_catalog(), None, pods=[], rebalance=None, quarantine=None)


async def test_a_status_differing_only_in_one_condition_is_written_and_an_equal_one_is_not(
    api: FakeKube,
) -> None:
    """Kills the mutant of the change gate that never compares conditions (in `status.status_changed`,
    the `if key == "conditions"` branch not returning True, or comparing only condition types): then the
    second refresh below writes nothing and the group keeps saying the old reason."""
    posted()
    sg = samplergroup("a")
    sg["status"] = current_status(sg)
    view = View.of(indexes(sg))
    await samplergroup_pipeline.refresh_samplergroup_status(NS, "j-a", view)
    assert api.statuses == []  # nothing changed: no write

    stale = copy.deepcopy(sg)
    ready = next(c for c in stale["status"]["conditions"] if c["type"] == "Ready")
    ready["message"], ready["reason"] = "0/1 replicas ready (before)", "Starting"  # the only difference
    await samplergroup_pipeline.refresh_samplergroup_status(NS, "j-a", View.of(indexes(stale)))
    ((kind, name, written),) = api.statuses
    assert (kind, name) == ("SamplerGroup", "j-a")
    assert next(c for c in written["conditions"] if c["type"] == "Ready") == next(
        c for c in sg["status"]["conditions"] if c["type"] == "Ready"
    )


async def test_a_trainer_pod_the_quota_refuses_reaches_the_job_status_from_the_statefulsets_event(
    api: FakeKube,
) -> None:
    """The StatefulSet controller's FailedCreate Event (the StatefulSet itself does not change) runs the job's
    pipeline, which reads it from the index: the job says the quota's words, not `Pending / Reconciling`."""
    posted()
    job = rljob(groups=("a",))
    quota = (
        'create Pod j-trainer-0 in StatefulSet j-trainer failed error: pods "j-trainer-0" is forbidden: '
        "exceeded quota: compute, requested: nvidia.com/gpu=8, used: nvidia.com/gpu=0, limited: nvidia.com/gpu=4"
    )
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "reason": "FailedCreate",
        "type": "Warning",
        "message": quota,
        "involvedObject": {"kind": "StatefulSet", "name": "j-trainer", "namespace": NS},
        "lastTimestamp": "2026-01-01T00:00:00Z",
    }
    foreign = {**event, "involvedObject": {"kind": "StatefulSet", "name": "db", "namespace": NS}}
    assert is_failed_create(event) and is_failed_create(foreign)
    assert not is_failed_create({**event, "reason": "SuccessfulCreate"})
    idx = indexes(job)
    idx["trainers_idx"][(NS, "j-trainer")] = [
        {
            "metadata": {"name": "j-trainer", "generation": 1},
            "spec": {"replicas": 1},
            "status": {"replicas": 0},
        }
    ]
    for body in (event, foreign):
        for key, value in create_failures_idx(NS, body).items():
            idx["create_failures_idx"].setdefault(key, []).append(value)

    await rljob_pipeline.create_failure_event(
        foreign, NS, **idx
    )  # another StatefulSet's Event: no job to refresh
    assert api.statuses == []
    await rljob_pipeline.create_failure_event(event, NS, **idx)
    ((kind, name, status),) = api.statuses
    assert (kind, name, status["phase"], status["reason"]) == ("RLJob", "j", "Degraded", "ReplicaFailure")
    assert "exceeded quota: compute" in status["message"]


async def test_kueues_pending_event_on_the_trainers_workload_reaches_the_job_status(api: FakeKube) -> None:
    """Kueue's `Pending` Event on the trainer's pod-group Workload (named after the StatefulSet) runs the job's
    pipeline; with the trainer's pods held by Kueue's gate the job is Pending in Kueue's words (the Event
    as Kueue v0.17.0 wrote it in tests/operator/test_operator_cluster_kueue.py)."""
    posted()
    job = rljob(groups=("a",))
    said = (
        "couldn't assign flavors to pod set 17cc84b9: insufficient quota for nvidia.com/gpu in flavor on-demand, "
        "previously considered podsets requests (0) + current podset request (8) > maximum capacity (4)"
    )
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "reason": "Pending",
        "type": "Warning",
        "message": said,
        "involvedObject": {
            "kind": "Workload",
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "name": "j-trainer",
            "namespace": NS,
        },
        "lastTimestamp": "2026-01-01T00:00:00Z",
    }
    other = {**event, "involvedObject": {**event["involvedObject"], "name": "pod-j-a-5d8f-x2-1a2b3"}}
    assert is_kueue_pending(event) and is_kueue_pending(other)
    assert not is_kueue_pending({**event, "reason": "QuotaReserved"})
    assert not is_kueue_pending({**event, "involvedObject": {"kind": "Pod", "name": "j-trainer-0"}})
    idx = indexes(job)
    idx["trainers_idx"][(NS, "j-trainer")] = [
        {
            "metadata": {"name": "j-trainer", "generation": 1},
            "spec": {"replicas": 1},
            "status": {"replicas": 1},
        }
    ]
    gated = {
        "metadata": {
            "name": "j-trainer-0",
            "labels": {
                "app.kubernetes.io/component": "trainer",
                "rlfleet.dev/job": "j",
                "kueue.x-k8s.io/queue-name": "q",
            },
        },
        "spec": {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]},
        "status": {"phase": "Pending"},
    }
    for key, value in pods_idx(NS, gated).items():
        idx["pods_idx"].setdefault(key, []).append(value)
    for body in (event, other):
        for key, value in kueue_pending_idx(NS, body).items():
            idx["kueue_pending_idx"].setdefault(key, []).append(value)

    await rljob_pipeline.kueue_pending_event(other, NS, **idx)  # a sampler pod's Workload: no job to refresh
    assert api.statuses == []
    await rljob_pipeline.kueue_pending_event(event, NS, **idx)
    ((kind, name, status),) = api.statuses
    assert (kind, name, status["phase"], status["reason"]) == ("RLJob", "j", "Pending", "WaitingForAdmission")
    assert status["message"].endswith(
        "trainer StatefulSet j-trainer: pod j-trainer-0 waits for Kueue to admit its Workload from LocalQueue q "
        f"(scheduling gate kueue.x-k8s.io/admission): Kueue: {said}"
    )


# --- the rebalancer after a restart ----------------------------------------------------------------------


def decided(
    job: dict[str, Any], shares: dict[str, tuple[float, list[tuple[float, float]], float]], time: float
) -> dict[str, Any]:
    """`job` with decisions in its status, as the pipeline writes them: per group (share, share history
    (from, to), smoothed tokens/s)."""
    groups = [
        {
            "name": g,
            "replicas": 1,
            "weightFormat": "bf16",
            "share": share,
            "quarantined": False,
            "jobWeightFormat": "bf16",
            "memory": {
                "counters": {},
                "tokensPerSecond": tps,
                "recordedShare": share,
                "shareHistory": [
                    {"time": f"2026-01-01T00:0{i}:00Z", "from": a, "to": b, "reason": "throughput"}
                    for i, (a, b) in enumerate(history)
                ],
            },
        }
        for g, (share, history, tps) in shares.items()
    ]
    return {**job, "status": {"decisions": {"time": time, "groups": groups}}}


async def test_after_a_restart_the_tick_goes_on_from_the_decisions_in_the_rljobs_status(
    api: FakeKube,
) -> None:
    """A restarted operator (nothing in memory) reads the previous decisions from the RLJob's status: the
    next decision is due one interval (30 s) after the last one, the shares move on from the decided ones
    (throughput 300 : 100 with the 0.02 floor -> 0.74 / 0.26, within the bounded change of 0.1 from
    0.65 / 0.35) and the share history and ShareChanged Events continue from them. Deciding writes
    nothing; acting on it pushes and posts, the SamplerGroups already run the decided format."""
    events = posted()
    job = decided(
        rljob(groups=("a", "b")),
        {"a": (0.65, [(0.5, 0.6), (0.6, 0.65)], 300.0), "b": (0.35, [(0.5, 0.4), (0.4, 0.35)], 100.0)},
        time=1000.0,
    )
    groups = [samplergroup(g, job, {"readyReplicas": 1}) for g in ("a", "b")]

    def no_pods(component: str, owner: str) -> list[dict[str, Any]]:
        return []

    assert await rebalancer.rebalance_job(job, NS, groups, no_pods, now=1020.0) is None  # not due yet
    decisions = await rebalancer.rebalance_job(job, NS, groups, no_pods, now=1030.0)
    assert decisions is not None and decisions.result is not None
    assert decisions.shares == pytest.approx({"a": 0.74, "b": 0.26})
    assert [(h["from"], h["to"]) for h in decisions.state.groups["a"].history] == [
        (0.5, 0.6),
        (0.6, 0.65),
        (0.65, 0.74),
    ]
    assert [(h["from"], h["to"]) for h in decisions.state.groups["b"].history] == [
        (0.5, 0.4),
        (0.4, 0.35),
        (0.35, 0.26),
    ]
    assert api.applied == [] and api.statuses == []  # deciding writes nothing to the API
    await rebalancer.act(job, NS, groups, no_pods, decisions)
    messages = sorted(e.message for e in drain(events) if e.reason == "ShareChanged")
    assert [m.split(" (")[0] for m in messages] == ["a: share 0.650 -> 0.740", "b: share 0.350 -> 0.260"]
    assert api.applied == []  # both groups run the decided weightFormat already


# --- runtime state per object ----------------------------------------------------------------------------


async def test_the_rebalancer_memory_of_a_deleted_job_is_dropped(api: FakeKube) -> None:
    posted()
    job = rljob(groups=("a",))
    groups = [samplergroup("a", job, {"readyReplicas": 1})]
    assert await rebalancer.rebalance_job(job, NS, groups, lambda c, o: [], now=1000.0) is not None
    assert rebalancer.observed(job).decisions is not None

    await rljob_pipeline.rljob_event(name="j", namespace=NS, type="MODIFIED", body=kopf.Body(job))
    assert rebalancer.observed(job).decisions is not None  # only a deletion forgets
    await rljob_pipeline.rljob_event(name="j", namespace=NS, type="DELETED", body=kopf.Body(job))
    assert rebalancer.observed(job).decisions is None and not [
        k for k in rebalancer._JOBS if k[:2] == (NS, "j")
    ]


async def test_an_rljob_is_parsed_once_per_generation_and_its_parse_forgotten_on_deletion(
    api: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reconcile, every status refresh and every rebalance tick read the job through one memo keyed by
    (uid, generation): N refreshes of one generation parse it once, the next generation (a spec change:
    the API server bumps it, status writes do not) once more, an invalid one too (its message is what is
    kept), and the job's DELETED event empties the memo."""
    posted()
    generations: list[int] = []
    parse = RLJob.from_manifest

    def counting(manifest: dict[str, Any]) -> RLJob:
        generations.append(manifest["metadata"]["generation"])
        return parse(manifest)

    monkeypatch.setattr(RLJob, "from_manifest", counting)
    job = rljob(groups=("a",))
    groups = [samplergroup("a", job, {"readyReplicas": 1})]
    view = View.of(indexes(job, *groups))
    await rljob_pipeline.reconcile_job(copy.deepcopy(job), NS, view)
    for _ in range(4):
        await rljob_pipeline.refresh_job_status(NS, "j", view)
        await samplergroup_pipeline.refresh_samplergroup_status(NS, "j-a", view)
    await rebalancer.rebalance_job(job, NS, groups, lambda c, o: [], now=1000.0)
    assert await rebalancer.rebalance_job(job, NS, groups, lambda c, o: [], now=1030.0) is not None
    assert generations == [1]

    scaled = copy.deepcopy(job)
    scaled["metadata"]["generation"] = 2
    scaled["spec"]["samplerGroups"][0]["replicas"] = 3
    view = View.of(indexes(scaled, *groups))
    await rljob_pipeline.reconcile_job(copy.deepcopy(scaled), NS, view, old_spec=job["spec"])
    for _ in range(4):
        await rljob_pipeline.refresh_job_status(NS, "j", view)
    assert await rebalancer.rebalance_job(scaled, NS, groups, lambda c, o: [], now=1060.0) is not None
    assert generations == [1, 2]
    assert api.scaled == [("SamplerGroup", "j-a", 3)]  # the new generation's parse was used (its replicas)

    invalid = copy.deepcopy(scaled)
    invalid["metadata"]["generation"] = 3
    invalid["spec"]["samplerGroups"].append(dict(invalid["spec"]["samplerGroups"][0]))  # two groups named a
    view = View.of(indexes(invalid, *groups))
    with pytest.raises(kopf.PermanentError, match="invalid RLJob"):
        await rljob_pipeline.reconcile_job(copy.deepcopy(invalid), NS, view)
    for _ in range(4):
        await rljob_pipeline.refresh_job_status(NS, "j", view)
    assert await rebalancer.rebalance_job(invalid, NS, groups, lambda c, o: [], now=1090.0) is None
    assert generations == [1, 2, 3]
    assert api.statuses[-1][2]["phase"] == "Failed" and "invalid RLJob" in api.statuses[-1][2]["message"]

    assert (NS, "j") in parsed_jobs._PARSED
    await rljob_pipeline.rljob_event(name="j", namespace=NS, type="DELETED")
    assert (NS, "j") not in parsed_jobs._PARSED


async def test_locks_exist_only_while_a_pipeline_runs(api: FakeKube, monkeypatch: pytest.MonkeyPatch) -> None:
    posted()
    sg = samplergroup("a")
    view = View.of(indexes(sg))
    running = asyncio.Event()
    release = asyncio.Event()
    writes = 0
    real = pipelines.write_status

    async def slow_write(obj: dict[str, Any], desired: dict[str, Any], kind: str) -> bool:
        nonlocal writes
        writes += 1
        running.set()
        await release.wait()
        return await real(obj, desired, kind)

    monkeypatch.setattr(samplergroup_pipeline, "write_status", slow_write)
    burst = [
        asyncio.create_task(samplergroup_pipeline.refresh_samplergroup_status(NS, "j-a", view))
        for _ in range(5)
    ]

    def mine(keys: Any) -> list[Any]:  # (other tests may have run an operator in this process)
        return [k for k in keys if k[1:] == ("SamplerGroup", NS, "j-a")]

    await running.wait()
    assert len(mine(pipelines._locks)) == 1  # held by the one in flight, waited for by one queued
    release.set()
    await asyncio.gather(*burst)
    assert writes == 2  # a burst of five: one in flight + one queued, the rest coalesced
    assert mine(pipelines._locks) == mine(pipelines._lock_users) == mine(pipelines._queued) == []


async def test_a_deleted_channel_leaves_no_timer_state(api: FakeKube, tmp_path: Path) -> None:
    posted()
    wc = weightchannel(str(tmp_path))
    idx = indexes(wc)
    await timer.weightchannel_timer(name="j-weights", namespace=NS, body=kopf.Body(wc), **idx)

    def read_times() -> list[tuple[str, str]]:  # (other tests may have run an operator in this process)
        return [k[1:] for k in weightchannel_pipeline._channel_read if k[1:] == (NS, "j-weights")]

    assert read_times() == [(NS, "j-weights")]  # the store was read: remembered
    assert [k for k, _, _ in api.statuses] == ["WeightChannel"]
    weightchannel_pipeline._removal_failing.add((NS, "j-weights"))  # a streak of refused deletes in progress

    await weightchannel_pipeline.weightchannel_event(
        body=kopf.Body(wc), name="j-weights", namespace=NS, type="DELETED", **idx
    )
    assert read_times() == [] and (NS, "j-weights") not in weightchannel_pipeline._removal_failing


async def test_a_tick_the_operators_stop_cuts_short_is_logged_not_raised(
    api: FakeKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """kopf orphans a timer that is mid-tick at stop and the cleanup closes the API client under it (its
    request then fails 'Server disconnected'): with kopf's stop flag of the timer set, the tick ends with
    one log line and no traceback; the same failure while the operator runs is raised (kopf retries it)."""
    import aiohttp
    from kopf._cogs.aiokits.aioenums import AsyncFlagWaiter, FlagSetter  # the flag kopf passes as `stopped`
    from kopf._core.intents.stoppers import DaemonStoppingReason

    posted()
    wc = weightchannel(str(tmp_path))

    async def disconnected(*_: Any) -> None:
        raise aiohttp.ServerDisconnectedError()

    monkeypatch.setattr(timer, "refresh_weightchannel_status_when_due", disconnected)
    stopper: FlagSetter[DaemonStoppingReason] = FlagSetter()
    stopped = AsyncFlagWaiter(stopper)
    tick = dict(name="j-weights", namespace=NS, body=kopf.Body(wc), stopped=stopped, **indexes(wc))
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await timer.weightchannel_timer(**tick)

    stopper.set(reason=DaemonStoppingReason.OPERATOR_EXITING)
    with caplog.at_level("INFO", logger="rlfleet.operator"):
        await timer.weightchannel_timer(**tick)
    assert [r.getMessage() for r in caplog.records if "cut short" in r.getMessage()] == [
        f"tick of {NS}/j-weights cut short by the operator's stop: ServerDisconnectedError('Server disconnected')"
    ]


async def test_the_channel_pipeline_reads_the_models_config_once_and_keeps_it(
    api: FakeKube, tmp_path: Path
) -> None:
    """Version 0's config.json gives the WeightChannel status its `model`; once there it is not read again
    (here: the file is gone from the store, and the next status still has it and no read error)."""
    import json

    from rlfleet.api import StoreSpec
    from rlfleet.channel import WeightChannel
    from rlfleet.store import store_from_spec

    posted()
    (tmp_path / "w").mkdir()
    view = tmp_path / "bf16"
    view.mkdir()
    (view / "config.json").write_text(
        json.dumps(
            {"architectures": ["Qwen3ForCausalLM"], "num_attention_heads": 16, "num_key_value_heads": 8}
        )
    )
    store = store_from_spec(StoreSpec.model_validate({"type": "filesystem", "path": str(tmp_path / "w")}))
    WeightChannel(store, publisher_id="trainer").publish({"bf16": view}, version=0)
    store.close()
    wc = weightchannel(str(tmp_path / "w"))

    await weightchannel_pipeline.refresh_weightchannel_status(NS, "j-weights", View.of(indexes(wc)))
    ((_, _, first),) = api.statuses
    assert first["model"] == {
        "attentionHeads": 16,
        "keyValueHeads": 8,
        "version": 0,
        "architecture": "Qwen3ForCausalLM",
    }
    (tmp_path / "w" / "v0" / "bf16" / "config.json").unlink()
    stale = {**wc, "status": {**first, "conditions": []}}  # a change, so the next status is written
    await weightchannel_pipeline.refresh_weightchannel_status(NS, "j-weights", View.of(indexes(stale)))
    (_, (_, _, second)) = api.statuses
    assert second["model"] == first["model"] and second["phase"] == "Ready"
