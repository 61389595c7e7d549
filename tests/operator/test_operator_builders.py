"""Pure builders: the reference RLJob -> every child manifest, placed, secured and flagged right."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfleet.api import RLJob, SamplerGroup, StoreSpec, load_rljob
from rlfleet.catalog import load_catalog
from rlfleet.operator import builders, config_files, workloads
from rlfleet.operator import naming as n

REPO = Path(__file__).resolve().parents[2]
CATALOG = load_catalog(None)
OWNER = {
    "apiVersion": "rlfleet.dev/v1alpha1",
    "kind": "RLJob",
    "metadata": {"name": "reference-fleet", "uid": "u-1"},
}
# what every child of OWNER's job carries: its RLJob as the one controller, blocking its deletion
OWNER_REFERENCES = [
    {
        "apiVersion": "rlfleet.dev/v1alpha1",
        "kind": "RLJob",
        "name": "reference-fleet",
        "uid": "u-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }
]
NS = "team-a"
PRODUCTS = {
    "a100": "NVIDIA-A100-SXM4-80GB",
    "h100": "NVIDIA-H100-80GB-HBM3",
    "h200": "NVIDIA-H200",
    "b200": "NVIDIA-B200",
    "b300": "NVIDIA-B300-SXM6-AC",
    "rtx-pro-6000": "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition",
}


@pytest.fixture()
def job() -> RLJob:
    return load_rljob(REPO / "examples" / "rljob.yaml")


def children(job: RLJob, observed: dict | None = None) -> dict[tuple[str, str], dict]:
    out = builders.build_job_children(job, NS, OWNER, CATALOG, observed)
    return {(c["kind"], c["metadata"]["name"]): c for c in out}


LAUNCH_KEY = "k3y_from-the-Secret"  # what the kubelet puts for $(RLFLEET_API_KEY) in launched_argv


def launched_argv(
    engine: dict, version: int, directory: str, flags: str = "", program: str = "python3"
) -> list[str]:
    """The argv the engine container's /bin/sh wrapper execs, run for real with `program` (SGLang's
    `python3`, the cpu class's `rlfleet`) replaced by a shim printing its arguments and the launch file
    holding `version directory` (then `flags`, when given, as the weight sync writes a checkpoint's SGLang
    flags); the kubelet's expansion of $(RLFLEET_API_KEY) (the env's secretKeyRef to the job's key
    Secret) is LAUNCH_KEY."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmpdir:
        root = Path(tmpdir)
        (root / program).write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv))\n")
        (root / program).chmod(0o755)
        (root / "launch").write_text(f"{version} {directory}\n" + (f"{flags}\n" if flags else ""))
        script = engine["args"][0].replace(f"{n.WEIGHTS_CACHE}/launch", str(root / "launch"))
        assert script != engine["args"][0] and len(engine["args"]) == 1
        key_ref = next(e["valueFrom"]["secretKeyRef"] for e in engine["env"] if e["name"] == n.API_KEY_ENV)
        assert key_ref["key"] == n.API_KEY_SECRET_KEY and key_ref["name"].endswith("-api-key")
        script = script.replace(f"$({n.API_KEY_ENV})", LAUNCH_KEY)
        out = subprocess.run(
            [*engine["command"], script],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PATH": f"{root}:{os.environ['PATH']}"},
        )
    argv = json.loads(out.stdout)
    return [program, *argv[1:]]


def s3_store(**fields: Any) -> StoreSpec:
    """An S3 weight store: bucket wts under runs/a/ at a MinIO endpoint, the trainer's credentials in the
    Secret s3-creds; `fields` added or replaced."""
    return StoreSpec.model_validate(
        {
            "type": "s3",
            "bucket": "wts",
            "prefix": "runs/a/",
            "endpoint": "http://minio:9000",
            "secretRef": {"name": "s3-creds"},
            **fields,
        }
    )


def sampler_deployment(job: RLJob, group: str, store=None) -> dict:
    sg_manifest = children(job)[("SamplerGroup", f"reference-fleet-{group}")]
    sg = SamplerGroup.from_manifest(sg_manifest)
    store = store if store is not None else job.spec.weight_channel.store
    return workloads.build_sampler_deployment(
        sg, NS, sg_manifest | {"metadata": {**sg_manifest["metadata"], "uid": "sg"}}, CATALOG, store
    )


def test_every_child_exists_in_order_with_owner_and_labels(job: RLJob) -> None:
    out = builders.build_job_children(job, NS, OWNER, CATALOG)
    kinds = [c["kind"] for c in out]
    assert kinds[:6] == ["ConfigMap", "WeightChannel", "Service", "StatefulSet", "Service", "Deployment"]
    assert kinds[6:] == ["SamplerGroup"] * 8
    for c in out:
        meta = c["metadata"]
        assert meta["namespace"] == NS
        assert meta["ownerReferences"] == OWNER_REFERENCES
        assert meta["labels"][n.LABEL_JOB] == "reference-fleet"
        assert meta["labels"][n.LABEL_MANAGED_BY] == n.MANAGED_BY
    names = [c["metadata"]["name"] for c in out if c["kind"] == "SamplerGroup"]
    assert names == [f"reference-fleet-{g.name}" for g in job.spec.sampler_groups]


def test_samplergroups_carry_the_group_and_are_valid(job: RLJob) -> None:
    sgs = [c for c in builders.build_job_children(job, NS, OWNER, CATALOG) if c["kind"] == "SamplerGroup"]
    for manifest, group in zip(sgs, job.spec.sampler_groups, strict=True):
        sg = SamplerGroup.from_manifest(manifest)  # the CRD's own model accepts what we build
        assert (sg.spec.name, sg.spec.accelerator, sg.spec.weight_format) == (
            group.name,
            group.accelerator,
            group.weight_format,
        )
        assert sg.spec.replicas == group.replicas and sg.spec.weight_channel == "reference-fleet-weights"
        assert sg.spec.model.path == "Qwen/Qwen3-8B" and sg.spec.suspend is False
        assert "annotations" not in manifest["metadata"]  # no bookkeeping on the child


def test_an_existing_samplergroup_is_built_without_replicas_its_scale_subresource_owns_them(
    job: RLJob,
) -> None:
    """Created with the RLJob's replicas; once it exists (observed), its apply leaves them out, so a
    kubectl scale or the decisions' /scale is never undone by a reconcile (operator/replicas.py)."""
    name = "reference-fleet-h100-fp8"
    observed = {name: {"metadata": {"name": name}, "spec": {"replicas": 5}}}
    assert children(job)[("SamplerGroup", name)]["spec"]["replicas"] == 2
    assert "replicas" not in children(job, observed)[("SamplerGroup", name)]["spec"]
    assert (
        children(job, observed)[("SamplerGroup", "reference-fleet-a100-bf16")]["spec"]["replicas"] == 2
    )  # new


def test_suspend_scales_trainer_and_samplers_to_zero(job: RLJob) -> None:
    job.spec.suspend = True
    out = children(job)
    assert out[("StatefulSet", "reference-fleet-trainer")]["spec"]["replicas"] == 0
    sg = out[("SamplerGroup", "reference-fleet-h100-fp8")]
    assert sg["spec"]["suspend"] is True and sg["spec"]["replicas"] == 2  # replicas kept for resume
    dep = workloads.build_sampler_deployment(SamplerGroup.from_manifest(sg), NS, None, CATALOG, None)
    assert dep["spec"]["replicas"] == 0


def test_weightchannel_publishes_the_views_the_groups_need(job: RLJob) -> None:
    wc = children(job)[("WeightChannel", "reference-fleet-weights")]
    assert "views" not in wc["spec"]  # the trainer publishes views_to_publish(...) of the RLJob's groups
    assert wc["spec"]["store"] == {
        "type": "filesystem",
        "path": "/weights/reference-fleet",
        "volumeClaimName": "rlfleet-weights",
        "prefix": "",
        "sharedCredentials": False,
    }
    assert wc["spec"]["retention"] == {"keepVersions": 3} and wc["spec"]["jobName"] == "reference-fleet"
    assert wc["spec"]["deltas"] == {
        "anchorEvery": 16,
        "maxDeltaShare": 0.5,
    }  # the RLJob's weightChannel.deltas


def test_trainer_statefulset_torchrun_gpus_and_b200_affinity(job: RLJob) -> None:
    out = children(job)
    svc = out[("Service", "reference-fleet-trainer")]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    sts = out[("StatefulSet", "reference-fleet-trainer")]
    assert sts["spec"]["serviceName"] == "reference-fleet-trainer" and sts["spec"]["replicas"] == 1
    pod = sts["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms[0]["matchExpressions"][0]["values"] == ["NVIDIA-B200"]
    assert terms[1]["matchExpressions"][0] == {
        "key": "cloud.google.com/gke-accelerator",
        "operator": "In",
        "values": ["nvidia-b200"],
    }
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["MASTER_ADDR"] == f"reference-fleet-trainer-0.reference-fleet-trainer.{NS}.svc"
    assert env["NNODES"] == "1" and env["NPROC_PER_NODE"] == "8" and env["MASTER_PORT"] == "29500"
    assert env["NODE_RANK"] == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert (
        c["command"] == ["rlfleet", "trainer", "launch"]
        and "--rdzv-endpoint=$(MASTER_ADDR):$(MASTER_PORT)" in c["args"]
    )
    assert c["args"][-6:] == [
        "-m",
        "rlfleet.cli",
        "trainer",
        "run",
        "--config",
        "/etc/rlfleet/run/rljob.yaml",
    ]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["weights"] == "/weights/reference-fleet" and mounts["dshm"] == "/dev/shm"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    _assert_restricted(pod)


def test_every_rlfleet_env_var_the_operator_sets_has_a_reader(job: RLJob) -> None:
    """Each RLFLEET_* variable in a container the operator builds (every workload of the reference job, a
    sampler group's Deployment with an S3 store included) is read: by the container's own args
    (`$(VAR)`, which the kubelet expands) or by product code outside the operator. RLFLEET_TRAINER_BACKEND,
    RLFLEET_NAMESPACE and RLFLEET_WEIGHT_CHANNEL were set on the trainer and read by nothing; adding such
    a variable again fails here."""
    import re

    readers = "\n".join(
        path.read_text()
        for folder in ("trainer", "sampler", "router", "rlfleet")
        for path in (REPO / folder).rglob("*.py")
    )
    workloads_ = [c for c in children(job).values() if c["kind"] in ("StatefulSet", "Deployment")]
    s3 = s3_store(samplerSecretRef={"name": "s3-read"})
    workloads_.append(sampler_deployment(job, "h100-fp8", store=s3))
    checked = set()
    for workload in workloads_:
        pod = workload["spec"]["template"]["spec"]
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            expanded = set(re.findall(r"\$\((\w+)\)", " ".join([*container["command"], *container["args"]])))
            for name in (e["name"] for e in container.get("env", []) if e["name"].startswith("RLFLEET_")):
                checked.add(name)
                read = name in expanded or re.search(rf"[\"']{name}[\"']", readers) is not None
                assert read, (
                    f"{workload['kind']} {workload['metadata']['name']}: {container['name']} sets {name}, nothing reads it"
                )
    assert {"RLFLEET_JOB", "RLFLEET_CONFIG", "RLFLEET_ROUTER_URL", "RLFLEET_TRAINER_DEVICE"} <= checked


def test_config_map_holds_the_resolved_run_and_router_config(job: RLJob) -> None:
    cm = children(job)[("ConfigMap", "reference-fleet-config")]
    run = yaml.safe_load(cm["data"]["rljob.yaml"])
    again = RLJob.from_manifest(run)  # the trainer can load_rljob it
    assert again.spec == job.spec and run["metadata"] == {"name": "reference-fleet", "namespace": NS}
    router = yaml.safe_load(cm["data"]["router.yaml"])
    assert [g["name"] for g in router["groups"]] == [g.name for g in job.spec.sampler_groups]
    assert router["groups"][2]["replicas"] == [f"http://reference-fleet-h100-fp8.{NS}.svc:30000"]
    assert sum(g["share"] for g in router["groups"]) == pytest.approx(1.0)
    assert router["port"] == 8000 and router["adminTokenFile"] == "/etc/rlfleet/router-admin/token"


def test_router_config_is_accepted_by_the_router() -> None:
    from rlfleet.router import config

    job = load_rljob(REPO / "examples" / "rljob.yaml")
    parsed = config.RouterConfig.model_validate(config_files.router_config(job, NS))
    assert len(parsed.groups) == 8


def test_router_deployment_and_service(job: RLJob) -> None:
    out = children(job)
    dep = out[("Deployment", "reference-fleet-router")]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"][:2] == ["router", "serve"] and c["readinessProbe"]["httpGet"]["path"] == "/health"
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["admin-token"]["secret"]["secretName"] == "reference-fleet-router-admin"
    assert "affinity" not in pod and "tolerations" not in pod  # CPU nodes
    _assert_restricted(pod)
    assert out[("Service", "reference-fleet-router")]["spec"]["ports"][0]["port"] == 8000
    # the router restarts when its config changes (new groups), not otherwise
    h1 = dep["spec"]["template"]["metadata"]["annotations"]["rlfleet.dev/config-hash"]
    job.spec.sampler_groups.pop()
    h2 = children(job)[("Deployment", "reference-fleet-router")]["spec"]["template"]["metadata"][
        "annotations"
    ]["rlfleet.dev/config-hash"]
    assert h1 != h2


@pytest.mark.parametrize(
    ("group", "accelerator", "flags"),
    [
        (
            "b200-nvfp4",
            "b200",
            ["--quantization", "modelopt_fp4", "--fp4-gemm-backend", "flashinfer_cutlass"],
        ),
        (
            "b300-nvfp4",
            "b300",
            ["--quantization", "modelopt_fp4", "--fp4-gemm-backend", "flashinfer_cutlass"],
        ),
        ("h100-fp8", "h100", ["--quantization", "fp8", "--fp8-gemm-backend", "deep_gemm"]),
        ("h100-bf16", "h100", []),
        ("h200-fp8", "h200", ["--quantization", "fp8", "--fp8-gemm-backend", "deep_gemm"]),
        ("h200-bf16", "h200", []),
        ("a100-bf16", "a100", []),
        ("rtx-pro-6000-bf16", "rtx-pro-6000", ["--kv-cache-dtype", "fp8_e4m3"]),
    ],
)
def test_sampler_deployment_per_group(job: RLJob, group: str, accelerator: str, flags: list[str]) -> None:
    dep = sampler_deployment(job, group)
    name = f"reference-fleet-{group}"
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["selector"] == {
        "matchLabels": {n.LABEL_SAMPLERGROUP: name}
    }
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    tmpl = dep["spec"]["template"]
    assert tmpl["metadata"]["labels"][n.LABEL_SAMPLERGROUP] == name
    assert tmpl["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "30000",
        "prometheus.io/path": "/metrics",
    }
    pod = tmpl["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert PRODUCTS[accelerator] in terms[0]["matchExpressions"][0]["values"]
    assert all(e["operator"] == "In" for t in terms for e in t["matchExpressions"])
    # the class's labels and no other class's
    others = {p for cls, p in PRODUCTS.items() if cls != accelerator}
    assert not others & set(terms[0]["matchExpressions"][0]["values"])
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    engine, sidecar = pod["containers"]
    # SGLang starts from the launch file the init container wrote: the view's verified local
    # checkpoint and its version (never spec.model.path)
    assert engine["command"] == ["/bin/sh", "-c"]
    argv = launched_argv(engine, version=5, directory=f"{n.WEIGHTS_CACHE}/v5-x")
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    tail = argv[argv.index("--weight-version") + 2 :]
    assert tail == [*flags, "--api-key", LAUNCH_KEY]  # the engine's API closed by the job's key
    # a mixture of experts' launch file names SGLang's routed-experts switch, which SGLang takes (the
    # operator cannot know the model; the weight sync writes it from the view's config.json)
    moe = launched_argv(
        engine, version=5, directory=f"{n.WEIGHTS_CACHE}/v5-x", flags="--enable-return-routed-experts"
    )
    assert moe == [*argv, "--enable-return-routed-experts"]
    assert argv[argv.index("--weight-version") + 1] == "5"
    assert argv[argv.index("--model-path") + 1] == f"{n.WEIGHTS_CACHE}/v5-x"
    assert argv[argv.index("--tp-size") + 1] == "1" and "Qwen/Qwen3-8B" not in argv
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["HF_HOME"].startswith("/tmp/") and env["HF_HUB_OFFLINE"] == "1"
    (fetch,) = pod["initContainers"]
    assert fetch["name"] == "weight-fetch" and fetch["image"] == sidecar["image"]
    assert fetch["args"] == [*sidecar["args"][: sidecar["args"].index("--port")], "--fetch-only"]
    assert "--require-checkpoint" in sidecar["args"]
    assert fetch["volumeMounts"] == sidecar["volumeMounts"]
    assert {"name": "weights-cache", "mountPath": n.WEIGHTS_CACHE} in fetch["volumeMounts"]
    assert "weights" not in {
        m["name"] for m in engine["volumeMounts"]
    }  # SGLang reads only the verified cache
    assert engine["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert engine["startupProbe"]["httpGet"]["path"] == "/health"
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health_generate"
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    # the channel read-only; writable only this group's subscriber reports, a subPath of the same claim
    assert vols["weights"]["persistentVolumeClaim"] == {"claimName": "rlfleet-weights"}
    assert [m for m in sidecar["volumeMounts"] if m["name"] == "weights"] == [
        {"name": "weights", "mountPath": "/weights/reference-fleet", "readOnly": True},
        {
            "name": "weights",
            "mountPath": f"/weights/reference-fleet/subscribers/{name}",
            "subPath": f"subscribers/{name}",
        },
    ]
    assert sidecar["name"] == "weight-sync" and sidecar["command"] == ["rlfleet"]
    args = sidecar["args"]
    assert args[:2] == ["sampler", "sync"]
    assert args[args.index("--store") + 1] == "/weights/reference-fleet"
    assert (
        args[args.index("--view") + 1]
        == job.spec.sampler_groups[[g.name for g in job.spec.sampler_groups].index(group)].weight_format
    )
    assert args[args.index("--engine-url") + 1] == "http://127.0.0.1:30000"
    assert args[args.index("--group") + 1] == name and args[args.index("--replica") + 1] == "$(POD_NAME)"
    _assert_restricted(pod)


def test_tensor_parallel_sets_gpus_and_tp_size(job: RLJob) -> None:
    job.spec.sampler_groups[0].tensor_parallel = 4
    dep = sampler_deployment(job, "b200-nvfp4")
    engine = dep["spec"]["template"]["spec"]["containers"][0]
    assert engine["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    argv = launched_argv(engine, version=0, directory="/d")
    assert argv[argv.index("--tp-size") + 1] == "4"


def test_s3_store_secrets_by_reference(job: RLJob) -> None:
    """sharedCredentials: true (one identity for every role, on purpose): the sampler pods get secretRef."""
    store = s3_store(sharedCredentials=True)
    dep = sampler_deployment(job, "h100-fp8", store=store)
    sidecar = dep["spec"]["template"]["spec"]["containers"][1]
    assert (
        sidecar["args"][sidecar["args"].index("--store") + 1]
        == "s3://wts/runs/a?endpoint=http%3A%2F%2Fminio%3A9000"
    )
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"] == {
        "secretKeyRef": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}
    }
    assert "value" not in env["AWS_SECRET_ACCESS_KEY"]
    assert "weights" not in {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}


def test_s3_sampler_pods_take_the_sampler_secret_and_the_trainer_its_own(job: RLJob) -> None:
    """Store credentials per role: samplerSecretRef (read the channel, write subscribers/ only) reaches the
    sampler pods' sync containers, secretRef the trainer."""

    store = StoreSpec.model_validate(
        {
            "type": "s3",
            "bucket": "wts",
            "secretRef": {"name": "writer"},
            "samplerSecretRef": {"name": "reader"},
        }
    )
    dep = sampler_deployment(job, "h100-fp8", store=store)
    pod = dep["spec"]["template"]["spec"]
    for container in [*pod["initContainers"], pod["containers"][1]]:
        refs = {
            e["name"]: e["valueFrom"]["secretKeyRef"]["name"]
            for e in container["env"]
            if e["name"].startswith("AWS_")
        }
        assert refs == {"AWS_ACCESS_KEY_ID": "reader", "AWS_SECRET_ACCESS_KEY": "reader"}
    job.spec.weight_channel.store = store
    sts = workloads.build_trainer_statefulset(job, NS, None, CATALOG)
    (trainer,) = sts["spec"]["template"]["spec"]["containers"]
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]["name"]
        for e in trainer["env"]
        if e["name"].startswith("AWS_")
    }
    assert refs == {"AWS_ACCESS_KEY_ID": "writer", "AWS_SECRET_ACCESS_KEY": "writer"}


def test_the_trainer_secret_alone_is_refused_and_never_reaches_a_sampler_pod(job: RLJob) -> None:
    """Least privilege by default: secretRef without samplerSecretRef is refused (one line naming both ways
    out), and a spec that skipped validation (model_construct) still gives the sampler pods no credentials:
    the builder hands them secretRef only where sharedCredentials says so; the trainer keeps its own."""
    from pydantic import ValidationError

    from rlfleet.api.common import LocalObjectReference

    with pytest.raises(
        ValidationError,
        match="store.secretRef alone would give every sampler pod the trainer's write "
        "credentials to the channel: set store.samplerSecretRef .* or, for one "
        "identity in every role on purpose, store.sharedCredentials: true",
    ):
        StoreSpec.model_validate({"type": "s3", "bucket": "wts", "secretRef": {"name": "writer"}})
    for both in ({"samplerSecretRef": {"name": "reader"}}, {}):
        with pytest.raises(
            ValidationError,
            match="sharedCredentials is for type s3 with secretRef and without samplerSecretRef",
        ):
            StoreSpec.model_validate(
                {
                    "type": "s3",
                    "bucket": "wts",
                    "sharedCredentials": True,
                    **both,
                    **({"secretRef": {"name": "writer"}} if both else {}),
                }
            )
    with pytest.raises(ValidationError, match="sharedCredentials is for type s3"):
        StoreSpec.model_validate({"type": "filesystem", "path": "/w", "sharedCredentials": True})
    unchecked = StoreSpec.model_construct(
        type="s3",
        bucket="wts",
        prefix="",
        secret_ref=LocalObjectReference(name="writer"),
        sampler_secret_ref=None,
        shared_credentials=False,
    )
    pod = sampler_deployment(job, "h100-fp8", store=unchecked)["spec"]["template"]["spec"]
    for container in [*pod["initContainers"], *pod["containers"]]:
        assert not [
            e
            for e in container.get("env", [])
            if e["name"].startswith("AWS_ACCESS") or e["name"].startswith("AWS_SECRET")
        ]
    job.spec.weight_channel.store = unchecked
    (trainer,) = workloads.build_trainer_statefulset(job, NS, None, CATALOG)["spec"]["template"]["spec"][
        "containers"
    ]
    assert {
        e["valueFrom"]["secretKeyRef"]["name"] for e in trainer["env"] if e["name"].startswith("AWS_")
    } == {"writer"}


def test_a_sampler_secret_is_refused_on_a_filesystem_store() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="samplerSecretRef is for type s3"):
        StoreSpec.model_validate({"type": "filesystem", "path": "/w", "samplerSecretRef": {"name": "reader"}})


def test_sampler_service_is_headless_per_group(job: RLJob) -> None:
    sg_manifest = children(job)[("SamplerGroup", "reference-fleet-a100-bf16")]
    svc = builders.build_sampler_service(SamplerGroup.from_manifest(sg_manifest), NS, None)
    assert svc["metadata"]["name"] == "reference-fleet-a100-bf16" and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {n.LABEL_SAMPLERGROUP: "reference-fleet-a100-bf16"}
    assert {p["port"] for p in svc["spec"]["ports"]} == {30000, n.SYNC_PORT}


def test_builders_are_pure(job: RLJob) -> None:
    before = job.model_copy(deep=True)
    a = builders.build_job_children(job, NS, OWNER, CATALOG)
    b = builders.build_job_children(job, NS, OWNER, CATALOG)
    assert a == b and job == before


def _assert_restricted(pod: dict) -> None:
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert "privileged" not in sc


def test_standalone_group_without_a_channel_serves_its_model_path_as_version_0(job: RLJob) -> None:
    """No WeightChannel: no fetcher, no sidecar; SGLang runs spec.model.path directly, still labelled
    with a version (0) so its tokens never carry "default"."""
    sg_manifest = children(job)[("SamplerGroup", "reference-fleet-h100-bf16")]
    sg = SamplerGroup.from_manifest(sg_manifest)
    dep = workloads.build_sampler_deployment(sg, NS, None, CATALOG, None)
    pod = dep["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    assert "initContainers" not in pod
    argv = engine["command"] + engine["args"]
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert argv[argv.index("--model-path") + 1] == "Qwen/Qwen3-8B"
    assert argv[argv.index("--weight-version") + 1] == "0"
    _assert_restricted(pod)


# --- placement fields (docs/scheduling.md) -------------------------------------------------------------

PLACEMENT = {
    "nodeSelector": {"pool": "rl"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1"]}]}
                ]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 10, "preference": {"matchExpressions": [{"key": "spot", "operator": "DoesNotExist"}]}}
            ],
        },
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 5, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                  "labelSelector": {"matchLabels": {"noisy": "yes"}}}}
            ]
        },
    },
    "priorityClassName": "rl-high",
    "resources": {"requests": {"cpu": "16", "ephemeral-storage": "100Gi"}, "limits": {"memory": "256Gi"}},
    "podLabels": {"kueue.x-k8s.io/queue-name": "team-a", "team": "rl"},
    "podAnnotations": {"example.com/owner": "rl-team"},
}  # fmt: skip


def with_placement(job: RLJob, where: str, extra: dict | None = None) -> RLJob:
    """The example with PLACEMENT (plus `extra`) set on the trainer, the router or group 0."""
    wire = job.to_wire()
    target = wire["spec"]["samplerGroups"][0] if where == "group" else wire["spec"][where]
    target.update(copy.deepcopy(PLACEMENT) | (extra or {}))
    return RLJob.from_manifest(wire)


def assert_placed(template: dict, container: str, default_requests: dict, gpus: str | None) -> None:
    meta, pod = template["metadata"], template["spec"]
    assert meta["labels"]["team"] == "rl" and meta["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert meta["annotations"]["example.com/owner"] == "rl-team"
    assert meta["annotations"]["prometheus.io/scrape"] == "true"  # the operator's stay
    assert pod["nodeSelector"] == {"pool": "rl"} and pod["priorityClassName"] == "rl-high"
    assert {"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    node = pod["affinity"]["nodeAffinity"]
    assert node["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 10
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["labelSelector"] == {"matchLabels": {"noisy": "yes"}}
    (c,) = [c for c in pod["containers"] if c["name"] == container]
    requests = {**default_requests, "cpu": "16", "ephemeral-storage": "100Gi"}
    if gpus is not None:
        requests["nvidia.com/gpu"] = gpus
        assert c["resources"]["limits"] == {"nvidia.com/gpu": gpus, "memory": "256Gi"}
    else:
        assert c["resources"]["limits"] == {"memory": "256Gi"}
    assert c["resources"]["requests"] == requests


def catalog_and_zone_terms(pod: dict, accelerator: str) -> list[dict]:
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    zone = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1"]}
    catalog_terms = CATALOG.get(accelerator).node_selector_terms()
    # every catalog term (GFD product, GKE accelerator) is kept, each ANDed with the user's zone term
    assert terms == [{"matchExpressions": [*t["matchExpressions"], zone]} for t in catalog_terms]
    assert len(terms) == 2 and terms[0]["matchExpressions"][0]["values"] == [PRODUCTS[accelerator]]
    return terms


def test_trainer_placement_fields_land_in_the_pod_template_and_keep_the_class(job: RLJob) -> None:
    placed = with_placement(job, "trainer")
    template = children(placed)[("StatefulSet", "reference-fleet-trainer")]["spec"]["template"]
    assert_placed(template, "trainer", {"memory": "64Gi"}, gpus="8")
    catalog_and_zone_terms(template["spec"], "b200")
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in template["spec"][
        "tolerations"
    ]


def test_trainer_is_one_kueue_pod_group_with_one_replica_per_node(job: RLJob) -> None:
    placed = with_placement(job, "trainer", {"replicas": 3})
    sts = children(placed)[("StatefulSet", "reference-fleet-trainer")]
    meta, pod = sts["spec"]["template"]["metadata"], sts["spec"]["template"]["spec"]
    assert meta["labels"]["kueue.x-k8s.io/pod-group-name"] == "reference-fleet-trainer"
    assert meta["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "3"
    assert meta["annotations"]["kueue.x-k8s.io/pod-group-serving"] == "true"
    assert sts["spec"]["selector"]["matchLabels"] == {
        "rlfleet.dev/job": "reference-fleet",
        "app.kubernetes.io/component": "trainer",
    }
    (own,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert own == {
        "labelSelector": {"matchLabels": sts["spec"]["selector"]["matchLabels"]},
        "topologyKey": "kubernetes.io/hostname",
    }
    # the user's preferred anti-affinity is kept next to the operator's required term
    assert (
        pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"]
        == 5
    )


def test_trainer_without_a_queue_or_with_one_replica_adds_no_gang_keys(job: RLJob) -> None:
    pod_template = children(job)[("StatefulSet", "reference-fleet-trainer")]["spec"]["template"]
    assert not any(k.startswith("kueue.x-k8s.io/") for k in pod_template["metadata"]["labels"])
    assert not any(k.startswith("kueue.x-k8s.io/") for k in pod_template["metadata"]["annotations"])
    assert set(pod_template["spec"]["affinity"]) == {"nodeAffinity"}
    assert "nodeSelector" not in pod_template["spec"] and "priorityClassName" not in pod_template["spec"]


def test_group_placement_propagates_to_the_samplergroup_and_its_pods(job: RLJob) -> None:
    placed = with_placement(job, "group")
    sg = children(placed)[("SamplerGroup", "reference-fleet-b200-nvfp4")]
    for key in (
        "nodeSelector",
        "tolerations",
        "priorityClassName",
        "resources",
        "podLabels",
        "podAnnotations",
    ):
        assert sg["spec"][key] == PLACEMENT[key], key
    assert sg["spec"]["affinity"]["nodeAffinity"] == PLACEMENT["affinity"]["nodeAffinity"]
    assert SamplerGroup.from_manifest(sg).spec.priority_class_name == "rl-high"
    template = sampler_deployment(placed, "b200-nvfp4")["spec"]["template"]
    assert_placed(template, "sglang", {"memory": "32Gi"}, gpus="1")
    catalog_and_zone_terms(template["spec"], "b200")
    # Kueue's pod group is the trainer's only: a sampler group is a set of independent servers
    assert "kueue.x-k8s.io/pod-group-name" not in template["metadata"]["labels"]
    # groups without placement fields carry none (no empty keys in the SamplerGroup)
    plain = children(placed)[("SamplerGroup", "reference-fleet-h100-fp8")]["spec"]
    assert not {"nodeSelector", "tolerations", "affinity", "resources", "podLabels"} & set(plain)


def test_example_packs_the_b200_samplers_next_to_the_catalog_affinity(job: RLJob) -> None:
    pod = sampler_deployment(job, "b200-nvfp4")["spec"]["template"]["spec"]
    (term,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    labels = sampler_deployment(job, "b200-nvfp4")["spec"]["template"]["metadata"]["labels"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()  # it selects its own group's pods
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms == CATALOG.get("b200").node_selector_terms()


def test_router_placement_fields_and_no_gpu_toleration(job: RLJob) -> None:
    placed = with_placement(job, "router")
    template = children(placed)[("Deployment", "reference-fleet-router")]["spec"]["template"]
    assert_placed(template, "router", {"memory": "256Mi"}, gpus=None)
    terms = template["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert (
        terms["nodeSelectorTerms"]
        == PLACEMENT["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
    )
    assert all(t["key"] != "nvidia.com/gpu" for t in template["spec"]["tolerations"])
    plain = children(job)[("Deployment", "reference-fleet-router")]["spec"]["template"]["spec"]
    assert "affinity" not in plain and "tolerations" not in plain


@pytest.mark.parametrize("where", ["trainer", "router", "group"])
@pytest.mark.parametrize("kind", ["requests", "limits"])
def test_gpu_override_in_resources_is_refused(job: RLJob, where: str, kind: str) -> None:
    with pytest.raises(ValueError, match="resources must not set nvidia.com/gpu"):
        with_placement(job, where, {"resources": {kind: {"nvidia.com/gpu": "4"}}})


def test_an_external_trainer_runs_the_slime_bridge_and_no_training() -> None:
    """examples/rljob-slime.yaml: the trainer StatefulSet runs one CPU pod of `rlfleet slime bridge` on the
    job's config (no torchrun, no rendezvous, no GPU), with slime's publish directory mounted read-only
    where the RLJob says, and the store mounted to publish; the groups and the router are as for any job."""
    docs = [d for d in yaml.safe_load_all((REPO / "examples" / "rljob-slime.yaml").read_text())]
    slime = RLJob.from_manifest(next(d for d in docs if d["kind"] == "RLJob"))
    out = children(slime)
    sts = out[("StatefulSet", "slime-trainer")]
    assert sts["spec"]["replicas"] == 1
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["rlfleet"]
    assert c["args"] == [
        "slime",
        "bridge",
        "--config",
        f"{n.CONFIG_MOUNT}/{n.CONFIG_FILE}",
        "--metrics-port",
        str(n.TRAINER_METRICS_PORT),
    ]
    assert "nvidia.com/gpu" not in (c["resources"].get("limits") or {})
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/slime"]["readOnly"] is True and mounts["/slime"]["name"] == "slime-updates"
    assert mounts["/weights/slime"]["name"] and not mounts["/weights/slime"].get("readOnly")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["slime-updates"]["persistentVolumeClaim"]["claimName"] == "slime-updates"
    assert {("SamplerGroup", f"slime-{g}") for g in ("bf16", "fp8", "nvfp4")} <= set(out)
    assert ("Deployment", "slime-router") in out
