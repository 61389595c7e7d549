"""examples/rljob-cpu.yaml against the real control plane (kube-apiserver, kube-scheduler, kwok): the
operator reconciles the `cpu` class into pods the real scheduler places on the untainted CPU nodes
(never on the GPU nodes, whose nvidia.com/gpu taint a cpu pod does not tolerate), with no GPU request,
and the statuses say what runs there. kwok marks the pods Running (no container runs here; the pods'
commands run for real in tests/sampler/test_sampler_cpu_pod.py and tests/trainer/test_trainer_cpu_class.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.control_plane import bind_claim, get, operator_in_process
from support.waits import wait_for

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rljob-cpu.yaml"
JOB = "cpu"

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def store_dir(namespace: str) -> Path:
    """The claim's hostPath on this machine, where the operator (run here) reads the channel's store (an
    RLJob whose store the operator cannot read is Degraded, StoreUnreachable)."""
    path = Path(f"/tmp/rlfleet-cpu-weights-{namespace}")
    path.mkdir(exist_ok=True)
    return path


def bind_the_examples_claim(kube, namespace: str) -> None:
    """The test control plane has no provisioner: a PV statically bound to the example's claim."""
    claim = next(d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d["kind"] == "PersistentVolumeClaim")
    bind_claim(kube, namespace, claim["metadata"]["name"], store_dir(namespace), "ReadWriteOnce", "2Gi")


def test_the_cpu_example_runs_on_cpu_nodes_without_gpus(
    kube, crds, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with operator_in_process(kube, namespace, monkeypatch):
        bind_the_examples_claim(kube, namespace)
        docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
        job = next(d for d in docs if d["kind"] == "RLJob")
        job["spec"]["weightChannel"]["store"]["path"] = str(store_dir(namespace))  # /weights/cpu in the pods
        kube.apply(*(d for d in docs if d), namespace=namespace)

        def running() -> dict | None:
            job = get(kube, namespace, "rljob", JOB) or {}
            status = job.get("status", {})
            ok = status.get("phase") == "Running" and status.get("readyGroups") == "3/3"
            return job if ok and (status.get("trainer") or {}).get("ready") == "1/1" else None

        job = wait_for("the cpu RLJob Running", running, 120)
        assert (
            job["spec"]["trainer"]["processesPerReplica"] == 2
            and "gpusPerReplica" not in job["spec"]["trainer"]
        )
        pods = get(kube, namespace, "pods", "-l", f"rlfleet.dev/job={JOB}")["items"]
        roles = sorted(p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods)
        assert roles == ["router", "sampler", "sampler", "sampler", "trainer"]
        gpu_nodes = {n for names in kube.gpu_nodes.values() for n in names}
        for pod in pods:
            assert pod["status"]["phase"] == "Running", pod["metadata"]["name"]
            assert pod["spec"]["nodeName"] in kube.cpu_nodes and pod["spec"]["nodeName"] not in gpu_nodes
            assert "nvidia.com/gpu" not in json.dumps(pod["spec"]), pod["metadata"]["name"]
        for group, fmt in (("bf16", "bf16"), ("fp8", "fp8"), ("nvfp4", "nvfp4")):
            sg = get(kube, namespace, "sg", f"{JOB}-{group}")
            assert sg["spec"]["accelerator"] == "cpu" and sg["spec"]["weightFormat"] == fmt
            status = sg["status"]
            assert (status["phase"], status["ready"], status["selectedAccelerator"]) == (
                "Running",
                "1/1",
                "cpu",
            )
            assert status["degradedPrecision"] is False and "emulated on CPU" in status["precisionNote"]
            assert "no GPU" in status["selectionReason"]
            (pod,) = get(kube, namespace, "pods", "-l", f"rlfleet.dev/samplergroup={JOB}-{group}")["items"]
            assert [c["name"] for c in pod["spec"]["initContainers"]] == ["weight-fetch"]
            assert [c["name"] for c in pod["spec"]["containers"]] == ["reference", "weight-sync"]
        trainer = get(kube, namespace, "pod", f"{JOB}-trainer-0")
        env = {e["name"]: e.get("value") for e in trainer["spec"]["containers"][0]["env"]}
        assert (env["RLFLEET_TRAINER_DEVICE"], env["NPROC_PER_NODE"]) == ("cpu", "2")
