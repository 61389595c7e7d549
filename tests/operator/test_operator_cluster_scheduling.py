"""Scheduling on the test fleet: the real kube-scheduler places every pod of a job on kwok's fake nodes.

The fleet (tests/cluster/controlplane.py): two nodes per GPU class, 8 x nvidia.com/gpu each, GFD labels and
the nvidia.com/gpu taint, plus two CPU nodes. The operator runs under KopfRunner. Kueue is not installed:
its pod-group label and annotation are checked on the pods, not Kueue's admission (docs/scheduling.md).
"""

from __future__ import annotations

import copy

import pytest
import yaml
from support.control_plane import get, operator_in_process
from support.waits import wait_for
from test_operator_cluster import EXAMPLE, shared_volume

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.usefixtures("crds")]

JOB = "reference-fleet"


def job_pods(kube, namespace: str, job: str) -> list[dict]:
    return get(kube, namespace, "pods", "-l", f"rlfleet.dev/job={job}")["items"]


def all_running(kube, namespace: str, job: str, expected: int) -> list[dict] | None:
    pods = job_pods(kube, namespace, job)
    if len(pods) == expected and all(
        p["status"].get("phase") == "Running" and p["spec"].get("nodeName") for p in pods
    ):
        return pods
    return None


def by_component(pods: list[dict], component: str) -> list[dict]:
    return [p for p in pods if p["metadata"]["labels"]["app.kubernetes.io/component"] == component]


def test_every_pod_of_the_reference_example_schedules_on_the_fleet(
    kube, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worst order: every sampler is placed before the trainer reaches the scheduler (the trainer is
    held by a nodeSelector no node has, then the example as written is applied). The B200 samplers must
    leave one whole B200 node free, and the trainer then takes it."""
    example = yaml.safe_load(EXAMPLE.read_text())
    groups = example["spec"]["samplerGroups"]
    samplers = sum(g["replicas"] for g in groups)
    held = copy.deepcopy(example)
    held["spec"]["trainer"]["nodeSelector"] = {"example.com/hold-trainer": "true"}
    with operator_in_process(kube, namespace, monkeypatch):
        shared_volume(kube, namespace)
        kube.apply(held, namespace=namespace)

        def samplers_first() -> list[dict] | None:
            pods = job_pods(kube, namespace, JOB)
            running = [p for p in pods if p["status"].get("phase") == "Running" and p["spec"].get("nodeName")]
            trainer = by_component(pods, "trainer")
            unschedulable = trainer and any(
                c["type"] == "PodScheduled" and c["reason"] == "Unschedulable"
                for c in trainer[0]["status"].get("conditions", [])
            )
            return running if len(running) == samplers + 1 and unschedulable else None

        first = wait_for("samplers and router Running, trainer held", samplers_first, timeout=120)
        b200_first = {
            p["spec"]["nodeName"]
            for p in first
            if p["metadata"]["labels"].get("rlfleet.dev/group") == "b200-nvfp4"
        }
        # the example's pod affinity packs the B200 samplers onto ONE node: the other stays whole
        assert len(b200_first) == 1, b200_first
        kube.kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))  # the example as written
        pods = wait_for(
            f"all {samplers + 2} pods of the example Running on kwok nodes",
            lambda: all_running(kube, namespace, JOB, samplers + 2),
            timeout=120,
        )
    nodes = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in pods}
    kwok_nodes = {node for names in kube.gpu_nodes.values() for node in names} | set(kube.cpu_nodes)
    assert set(nodes.values()) <= kwok_nodes
    (trainer,) = by_component(pods, "trainer")
    (router,) = by_component(pods, "router")
    assert trainer["spec"]["nodeName"] in kube.gpu_nodes["b200"]
    assert router["spec"]["nodeName"] in kube.cpu_nodes  # no GPU toleration: never on a GPU node
    b200 = [
        p
        for p in by_component(pods, "sampler")
        if p["metadata"]["labels"]["rlfleet.dev/group"] == "b200-nvfp4"
    ]
    # the example's pod affinity packs the B200 samplers onto one node; the trainer has the other whole
    assert len({p["spec"]["nodeName"] for p in b200}) == 1
    assert b200[0]["spec"]["nodeName"] != trainer["spec"]["nodeName"]
    # the catalog's accelerator affinity is still there next to the group's pod affinity
    affinity = b200[0]["spec"]["affinity"]
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert any(
        e["key"] == "nvidia.com/gpu.product" and "NVIDIA-B200" in e["values"]
        for t in terms
        for e in t.get("matchExpressions", [])
    )
    assert affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == (
        "kubernetes.io/hostname"
    )
    for group in groups:
        placed = [
            p
            for p in by_component(pods, "sampler")
            if p["metadata"]["labels"]["rlfleet.dev/group"] == group["name"]
        ]
        assert len(placed) == group["replicas"]
        assert {p["spec"]["nodeName"] for p in placed} <= set(kube.gpu_nodes[group["accelerator"]]), group


def test_trainer_gang_and_placement_fields_reach_the_scheduled_pods(
    kube, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two trainer replicas of 4 GPUs on H200: one per node (the gang's anti-affinity), Kueue's pod group
    on both, and the user's nodeSelector, toleration, priority class, resources, labels and annotations."""
    priority = f"{namespace}-trainer"
    kube.apply(
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": priority},
            "value": 1000,
        }
    )
    job = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    job["metadata"]["name"] = "gang"
    job["spec"]["samplerGroups"] = [
        {"name": "a100-bf16", "accelerator": "a100", "replicas": 1, "weightFormat": "bf16"}
    ]
    job["spec"]["trainer"].update(
        {
            "accelerator": "h200",
            "replicas": 2,
            "gpusPerReplica": 4,
            "parallelism": {"tensor": 2, "pipeline": 1, "context": 1},
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "example.com/dedicated", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": priority,
            "resources": {"requests": {"cpu": "16", "memory": "128Gi"}},
            "podLabels": {"kueue.x-k8s.io/queue-name": "team-a", "team": "rl"},
            "podAnnotations": {"example.com/owner": "rl-team"},
        }
    )
    job["spec"]["router"] = {"policy": "throughput", "nodeSelector": {"kubernetes.io/os": "linux"}}
    try:
        with operator_in_process(kube, namespace, monkeypatch):
            shared_volume(kube, namespace)
            kube.apply(job, namespace=namespace)
            pods = wait_for(
                "trainer x2, router and sampler Running",
                lambda: all_running(kube, namespace, "gang", 4),
                timeout=120,
            )
    finally:
        kube.kubectl("delete", "priorityclass", priority, "--wait=false", check=False)
    trainers = by_component(pods, "trainer")
    assert len(trainers) == 2
    assert {p["spec"]["nodeName"] for p in trainers} == set(kube.gpu_nodes["h200"])  # one per node
    for pod in trainers:
        meta, spec = pod["metadata"], pod["spec"]
        assert meta["labels"]["kueue.x-k8s.io/pod-group-name"] == "gang-trainer"
        assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "team-a" and meta["labels"]["team"] == "rl"
        assert meta["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "2"
        assert meta["annotations"]["example.com/owner"] == "rl-team"
        assert spec["priorityClassName"] == priority and spec["priority"] == 1000
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "example.com/dedicated", "operator": "Exists", "effect": "NoSchedule"} in spec[
            "tolerations"
        ]
        resources = spec["containers"][0]["resources"]
        assert resources["requests"] == {"nvidia.com/gpu": "4", "cpu": "16", "memory": "128Gi"}
    (router,) = by_component(pods, "router")
    assert router["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert router["spec"]["nodeName"] in kube.cpu_nodes
