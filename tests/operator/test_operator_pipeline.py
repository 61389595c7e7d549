"""The reconcile pipeline's pure decisions, without a cluster: why a pod does not run (each reason the
operator maps, from the fields the scheduler and the kubelet write), how that reaches a SamplerGroup's and
an RLJob's Degraded condition naming the object, a WeightChannel whose store is unreachable, and the WHOLE
status of one writer (the rebalance tick's fields and the trainer's report composed in, observed values
kept before the first tick)."""

from __future__ import annotations

import json

import pytest

from rlfleet.catalog import load_catalog
from rlfleet.operator import status as st
from rlfleet.operator.channel_status import weightchannel_status
from rlfleet.operator.group_status import samplergroup_status
from rlfleet.operator.job_status import rljob_status
from rlfleet.operator.pods import (
    PodProblem,
    event_view,
    latest_event_message,
    pod_problem,
    pod_view,
    workload_problem,
)
from rlfleet.operator.trainer_report import TrainerReport, trainer_job_status

CATALOG = load_catalog(None)
T0 = "2026-01-01T00:00:00Z"
# kube-scheduler's own words (FailedScheduling / PodScheduled=False) for the two cases of this issue
NO_GPUS = (
    "0/20 nodes are available: 2 Insufficient nvidia.com/gpu, 2 node(s) didn't match Pod's node "
    "affinity/selector, 16 node(s) had untolerated taint {nvidia.com/gpu: present}. preemption: 0/20 nodes "
    "are available: 2 No preemption victims found for incoming pod, 18 Preemption is not helpful for "
    "scheduling."
)
NO_PVC = 'persistentvolumeclaim "rlfleet-weights" not found. preemption: 0/20 nodes are available.'


def pod(
    name: str = "j-trainer-0",
    *,
    conditions: list | None = None,
    containers: list | None = None,
    init: list | None = None,
    phase: str = "Pending",
) -> dict:
    return {
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/component": "trainer", "rlfleet.dev/job": "j"},
        },
        "status": {
            "phase": phase,
            "conditions": conditions or [],
            "containerStatuses": containers or [],
            "initContainerStatuses": init or [],
        },
    }


def unschedulable(message: str) -> dict:
    return {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}


def waiting(name: str, reason: str, message: str = "", last: dict | None = None) -> dict:
    return {
        "name": name,
        "ready": False,
        "state": {"waiting": {"reason": reason, "message": message}},
        "lastState": {"terminated": last} if last else {},
    }


@pytest.mark.parametrize(
    ("body", "reason", "words"),
    [
        (
            pod(conditions=[unschedulable(NO_GPUS)]),
            "Unschedulable",
            ["pod j-trainer-0 cannot be scheduled", "Insufficient nvidia.com/gpu"],
        ),
        (
            pod(conditions=[unschedulable(NO_PVC)]),
            "MissingPersistentVolumeClaim",
            ['persistentvolumeclaim "rlfleet-weights" not found'],
        ),
        (
            pod(containers=[waiting("trainer", "CreateContainerConfigError", 'secret "hf-token" not found')]),
            "MissingSecret",
            ["container trainer", 'secret "hf-token" not found'],
        ),
        (
            pod(
                containers=[waiting("sglang", "CreateContainerConfigError", 'configmap "j-config" not found')]
            ),
            "MissingConfigMap",
            ["container sglang"],
        ),
        (
            pod(containers=[waiting("sglang", "CreateContainerConfigError", "couldn't find key token")]),
            "CreateContainerConfigError",
            ["couldn't find key token"],
        ),
        (
            pod(containers=[waiting("sglang", "ErrImagePull", 'pull access denied for "x"')]),
            "ImagePullError",
            ["container sglang: ErrImagePull"],
        ),
        (
            pod(init=[waiting("weight-fetch", "ImagePullBackOff", "Back-off pulling image")]),
            "ImagePullError",
            ["init container weight-fetch: ImagePullBackOff"],
        ),
        (
            pod(
                phase="Running",
                containers=[
                    waiting(
                        "sglang",
                        "CrashLoopBackOff",
                        "back-off 5m0s",
                        {"reason": "OOMKilled", "exitCode": 137},
                    )
                ],
            ),
            "CrashLoopBackOff",
            ["container sglang: CrashLoopBackOff (last exit: OOMKilled, code 137)"],
        ),
        (
            pod(
                phase="Running",
                containers=[
                    waiting(
                        "trainer",
                        "CrashLoopBackOff",
                        "back-off 20s",
                        {
                            "reason": "Error",
                            "exitCode": 1,  # the log's tail, as FallbackToLogsOnError gives it
                            "message": "INFO:rlfleet.trainer: step 7\nrlfleet trainer run: the weight store is full\n\n",
                        },
                    )
                ],
            ),
            "CrashLoopBackOff",
            [
                "(last exit: Error, code 1): back-off 20s; it said: rlfleet trainer run: the weight store is full"
            ],
        ),
    ],
)
def test_each_reason_mapping(body: dict, reason: str, words: list[str]) -> None:
    problem = pod_problem(pod_view(body))
    assert problem is not None and problem.reason == reason, problem
    assert all(w in problem.message for w in words), problem.message
    assert problem.message.startswith("pod j-trainer-0 ")


def test_starting_pods_are_not_problems() -> None:
    assert pod_problem(pod_view(pod())) is None  # not scheduled yet: no verdict from the scheduler
    assert pod_problem(pod_view(pod(containers=[waiting("sglang", "ContainerCreating")]))) is None
    scheduled = {"type": "PodScheduled", "status": "True"}
    assert (
        pod_problem(pod_view(pod(conditions=[scheduled], init=[waiting("weight-fetch", "PodInitializing")])))
        is None
    )
    deleting = pod(conditions=[unschedulable(NO_GPUS)])
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_problem(pod_view(deleting)) is None
    # the first problem by pod name, so the message does not flap between pods
    views = [
        pod_view(pod("b", conditions=[unschedulable(NO_GPUS)])),
        pod_view(pod("a", conditions=[unschedulable(NO_PVC)])),
    ]
    assert workload_problem(views).reason == "MissingPersistentVolumeClaim"


def job(generation: int = 2) -> dict:
    return {
        "apiVersion": "rlfleet.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "j", "namespace": "ns", "generation": generation, "uid": "u"},
        "spec": {"trainer": {"replicas": 1}, "samplerGroups": [{"name": "g"}]},
    }


def running_group(**status: object) -> dict:
    return {
        "metadata": {"generation": 1},
        "spec": {"name": "g"},
        "status": {"phase": "Running", "ready": "1/1", "observedGeneration": 1, **status},
    }


def samplergroup(group: str = "g", replicas: int = 1) -> dict:
    """Job j's SamplerGroup j-<group> in namespace ns at generation 1: `replicas` bf16 replicas on H100."""
    return {
        "apiVersion": "rlfleet.dev/v1alpha1",
        "kind": "SamplerGroup",
        "metadata": {"name": f"j-{group}", "namespace": "ns", "generation": 1},
        "spec": {
            "name": group,
            "accelerator": "h100",
            "weightFormat": "bf16",
            "replicas": replicas,
            "model": {"name": "m", "path": "p"},
        },
    }


def deployment(ready: int, replicas: int, **status: object) -> dict:
    """A group's Deployment at generation 1, observed: `ready` of `replicas` pods ready."""
    return {
        "metadata": {"generation": 1},
        "status": {"observedGeneration": 1, "readyReplicas": ready, "replicas": replicas, **status},
    }


def conds(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


def test_unschedulable_trainer_degrades_the_job_with_the_schedulers_message() -> None:
    trainer = {"status": {"readyReplicas": 0, "replicas": 1}}
    views = [pod_view(pod(conditions=[unschedulable(NO_GPUS)]))]
    s = rljob_status(job(), [running_group()], trainer, None, now=T0, trainer_pods=views)
    degraded = conds(s)["Degraded"]
    assert s["phase"] == "Degraded" and degraded["status"] == "True" and degraded["reason"] == "Unschedulable"
    assert degraded["message"].startswith(
        "trainer StatefulSet j-trainer: pod j-trainer-0 cannot be scheduled: 0/20"
    )
    assert conds(s)["Ready"]["status"] == "False"
    # once the trainer is ready its pods' past does not matter
    s = rljob_status(
        job(), [running_group()], {"status": {"readyReplicas": 1}}, None, now=T0, trainer_pods=views
    )
    assert s["phase"] == "Running" and conds(s)["Degraded"]["status"] == "False"


FULL = {
    "reason": "Error",
    "exitCode": 1,
    "message": "INFO: step 51\nrlfleet trainer run: the weight store is full\n",
}


def trainer_container(state: dict, *, ready: bool, restarts: int, last: dict | None = FULL) -> dict:
    return {
        "name": "trainer",
        "ready": ready,
        "restartCount": restarts,
        "state": state,
        "lastState": {"terminated": last} if last else {},
    }


@pytest.mark.parametrize(
    ("container", "trainer_ready", "expected"),
    [
        # the kubelet's three windows of a crash loop, as the trainer with a full store goes through them:
        # exited (before the kubelet's next decision), waiting out the back-off, running again (Ready at once:
        # the trainer has no readiness probe) until it fails again
        (
            trainer_container({"terminated": FULL}, ready=False, restarts=1, last=None),
            0,
            "pod j-trainer-0 container trainer: CrashLoopBackOff (exit: Error, code 1; 1 restarts; restarting); "
            "it said: rlfleet trainer run: the weight store is full",
        ),
        (
            trainer_container(
                {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}},
                ready=False,
                restarts=2,
            ),
            0,
            "pod j-trainer-0 container trainer: CrashLoopBackOff (last exit: Error, code 1): back-off 20s; "
            "it said: rlfleet trainer run: the weight store is full",
        ),
        (
            trainer_container({"running": {"startedAt": "2026-01-01T00:00:00Z"}}, ready=True, restarts=3),
            1,
            "pod j-trainer-0 container trainer: CrashLoopBackOff (exit: Error, code 1; 3 restarts; running again "
            "since 2026-01-01T00:00:00Z); it said: rlfleet trainer run: the weight store is full",
        ),
        # settled: Ready and running for the kubelet's back-off reset (600 s) since the last error
        (
            trainer_container({"running": {"startedAt": "2025-12-31T23:50:00Z"}}, ready=True, restarts=3),
            1,
            None,
        ),
        # restarted after a clean exit (a finished run's container, restarted by the StatefulSet): no problem
        (
            trainer_container(
                {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
                ready=True,
                restarts=1,
                last={"reason": "Completed", "exitCode": 0},
            ),
            1,
            None,
        ),
        # never failed
        (
            trainer_container(
                {"running": {"startedAt": "2026-01-01T00:00:00Z"}}, ready=True, restarts=0, last=None
            ),
            1,
            None,
        ),
    ],
)
def test_a_crash_looping_trainer_degrades_the_job_in_every_window_of_the_loop(
    container: dict, trainer_ready: int, expected: str | None
) -> None:
    """A trainer that fails a minute after each start (a full store) is Running and Ready between its crashes:
    the RLJob stays Degraded quoting its last words until it has run 600 s since the last error."""
    views = [pod_view(pod(phase="Running", containers=[container]))]
    trainer = {"status": {"readyReplicas": trainer_ready, "replicas": 1}}
    s = rljob_status(job(), [running_group()], trainer, None, now="2026-01-01T00:05:00Z", trainer_pods=views)
    if expected is None:
        assert (s["phase"], s["reason"]) == ("Running", "AllReady"), s["message"]
        return
    assert (s["phase"], s["reason"]) == ("Degraded", "CrashLoopBackOff"), s["message"]
    assert s["message"] == f"trainer StatefulSet j-trainer: {expected}"


@pytest.mark.parametrize(
    ("reported_at", "phase"),
    [
        ("2026-01-01T00:04:00Z", "Running"),  # new metrics since the restart at 00:00: it trains again
        ("2025-12-31T23:59:00Z", "Degraded"),  # the last metrics are from before the restart
    ],
)
def test_a_restarted_trainer_that_reports_progress_is_settled(reported_at: str, phase: str) -> None:
    container = trainer_container({"running": {"startedAt": "2026-01-01T00:00:00Z"}}, ready=True, restarts=3)
    views = [pod_view(pod(phase="Running", containers=[container]))]
    trainer = {"status": {"readyReplicas": 1, "replicas": 1}}
    old = job()
    old["status"] = {"metrics": {"reward": 0.5, "updatedAt": reported_at}}
    s = rljob_status(old, [running_group()], trainer, None, now="2026-01-01T00:05:00Z", trainer_pods=views)
    assert s["phase"] == phase, s["message"]
    # the same from this refresh's report (the tick read new metrics just now)
    fresh = {"metrics": {"reward": 0.6, "updatedAt": reported_at}}
    s = rljob_status(
        job(),
        [running_group()],
        trainer,
        None,
        now="2026-01-01T00:05:00Z",
        trainer_pods=views,
        trainer_report=fresh,
    )
    assert s["phase"] == phase, s["message"]


def test_a_group_whose_pods_cannot_start_is_degraded_and_the_job_says_which() -> None:
    sg = samplergroup()
    dep = deployment(0, 1)
    views = [pod_view(pod("j-g-5d8f-x2", conditions=[unschedulable(NO_PVC)]))]
    s = samplergroup_status(sg, dep, CATALOG, now=T0, pods=views)
    assert (s["phase"], s["reason"]) == ("Degraded", "MissingPersistentVolumeClaim")
    assert conds(s)["Degraded"]["status"] == "True"
    assert s["message"].startswith("0/1 replicas ready: Deployment j-g: pod j-g-5d8f-x2 cannot be scheduled")
    group = {"metadata": {"name": "j-g", "generation": 1}, "spec": {"name": "g"}, "status": {**s}}
    r = rljob_status(job(), [group], {"status": {"readyReplicas": 1}}, None, now=T0)
    assert r["phase"] == "Degraded" and r["reason"] == "GroupsDegraded"
    assert (
        "g (MissingPersistentVolumeClaim: 0/1 replicas ready: Deployment j-g: pod j-g-5d8f-x2 cannot"
        in r["message"]
    )


# kube-scheduler's condition on a pod with scheduling gates, and Kueue's Pending Event message (v0.17.0)
GATED = {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
         "message": "Scheduling is blocked due to non-empty scheduling gates"}  # fmt: skip
KUEUE_PENDING = (
    "couldn't assign flavors to pod set main: insufficient quota for nvidia.com/gpu in flavor "
    "on-demand, previously considered podsets requests (0) + current podset request (8) > maximum "
    "capacity (4)"
)


def kueue_gated(name: str, queue: str = "team-a") -> dict:
    body = pod(name, conditions=[GATED])
    body["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = queue
    body["spec"] = {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]}
    return body


def test_a_trainer_queued_by_kueue_is_pending_with_kueues_reason_not_degraded() -> None:
    trainer = {"status": {"readyReplicas": 0, "replicas": 2}}
    views = [pod_view(kueue_gated("j-trainer-1")), pod_view(kueue_gated("j-trainer-0"))]
    s = rljob_status(
        job(), [running_group()], trainer, None, now=T0, trainer_pods=views, trainer_admission=KUEUE_PENDING
    )
    assert (s["phase"], s["reason"]) == ("Pending", "WaitingForAdmission")
    assert s["message"] == (
        "1/1 groups ready, trainer 0/1: trainer StatefulSet j-trainer: pods j-trainer-0, j-trainer-1 wait for Kueue "
        "to admit their Workload from LocalQueue team-a (scheduling gate kueue.x-k8s.io/admission): Kueue: "
        + KUEUE_PENDING
    )
    assert (
        conds(s)["Degraded"]["status"] == "False"
        and conds(s)["Progressing"]["reason"] == "WaitingForAdmission"
    )
    # before Kueue's first Event: the gate and the queue still say where the trainer waits
    s = rljob_status(job(), [running_group()], trainer, None, now=T0, trainer_pods=views)
    assert s["message"].endswith("from LocalQueue team-a (scheduling gate kueue.x-k8s.io/admission)")
    # admitted (gate removed, pods scheduled): no longer waiting
    admitted = [pod_view(pod("j-trainer-0", conditions=[{"type": "PodScheduled", "status": "True"}]))]
    s = rljob_status(
        job(),
        [running_group()],
        trainer,
        None,
        now=T0,
        trainer_pods=admitted,
        trainer_admission=KUEUE_PENDING,
    )
    assert s["reason"] == "Reconciling"


def test_a_group_whose_pods_are_gated_is_pending_and_says_by_what() -> None:
    sg = samplergroup()
    dep = deployment(0, 1)
    s = samplergroup_status(sg, dep, CATALOG, now=T0, pods=[pod_view(kueue_gated("j-g-5d8f-x2", "spot"))])
    assert (s["phase"], s["reason"]) == ("Pending", "WaitingForAdmission")
    assert s["message"] == (
        "0/1 replicas ready: Deployment j-g: pod j-g-5d8f-x2 waits for Kueue to admit its Workload "
        "from LocalQueue spot (scheduling gate kueue.x-k8s.io/admission)"
    )
    other = pod("j-g-5d8f-x2", conditions=[GATED])
    other["spec"] = {"schedulingGates": [{"name": "example.com/hold"}]}
    s = samplergroup_status(sg, dep, CATALOG, now=T0, pods=[pod_view(other)])
    assert (s["reason"], s["message"]) == (
        "SchedulingGated",
        "0/1 replicas ready: Deployment j-g: pod j-g-5d8f-x2 held by scheduling gates: example.com/hold",
    )


def test_unreachable_store_degrades_the_weightchannel_naming_the_store() -> None:
    wc = {
        "metadata": {"generation": 1},
        "spec": {"store": {"type": "s3", "bucket": "ckpt", "prefix": "run1"}},
    }
    s = weightchannel_status(wc, None, "EndpointConnectionError: Could not connect", now=T0)
    degraded = conds(s)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "StoreUnreachable")
    assert (
        degraded["message"]
        == "store s3://ckpt/run1 unreachable from the operator: EndpointConnectionError: Could not connect"
    )
    fs = {"metadata": {"generation": 1}, "spec": {"store": {"type": "filesystem", "path": "/w"}}}
    assert (
        "store filesystem /w unreachable"
        in conds(weightchannel_status(fs, None, "gone", now=T0))["Degraded"]["message"]
    )


def test_one_writer_composes_the_rebalance_fields_and_keeps_observed_ones_before_the_first_tick() -> None:
    sg = samplergroup() | {
        "status": {"share": 0.25, "tokensPerSecond": 100.0, "shareHistory": [{"to": 0.25}]}
    }
    dep = deployment(1, 1, updatedReplicas=1)
    kept = samplergroup_status(sg, dep, CATALOG, now=T0)  # operator restarted: no tick yet
    assert (kept["share"], kept["tokensPerSecond"], kept["sharePercent"]) == (0.25, 100.0, 25.0)
    assert kept["phase"] == "Running" and kept["quarantined"] is False
    ticked = samplergroup_status(sg, dep, CATALOG, now=T0, rebalance={"share": 0.5, "tokensPerSecond": 300.0})
    assert (ticked["share"], ticked["tokensPerSecond"], ticked["sharePercent"]) == (0.5, 300.0, 50.0)
    assert "shareHistory" not in ticked  # the tick's result is the whole truth once there is one

    observed = job() | {"status": {"costPer1MTokens": 1.5, "step": 7, "weightVersion": 9}}
    report = trainer_job_status(observed, [], TrainerReport(step=8, weight_version=4), T0).status
    s = rljob_status(
        observed,
        [running_group()],
        {"status": {"readyReplicas": 1}},
        {"status": {"latestVersion": 6}},
        now=T0,
        trainer_report=report,
    )
    assert (s["costPer1MTokens"], s["step"]) == (1.5, 8)
    assert (
        s["weightVersion"] == 9
    )  # never lowered: max of the channel (6), the report (4) and the observed (9)
    assert set(conds(s)) == {"Ready", "Progressing", "Degraded", "CollapseRisk"}
    s = rljob_status(
        observed,
        [running_group()],
        {"status": {"readyReplicas": 1}},
        None,
        now=T0,
        costs={
            "costPer1MTokens": 2.0,
            "baselineCostPer1MTokens": 3.0,
            "baselineSource": "b200 bf16 estimated from catalog throughput ratios",
        },
    )
    assert (s["costPer1MTokens"], s["baselineCostPer1MTokens"]) == (2.0, 3.0)
    assert s["baselineSource"] == "b200 bf16 estimated from catalog throughput ratios"


def test_the_fleet_plan_is_the_last_decision_kept_over_a_restart_and_gone_when_the_optimizer_is_off() -> None:
    """`status.fleetPlan` goes through the RLJob's one status pipeline: this operator's last decision, else
    the observed one (restarted, no interval yet), and none once `router.optimize` is off."""
    on = job() | {"spec": job()["spec"] | {"router": {"optimize": {"enabled": True}}}}
    observed = {
        "decision": "Kept",
        "reason": "the current replicas are the optimum",
        "replicas": {"g": 2},
        "binding": [],
    }
    decided = {
        "decision": "Infeasible",
        "reason": "no plan meets the budgets: ...",
        "replicas": {"g": 2},
        "binding": [],
    }

    def plan(body: dict, fleet_plan: dict | None) -> dict | None:
        return rljob_status(
            body, [running_group()], {"status": {"readyReplicas": 1}}, None, now=T0, fleet_plan=fleet_plan
        ).get("fleetPlan")

    assert plan(on | {"status": {"fleetPlan": observed}}, None) == observed
    assert plan(on | {"status": {"fleetPlan": observed}}, decided) == decided
    assert plan(job() | {"status": {"fleetPlan": observed}}, decided) is None  # off: no plan shown
    assert plan(on, None) is None


def test_the_decisions_are_written_by_the_one_status_pipeline_and_kept_until_the_next_one() -> None:
    """`status.decisions` (decide.py): this operator's latest, else the observed ones (restarted, nothing
    decided yet: the next decision goes on from them), none before the job's first."""
    observed = {
        "time": 1000.0,
        "groups": [
            {
                "name": "g",
                "replicas": 1,
                "weightFormat": "fp8",
                "share": 1.0,
                "quarantined": False,
                "jobWeightFormat": "nvfp4",
            }
        ],
    }
    newer = observed | {"time": 1030.0}

    def decisions(body: dict, value: dict | None) -> dict | None:
        return rljob_status(
            body, [running_group()], {"status": {"readyReplicas": 1}}, None, now=T0, decisions=value
        ).get("decisions")

    assert decisions(job() | {"status": {"decisions": observed}}, None) == observed
    assert decisions(job() | {"status": {"decisions": observed}}, newer) == newer
    assert decisions(job(), None) is None


# The kubelet's FailedMount Event message (pkg/kubelet/volumemanager: `MountVolume.SetUp failed for volume
# %q : %v`, the error from the secret / configmap volume plugin: `secret "x" not found`).
SECRET_MOUNT = 'MountVolume.SetUp failed for volume "admin-token" : secret "j-router-admin" not found'
CONFIGMAP_MOUNT = 'MountVolume.SetUp failed for volume "run-config" : configmap "j-config" not found'


def mount_event(message: str, at: str) -> dict:
    return {
        "reason": "FailedMount",
        "involvedObject": {"kind": "Pod", "name": "j-trainer-0"},
        "type": "Warning",
        "message": message,
        "lastTimestamp": at,
    }


@pytest.mark.parametrize(
    ("message", "reason", "named"),
    [
        (SECRET_MOUNT, "MissingSecret", 'secret "j-router-admin" not found'),
        (CONFIGMAP_MOUNT, "MissingConfigMap", 'configmap "j-config" not found'),
    ],
)
def test_a_volume_that_does_not_mount_names_the_missing_object(message: str, reason: str, named: str) -> None:
    creating = pod_view(
        pod(
            conditions=[{"type": "PodScheduled", "status": "True"}],
            containers=[waiting("trainer", "ContainerCreating")],
        )
    )
    older = event_view(
        mount_event('MountVolume.SetUp failed for volume "x" : timed out', "2026-01-01T00:00:00Z")
    )
    newer = event_view(mount_event(message, "2026-01-01T00:01:00Z"))
    latest = latest_event_message([newer, older])
    assert latest == message and latest_event_message([older, newer]) == message
    problem = pod_problem({**creating, "mountFailure": latest})
    assert problem == PodProblem(reason, f"pod j-trainer-0 FailedMount: {message}")
    assert named in problem.message
    # ... and reaches the job's Degraded condition through the trainer workload
    assert workload_problem([{**creating, "mountFailure": latest}]) == problem


def test_a_mount_failure_is_ignored_once_containers_run_or_when_it_names_no_missing_object() -> None:
    running = pod_view(
        pod(phase="Running", containers=[{"name": "trainer", "ready": True, "state": {"running": {}}}])
    )
    assert (
        pod_problem({**running, "mountFailure": SECRET_MOUNT}) is None
    )  # a stale Event after the Secret came
    creating = pod_view(pod(containers=[waiting("trainer", "ContainerCreating")]))
    assert (
        pod_problem({**creating, "mountFailure": 'MountVolume.SetUp failed for volume "x" : timed out'})
        is None
    )
    assert pod_problem({**creating, "mountFailure": None}) is None
    assert latest_event_message([]) is None


# The StatefulSet controller's FailedCreate Event and the ReplicaSet controller's ReplicaFailure condition for
# the same refusals (kube-controller-manager's words: stateful_set_control.go, replica_set.go).
QUOTA = (
    'pods "{pod}" is forbidden: exceeded quota: compute, requested: nvidia.com/gpu=8, used: '
    "nvidia.com/gpu=0, limited: nvidia.com/gpu=4"
)
PRIORITY = 'pods "{pod}" is forbidden: no PriorityClass with name rl-high was found'


@pytest.mark.parametrize("refusal", [QUOTA, PRIORITY])
def test_a_trainer_pod_the_api_refuses_degrades_the_job_as_a_sampler_group_is(refusal: str) -> None:
    event = {
        "reason": "FailedCreate",
        "message": "create Pod j-trainer-0 in StatefulSet j-trainer failed error: "
        + refusal.format(pod="j-trainer-0"),
        "lastTimestamp": T0,
    }
    message = latest_event_message([event_view(event)])
    no_pods = {"metadata": {"name": "j-trainer"}, "spec": {"replicas": 1}, "status": {"replicas": 0}}
    s = rljob_status(job(), [running_group()], no_pods, None, now=T0, trainer_create_failure=message)
    assert (s["phase"], s["reason"]) == ("Degraded", "ReplicaFailure")
    assert s["message"].startswith(
        "trainer StatefulSet j-trainer: 0/1 pods created: FailedCreate: create Pod j-trainer-0"
    )
    assert refusal.format(pod="j-trainer-0") in s["message"]
    c = conds(s)
    assert (c["Ready"]["status"], c["Degraded"]["status"], c["Degraded"]["reason"]) == (
        "False",
        "True",
        "ReplicaFailure",
    )
    assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == (
        "False",
        "ReplicaFailure",
    )  # not "Stable"
    # the sampler path: the same refusal is the Deployment's ReplicaFailure condition, with the same reason
    sg = samplergroup()
    failure = {
        "type": "ReplicaFailure",
        "status": "True",
        "reason": "FailedCreate",
        "message": refusal.format(pod="j-g-5d8f-x2"),
    }
    dep = deployment(0, 0, conditions=[failure])
    g = samplergroup_status(sg, dep, CATALOG, now=T0)
    assert (g["phase"], g["reason"]) == ("Degraded", s["reason"]) and refusal.format(pod="j-g-5d8f-x2") in g[
        "message"
    ]
    # once the pod exists (the quota was raised) the Event, still in the index for its TTL, no longer counts
    created = {**no_pods, "status": {"replicas": 1, "readyReplicas": 0}}
    s = rljob_status(job(), [running_group()], created, None, now=T0, trainer_create_failure=message)
    assert (s["phase"], s["reason"]) == ("Pending", "Reconciling")


def test_a_job_is_not_ready_while_its_weight_channel_is_degraded() -> None:
    wc = {
        "metadata": {"name": "j-weights", "generation": 1},
        "spec": {"store": {"type": "filesystem", "path": "/w"}},
    }
    channel = {
        **wc,
        "status": weightchannel_status(wc, None, "OSError: [Errno 5] Input/output error", now=T0),
    }
    s = rljob_status(job(), [running_group()], {"status": {"readyReplicas": 1}}, channel, now=T0)
    assert (s["phase"], s["reason"]) == ("Degraded", "StoreUnreachable")
    assert conds(s)["Ready"]["status"] == "False" and conds(s)["Degraded"]["status"] == "True"
    assert s["message"] == (
        "WeightChannel j-weights: store filesystem /w unreachable from the operator: "
        "OSError: [Errno 5] Input/output error"
    )
    healthy = {
        **wc,
        "status": {"conditions": [{"type": "Degraded", "status": "False", "reason": "AsExpected"}]},
    }
    assert (
        rljob_status(job(), [running_group()], {"status": {"readyReplicas": 1}}, healthy, now=T0)["phase"]
        == "Running"
    )


def test_one_missing_claim_for_every_pod_and_group_is_said_once_with_counts_and_a_bounded_status() -> None:
    names = [f"g{i}" for i in range(12)]
    rl = {**job(), "spec": {"trainer": {"replicas": 1}, "samplerGroups": [{"name": g} for g in names]}}
    groups = []
    for g in names:
        sg = samplergroup(g, replicas=3)
        dep = deployment(0, 3)
        pods = [pod_view(pod(f"j-{g}-5d8f-x{i}", conditions=[unschedulable(NO_PVC)])) for i in range(3)]
        status = samplergroup_status(sg, dep, CATALOG, now=T0, pods=pods)
        assert status["message"].endswith("(and 2 more pods: MissingPersistentVolumeClaim)")
        groups.append({**sg, "status": status})
    trainer_pods = [pod_view(pod(conditions=[unschedulable(NO_PVC)]))]
    s = rljob_status(rl, groups, {"status": {"replicas": 1}}, None, now=T0, trainer_pods=trainer_pods)
    assert (s["phase"], s["reason"]) == ("Degraded", "MissingPersistentVolumeClaim")
    claim = 'persistentvolumeclaim "rlfleet-weights" not found'
    assert s["message"].count(claim) == 2  # the trainer's pod, then every group at once
    assert (
        f"degraded groups: {', '.join(names)} (MissingPersistentVolumeClaim, each: 0/3 replicas ready: Deployment <group>"
        in s["message"]
    )
    assert (
        all(len(c["message"]) <= st.MESSAGE_LIMIT for c in s["conditions"])
        and len(s["message"]) <= st.MESSAGE_LIMIT
    )
    texts = [s["message"], *(c["message"] for c in s["conditions"])]
    assert (
        sum(t.count(claim) for t in texts) == 6
    )  # twice in message, Ready and Degraded; Progressing points there
    assert len(json.dumps(s)) < 5000
