"""Kueue admits an RLJob on the test fleet (docs/scheduling.md "Kueue"): the real Kueue manager and its
webhooks (tests/cluster/kueue.py, built from sigs.k8s.io/kueue), the operator under KopfRunner, the real
kube-scheduler placing what Kueue admitted on kwok's nodes.

Two ResourceFlavors: `spot` (a GKE spot label, its taint) and `on-demand` (the GPU nodes' GFD label); a
ClusterQueue whose on-demand GPU quota is first too small for the trainer's gang (2 replicas x 4 GPUs, 4
GPUs of quota), a LocalQueue. The trainer waits as ONE Workload of 2 pods, both gated, and the RLJob says
why in Kueue's words; raising the quota admits both pods together. A `spot: true` sampler group's pod is
admitted on the spot flavor at once and lands on the spot node.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support.control_plane import SPOT_LABEL, SPOT_TAINT, get, operator_in_process, spot_h100_node
from support.waits import wait_for
from test_operator_cluster import example, shared_volume

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
from kueue import ADMISSION_GATE, Kueue, KueueNeedsRoot  # noqa: E402 - tests/cluster, put on sys.path just above

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.usefixtures("crds")]

JOB = "queued"
QUEUE = "team-a"
SPOT_NODE = "gpu-h100-spot-kueue"
ON_DEMAND_LABEL = (
    "nvidia.com/gpu.present"  # GFD's label on every kwok GPU node (tests/cluster/controlplane.py)
)
TRAINER_GPUS = 2 * 4


def flavors() -> list[dict]:
    return [
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ResourceFlavor",
            "metadata": {"name": "spot"},
            "spec": {"nodeLabels": {SPOT_LABEL: "true"}, "nodeTaints": [SPOT_TAINT]},
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ResourceFlavor",
            "metadata": {"name": "on-demand"},
            "spec": {"nodeLabels": {ON_DEMAND_LABEL: "true"}},
        },
    ]


def cluster_queue(name: str, on_demand_gpus: int) -> dict:
    """Spot first: only pods that tolerate its taint (the catalog's spot groups) can take it; the trainer
    goes on to on-demand. CPU and memory are covered too (Kueue refuses a pod asking for an uncovered one)."""

    def flavor(flavor_name: str, gpus: int) -> dict:
        return {
            "name": flavor_name,
            "resources": [
                {"name": "cpu", "nominalQuota": "1000"},
                {"name": "memory", "nominalQuota": "10Ti"},
                {"name": "nvidia.com/gpu", "nominalQuota": str(gpus)},
            ],
        }

    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {},
            "resourceGroups": [
                {
                    "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
                    "flavors": [flavor("spot", 8), flavor("on-demand", on_demand_gpus)],
                }
            ],
        },
    }


def rljob(base: dict) -> dict:
    """`base` (examples/rljob.yaml with this namespace's store) with a 2 x 4-GPU H200 trainer and one spot
    H100 group, both naming the LocalQueue."""
    job = copy.deepcopy(base)
    job["metadata"]["name"] = JOB
    queue = {"kueue.x-k8s.io/queue-name": QUEUE}
    job["spec"]["samplerGroups"] = [
        {
            "name": "h100-spot",
            "accelerator": "h100",
            "replicas": 1,
            "weightFormat": "fp8",
            "spot": True,
            "podLabels": queue,
        },
    ]
    job["spec"]["trainer"].update(
        {
            "accelerator": "h200",
            "replicas": 2,
            "gpusPerReplica": 4,
            "parallelism": {"tensor": 2, "pipeline": 1, "context": 1},
            "podLabels": queue,
        }
    )
    return job


@pytest.fixture
def kueue(kube, namespace: str) -> Iterator[Kueue]:
    manager = Kueue(kube, [namespace], log=lambda msg: print(f"[kueue] {msg}", file=sys.stderr))
    try:
        try:
            manager.start()
        except KueueNeedsRoot as exc:  # CI runs as root (docs/testing.md)
            pytest.skip(str(exc))
        yield manager
    finally:
        print(manager.tail(), file=sys.stderr)  # shown with a failure
        manager.stop()


def pods_of(kube, namespace: str, component: str) -> list[dict]:
    return get(
        kube, namespace, "pods", "-l", f"rlfleet.dev/job={JOB},app.kubernetes.io/component={component}"
    )["items"]


def workload_of(kube, namespace: str, name: str) -> dict | None:
    return get(kube, namespace, "workloads.kueue.x-k8s.io", name)


def condition(obj: dict, type_: str) -> dict:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), {})


def test_the_trainer_gang_waits_for_quota_as_one_workload_then_is_admitted_whole(
    kube, namespace: str, kueue: Kueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    cq = f"{namespace}-cq"
    kube.kubectl("apply", "-f", "-", input=json.dumps(spot_h100_node(SPOT_NODE)))
    try:
        kube.kubectl(
            "apply", "-f", "-", input=yaml.safe_dump_all([*flavors(), cluster_queue(cq, on_demand_gpus=4)])
        )
        local_queue = {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": QUEUE, "namespace": namespace},
            "spec": {"clusterQueue": cq},
        }
        kube.kubectl("apply", "-f", "-", input=json.dumps(local_queue))
        with operator_in_process(kube, namespace, monkeypatch):
            shared_volume(kube, namespace)
            kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(rljob(example(namespace))))

            # --- the quota is too small: ONE Workload for the gang, not admitted, no pod bound ---
            def queued() -> dict | None:
                wl = workload_of(kube, namespace, f"{JOB}-trainer")
                reserved = condition(wl or {}, "QuotaReserved")
                return (
                    wl if reserved.get("status") == "False" and reserved.get("reason") == "Pending" else None
                )

            workload = wait_for("the trainer's Workload pending on quota", queued, timeout=120)
            assert [p["count"] for p in workload["spec"]["podSets"]] == [2]  # both replicas, one pod set
            assert workload["spec"]["queueName"] == QUEUE
            message = condition(workload, "QuotaReserved")["message"]
            assert "insufficient quota for nvidia.com/gpu in flavor on-demand" in message, message
            assert condition(workload, "Admitted").get("status") != "True"
            trainer_workloads = [
                w
                for w in get(kube, namespace, "workloads.kueue.x-k8s.io")["items"]
                if any(
                    o["kind"] == "Pod" and o["name"].startswith(f"{JOB}-trainer-")
                    for o in w["metadata"].get("ownerReferences", [])
                )
            ]
            assert [w["metadata"]["name"] for w in trainer_workloads] == [
                f"{JOB}-trainer"
            ]  # one gang, not one per pod
            trainers = pods_of(kube, namespace, "trainer")
            assert sorted(p["metadata"]["name"] for p in trainers) == [f"{JOB}-trainer-0", f"{JOB}-trainer-1"]
            for pod in trainers:
                assert {"name": ADMISSION_GATE} in pod["spec"]["schedulingGates"], pod["spec"]
                assert not pod["spec"].get("nodeName")

            def says_why() -> dict | None:
                status = (get(kube, namespace, "rljob", JOB) or {}).get("status", {})
                return (
                    status
                    if status.get("reason") == "WaitingForAdmission"
                    and "Kueue: " in status.get("message", "")
                    else None
                )

            status = wait_for("the RLJob saying why the trainer waits", says_why, timeout=60)
            assert status["phase"] == "Pending"
            assert (
                f"trainer StatefulSet {JOB}-trainer: pods {JOB}-trainer-0, {JOB}-trainer-1 wait for Kueue to "
                f"admit their Workload from LocalQueue {QUEUE} (scheduling gate {ADMISSION_GATE})"
            ) in status["message"]
            assert "insufficient quota for nvidia.com/gpu in flavor on-demand" in status["message"]

            # --- the spot group is admitted on the spot flavor at once and lands on the spot node ---
            def spot_running() -> list[dict] | None:
                pods = pods_of(kube, namespace, "sampler")
                ok = pods and all(
                    p["spec"].get("nodeName") and p["status"].get("phase") == "Running" for p in pods
                )
                return pods if ok else None

            (sampler,) = wait_for("the spot sampler running", spot_running, timeout=120)
            assert sampler["spec"]["nodeName"] == SPOT_NODE
            assert not sampler["spec"].get("schedulingGates")
            assert sampler["spec"]["nodeSelector"][SPOT_LABEL] == "true"  # the flavor's nodeLabels, injected
            (spot_workload,) = [
                w
                for w in get(kube, namespace, "workloads.kueue.x-k8s.io")["items"]
                if any(
                    o["name"] == sampler["metadata"]["name"] for o in w["metadata"].get("ownerReferences", [])
                )
            ]
            assignment = spot_workload["status"]["admission"]["podSetAssignments"][0]
            assert assignment["flavors"]["nvidia.com/gpu"] == "spot"
            assert condition(spot_workload, "Admitted")["status"] == "True"
            assert all("nodeName" not in p["spec"] for p in pods_of(kube, namespace, "trainer"))  # still held

            # --- enough quota: the whole gang is admitted together and scheduled on on-demand nodes ---
            kube.kubectl(
                "patch",
                "clusterqueue",
                cq,
                "--type=json",
                "-p",
                json.dumps(
                    [
                        {
                            "op": "replace",
                            "path": "/spec/resourceGroups/0/flavors/1/resources/2/nominalQuota",
                            "value": str(TRAINER_GPUS),
                        }
                    ]
                ),
            )

            def admitted() -> dict | None:
                wl = workload_of(kube, namespace, f"{JOB}-trainer")
                return wl if condition(wl or {}, "Admitted").get("status") == "True" else None

            workload = wait_for("the trainer's Workload admitted", admitted, timeout=120)
            assignment = workload["status"]["admission"]["podSetAssignments"][0]
            assert assignment["count"] == 2 and assignment["flavors"]["nvidia.com/gpu"] == "on-demand"
            assert assignment["resourceUsage"]["nvidia.com/gpu"] == str(TRAINER_GPUS)

            def trainers_running() -> list[dict] | None:
                pods = pods_of(kube, namespace, "trainer")
                ok = len(pods) == 2 and all(
                    p["spec"].get("nodeName") and p["status"].get("phase") == "Running" for p in pods
                )
                return pods if ok else None

            trainers = wait_for("both trainer pods running", trainers_running, timeout=120)
            assert {p["spec"]["nodeName"] for p in trainers} == set(kube.gpu_nodes["h200"])  # one per node
            for pod in trainers:
                assert not pod["spec"].get("schedulingGates")
                assert pod["spec"]["nodeSelector"][ON_DEMAND_LABEL] == "true"  # the on-demand flavor's label

            def gpus_in_use() -> (
                dict | None
            ):  # the ClusterQueue's status follows its Workloads' (asynchronously)
                cq_status = get(kube, namespace, "clusterqueue", cq)["status"]
                usage = {
                    f["name"]: {r["name"]: r.get("total") for r in f["resources"]}
                    for f in cq_status.get("flavorsUsage", [])
                }
                gpus = {flavor: used.get("nvidia.com/gpu") for flavor, used in usage.items()}
                return cq_status if gpus.get("on-demand") == str(TRAINER_GPUS) else None

            cq_status = wait_for("the ClusterQueue counting the gang's GPUs", gpus_in_use, timeout=60)
            assert cq_status["admittedWorkloads"] == 2  # the gang's Workload and the spot sampler's

            def trainer_ready() -> dict | None:
                status = (get(kube, namespace, "rljob", JOB) or {}).get("status", {})
                return status if status.get("trainer", {}).get("ready") == "2/2" else None

            status = wait_for("the RLJob's trainer ready", trainer_ready, timeout=60)
            assert status["reason"] != "WaitingForAdmission" and "Kueue" not in status["message"], status
    finally:
        kube.kubectl("delete", "rljob", JOB, "-n", namespace, "--wait=false", check=False)
        kube.kubectl("delete", "localqueue", QUEUE, "-n", namespace, "--wait=false", check=False)
        kube.kubectl("delete", "clusterqueue", cq, "--wait=false", check=False)
        for flavor in flavors():
            kube.kubectl("delete", "resourceflavor", flavor["metadata"]["name"], "--wait=false", check=False)
        kube.kubectl("delete", "node", SPOT_NODE, "--wait=false", check=False)
