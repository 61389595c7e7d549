"""Pure builders for the `cpu` class (examples/rljob-cpu.yaml): the sampler pods keep SGLang's launch
contract (weight-fetch init container -> engine from the launch file -> weight-sync sidecar) with the
reference engine, and nothing in a cpu pod asks for, tolerates or is placed by a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.reference_serve import SERVE_REFERENCE
from test_operator_builders import LAUNCH_KEY, launched_argv

from rlfleet.api import RLJob, SamplerGroup, load_rljob
from rlfleet.catalog import load_catalog
from rlfleet.operator import builders, workloads
from rlfleet.operator import naming as n

REPO = Path(__file__).resolve().parents[2]
CATALOG = load_catalog(None)
NS = "rl"
OWNER = {"apiVersion": "rlfleet.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "cpu", "uid": "u-1"}}


@pytest.fixture(params=["rljob-cpu.yaml", "rljob-cpu-torch.yaml"])
def job(request: pytest.FixtureRequest) -> RLJob:
    return load_rljob(REPO / "examples" / request.param)


def children(job: RLJob) -> dict[tuple[str, str], dict]:
    return {
        (c["kind"], c["metadata"]["name"]): c for c in builders.build_job_children(job, NS, OWNER, CATALOG)
    }


def sampler_deployment(job: RLJob, group: str) -> dict:
    manifest = children(job)[("SamplerGroup", f"{job.name}-{group}")]
    sg = SamplerGroup.from_manifest(manifest)  # the SamplerGroup model accepts what the RLJob builder wrote
    return workloads.build_sampler_deployment(sg, NS, None, CATALOG, job.spec.weight_channel.store)


@pytest.mark.parametrize(
    ("group", "fmt", "kv"), [("bf16", "bf16", None), ("fp8", "fp8", "fp8_e4m3"), ("nvfp4", "nvfp4", None)]
)
def test_cpu_group_pod_fetches_launches_the_reference_engine_and_syncs(
    job: RLJob, group: str, fmt: str, kv: str | None
) -> None:
    dep = sampler_deployment(job, group)
    pod = dep["spec"]["template"]["spec"]
    store = job.spec.weight_channel.store
    # no GPU anywhere: no request or limit, no toleration, no GPU product affinity
    assert "nvidia.com" not in json.dumps(dep)
    assert "tolerations" not in pod and "affinity" not in pod
    (fetch,) = pod["initContainers"]
    engine, sidecar = pod["containers"]
    assert (fetch["name"], engine["name"], sidecar["name"]) == ("weight-fetch", "reference", "weight-sync")
    # the init container: `rlfleet sampler sync --fetch-only` of THIS group's view from the channel's store
    sync_args = [
        "sampler",
        "sync",
        "--store",
        store.path,
        "--view",
        fmt,
        "--engine-url",
        "http://127.0.0.1:30000",
        "--group",
        f"{job.name}-{group}",
        "--replica",
        "$(POD_NAME)",
        "--cache-dir",
        n.WEIGHTS_CACHE,
        "--require-checkpoint",
    ]
    assert fetch["command"] == ["rlfleet"] and fetch["args"] == [*sync_args, "--fetch-only"]
    assert sidecar["command"] == ["rlfleet"] and sidecar["args"] == [*sync_args, "--port", str(n.SYNC_PORT)]
    assert fetch["image"] == sidecar["image"] == engine["image"] == "ghcr.io/rlfleet/sampler:0.1.0-cpu"
    # the engine: exec'd by /bin/sh from the launch file the init container wrote (verified dir + version)
    assert engine["command"] == ["/bin/sh", "-c"]
    argv = launched_argv(engine, 7, f"{n.WEIGHTS_CACHE}/v7-{fmt}", program="rlfleet")
    expected = [
        "rlfleet",
        *SERVE_REFERENCE,
        "--model-path",
        f"{n.WEIGHTS_CACHE}/v7-{fmt}",
        "--served-model-name",
        "tiny-qwen3",
        "--host",
        "0.0.0.0",
        "--port",
        "30000",
        "--sampling-mask-max-tokens",
        "4096",
        "--weight-version",
        "7",
        "--weight-format",
        fmt,
        *(["--kv-cache-dtype", kv] if kv else []),
        "--api-key",
        LAUNCH_KEY,
    ]
    assert argv == expected
    # a mixture of experts' launch file names SGLang's routed-experts switch: the reference engine takes
    # none of SGLang's checkpoint flags (it returns a MoE's routed experts unasked)
    assert (
        launched_argv(engine, 7, f"{n.WEIGHTS_CACHE}/v7-{fmt}", "--enable-return-routed-experts", "rlfleet")
        == expected
    )
    # the engine reads only the verified cache; the store (PVC) is mounted in the sync containers alone
    assert {m["name"] for m in engine["volumeMounts"]} == {"dshm", "tmp", "weights-cache"}
    # the channel read-only in the sync containers; writable only the group's subscriber reports
    for c in (fetch, sidecar):
        assert {"name": "weights", "mountPath": store.path, "readOnly": True} in c["volumeMounts"]
        assert {
            "name": "weights",
            "mountPath": f"{store.path}/subscribers/{job.name}-{group}",
            "subPath": f"subscribers/{job.name}-{group}",
        } in c["volumeMounts"]
    assert pod["volumes"][-1] == {
        "name": "weights",
        "persistentVolumeClaim": {"claimName": store.volume_claim_name},
    }
    # the class's small CPU/memory requests (a 2-core dev node holds three groups and the trainer)
    cpu = CATALOG.get("cpu")
    assert engine["resources"] == cpu.sampler_resources
    assert fetch["resources"] == sidecar["resources"] == cpu.sync_resources
    # SGLang's probes: the reference server answers the same endpoints
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health_generate"
    assert engine["startupProbe"]["httpGet"]["path"] == "/health"


def test_a_cpu_groups_resources_override_the_class_defaults(job: RLJob) -> None:
    wire = job.to_wire()
    wire["spec"]["samplerGroups"][0]["resources"] = {"requests": {"cpu": "2"}, "limits": {"cpu": "4"}}
    wire["spec"]["samplerGroups"][0]["tolerations"] = [{"key": "dedicated", "operator": "Exists"}]
    dep = sampler_deployment(RLJob.from_manifest(wire), "bf16")
    pod = dep["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    assert engine["resources"] == {
        "requests": {"cpu": "2", "memory": "1Gi"},
        "limits": {"cpu": "4", "memory": "4Gi"},
    }
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]  # the user's only: no GPU one


def test_cpu_trainer_statefulset_runs_ranks_on_cpu_without_a_gpu(job: RLJob) -> None:
    sts = children(job)[("StatefulSet", f"{job.name}-trainer")]
    pod = sts["spec"]["template"]["spec"]
    (trainer,) = pod["containers"]
    assert "nvidia.com" not in json.dumps(sts)
    assert "tolerations" not in pod
    assert "nodeAffinity" not in pod.get("affinity", {})
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["NPROC_PER_NODE"] == "2" and env["NNODES"] == "1"
    assert env["RLFLEET_TRAINER_DEVICE"] == "cpu"
    assert (
        trainer["command"] == ["rlfleet", "trainer", "launch"]
        and "--nproc-per-node=$(NPROC_PER_NODE)" in trainer["args"]
    )
    assert trainer["resources"] == CATALOG.get("cpu").trainer_resources
    assert trainer["image"] == "ghcr.io/rlfleet/trainer:0.1.0-cpu"
    # the resolved config the trainer reads still says what the user wrote
    config = children(job)[("ConfigMap", f"{job.name}-config")]["data"][n.CONFIG_FILE]
    assert "processesPerReplica: 2" in config and "gpusPerReplica" not in config
    assert f"backend: {job.spec.trainer.backend}" in config  # the backend reaches the trainer only this way


def test_gpu_classes_keep_their_gpu_request_toleration_and_affinity() -> None:
    job = load_rljob(REPO / "examples" / "rljob.yaml")
    sts = {c["kind"]: c for c in builders.build_job_children(job, NS, OWNER, CATALOG)}["StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    trainer = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["RLFLEET_TRAINER_DEVICE"] == "cuda" and env["NPROC_PER_NODE"] == str(
        job.spec.trainer.ranks_per_replica
    )
    assert trainer["resources"]["requests"]["nvidia.com/gpu"] == str(job.spec.trainer.ranks_per_replica)
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["affinity"]["nodeAffinity"]
