"""Against the real control plane: status says WHY. The operator observes its pods through a kopf index
and puts the real kube-scheduler's words into the RLJob's Degraded condition, naming the object:
a trainer that cannot be scheduled (three 8-GPU trainer pods on a class with two 8-GPU kwok nodes:
tests/cluster/controlplane.py) and a job whose weights PVC does not exist (the scheduler's volume
binding refuses every pod that mounts it); and trainer pods the API server refuses to create (a
ResourceQuota, a missing PriorityClass: the StatefulSet controller's FailedCreate Events)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.control_plane import get, operator_in_process, rljob
from support.waits import wait_for

pytestmark = pytest.mark.cluster


def store(tmp_path: Path, name: str, **more: str) -> dict:
    """A filesystem store the operator (run here) can read: an unreadable one would make the job Degraded
    with StoreUnreachable, whatever its pods do."""
    (tmp_path / name).mkdir()
    return {"type": "filesystem", "path": str(tmp_path / name), **more}


def manifest(name: str, trainer: dict, store: dict) -> dict:
    return rljob(
        name,
        [{"name": "h200-bf16", "accelerator": "h200", "replicas": 1, "weightFormat": "bf16"}],
        trainer=trainer,
        weightChannel={"store": store},
    )


def degraded(kube, namespace: str, job: str) -> dict | None:
    """The RLJob's Degraded condition, once it is True."""
    got = get(kube, namespace, "rljob", job) or {}
    cond = next((c for c in got.get("status", {}).get("conditions", []) if c["type"] == "Degraded"), None)
    return cond if cond and cond["status"] == "True" else None


def test_unschedulable_trainer_and_missing_pvc_are_named_in_degraded(
    kube, crds, namespace: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert len(kube.gpu_nodes["b200"]) == 2  # the fleet: 8 GPUs per node, so 3 x 8 GPUs cannot fit

    big = manifest(
        "nogpu", {"accelerator": "b200", "replicas": 3, "gpusPerReplica": 8}, store(tmp_path, "nogpu")
    )
    nopvc = manifest(
        "nopvc",
        {"accelerator": "h100", "replicas": 1, "gpusPerReplica": 8},
        store(tmp_path, "nopvc", volumeClaimName="no-such-claim"),
    )
    with operator_in_process(kube, namespace, monkeypatch):
        kube.apply(big, nopvc, namespace=namespace)

        cond = wait_for("nogpu Degraded", lambda: degraded(kube, namespace, "nogpu"), timeout=90)
        assert cond["reason"] == "Unschedulable", cond
        assert cond["message"].startswith("trainer StatefulSet nogpu-trainer: pod nogpu-trainer-"), cond
        assert "nodes are available" in cond["message"] and "nvidia.com/gpu" in cond["message"], cond
        job = json.loads(kube.kubectl("get", "rljob", "nogpu", "-n", namespace, "-o", "json").stdout)
        assert job["status"]["phase"] == "Degraded" and job["status"]["reason"] == "Unschedulable"
        assert cond["observedGeneration"] == job["metadata"]["generation"]

        cond = wait_for("nopvc Degraded", lambda: degraded(kube, namespace, "nopvc"), timeout=90)
        assert cond["reason"] == "MissingPersistentVolumeClaim", cond
        assert 'persistentvolumeclaim "no-such-claim" not found' in cond["message"], cond
        assert "nopvc-trainer" in cond["message"]
        # the group's own status names its Deployment and the claim too
        wait_for(
            "group Degraded",
            lambda: (
                json.loads(
                    kube.kubectl("get", "sg", "nopvc-h200-bf16", "-n", namespace, "-o", "json").stdout
                )["status"].get("reason")
                == "MissingPersistentVolumeClaim"
            ),
            timeout=60,
        )
        sg = json.loads(kube.kubectl("get", "sg", "nopvc-h200-bf16", "-n", namespace, "-o", "json").stdout)
        assert sg["status"]["message"].startswith(
            "0/1 replicas ready: Deployment nopvc-h200-bf16: pod nopvc-h200-bf16-"
        )
        events = json.loads(kube.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
        assert any(e["reason"] == "PhaseDegraded" and e["involvedObject"]["name"] == "nogpu" for e in events)
        kube.kubectl("delete", "rljob", "nogpu", "nopvc", "-n", namespace, "--wait=false")


def test_trainer_pods_the_api_refuses_are_named_in_degraded(
    kube, crds, namespace: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The real StatefulSet controller cannot create the trainer pod (a ResourceQuota on GPUs, a PriorityClass
    that does not exist): its FailedCreate Event is the only trace, and the RLJob says it, as a sampler group
    says its Deployment's ReplicaFailure."""
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "gpus"},
        "spec": {"hard": {"requests.nvidia.com/gpu": "4"}},
    }
    kube.apply(quota, namespace=namespace)
    # until the quota controller has computed its status, admission says "status unknown", not the limit
    kube.kubectl(
        "wait",
        "-n",
        namespace,
        "--for=jsonpath={.status.hard.requests\\.nvidia\\.com/gpu}=4",
        "resourcequota/gpus",
        "--timeout=60s",
    )

    over = manifest(
        "overquota", {"accelerator": "h200", "replicas": 1, "gpusPerReplica": 8}, store(tmp_path, "overquota")
    )
    noclass = manifest(
        "noclass",
        {"accelerator": "h200", "replicas": 1, "gpusPerReplica": 1, "priorityClassName": "no-such-class"},
        store(tmp_path, "noclass"),
    )
    with operator_in_process(kube, namespace, monkeypatch):
        kube.apply(over, noclass, namespace=namespace)
        cond = wait_for("overquota Degraded", lambda: degraded(kube, namespace, "overquota"), timeout=90)
        assert cond["reason"] == "ReplicaFailure", cond
        assert cond["message"].startswith(
            "trainer StatefulSet overquota-trainer: 0/1 pods created: FailedCreate:"
        ), cond
        assert "exceeded quota: gpus" in cond["message"], cond
        cond = wait_for("noclass Degraded", lambda: degraded(kube, namespace, "noclass"), timeout=90)
        assert cond["reason"] == "ReplicaFailure", cond
        assert "no PriorityClass with name no-such-class was found" in cond["message"], cond
        job = json.loads(kube.kubectl("get", "rljob", "overquota", "-n", namespace, "-o", "json").stdout)
        progressing = next(c for c in job["status"]["conditions"] if c["type"] == "Progressing")
        assert (job["status"]["phase"], progressing["reason"]) == ("Degraded", "ReplicaFailure")
        kube.kubectl("delete", "rljob", "overquota", "noclass", "-n", namespace, "--wait=false")
