"""Pure builders: each role's env / envFrom, imagePullSecrets, serviceAccountName and extra volumes land on
the right pod and containers (docs/operations.md, "Gated models and private registries"), and the names
the API refuses are exactly the ones the operator uses."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from test_operator_builders import s3_store

from rlfleet.api import RLJob, SamplerGroup, StoreSpec, load_rljob
from rlfleet.api.podfields import (
    OPERATOR_ENV_NAMES,
    OPERATOR_ENV_PREFIX,
    OPERATOR_MOUNT_PATHS,
    OPERATOR_VOLUME_NAMES,
)
from rlfleet.catalog import Catalog, load_catalog
from rlfleet.operator import builders, workloads

REPO = Path(__file__).resolve().parents[2]
CATALOG = load_catalog(None)
OWNER = {"apiVersion": "rlfleet.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "gated", "uid": "u-1"}}
NS = "team-a"
HF_TOKEN = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}}


def children(job: RLJob) -> dict[tuple[str, str], dict]:
    return {
        (c["kind"], c["metadata"]["name"]): c for c in builders.build_job_children(job, NS, OWNER, CATALOG)
    }


def sampler_pod(job: RLJob, group: str, catalog: Catalog = CATALOG, store: StoreSpec | None = None) -> dict:
    """The pod template of a group's Deployment, built from the SamplerGroup child the way the operator
    does (the child's spec re-parsed: what the group inherits goes through the SamplerGroup CRD)."""
    manifest = children(job)[("SamplerGroup", f"{job.name}-{group}")]
    sg = SamplerGroup.from_manifest(manifest)
    store = store if store is not None else job.spec.weight_channel.store
    owner = manifest | {"metadata": {**manifest["metadata"], "uid": "sg"}}
    return workloads.build_sampler_deployment(sg, NS, owner, catalog, store)["spec"]["template"]["spec"]


def containers(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in [*pod.get("initContainers", []), *pod["containers"]]}


def test_gated_example_token_reaches_the_trainer_by_reference_only() -> None:
    job = load_rljob(REPO / "examples" / "rljob-gated-model.yaml")
    out = children(job)
    trainer_pod = out[("StatefulSet", "gated-trainer")]["spec"]["template"]["spec"]
    (trainer,) = trainer_pod["containers"]
    assert trainer["env"][-1] == HF_TOKEN
    assert [e["name"] for e in trainer["env"]].count("HF_TOKEN") == 1
    # workload identity: the ServiceAccount and its token; the private registry's pull secret
    assert trainer_pod["serviceAccountName"] == "rl-weights"
    assert trainer_pod["automountServiceAccountToken"] is True
    assert trainer_pod["imagePullSecrets"] == [{"name": "regcred"}]
    router_pod = out[("Deployment", "gated-router")]["spec"]["template"]["spec"]
    assert router_pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert router_pod["automountServiceAccountToken"] is False and "serviceAccountName" not in router_pod
    sampler = sampler_pod(job, "h200-fp8")
    assert sampler["serviceAccountName"] == "rl-weights" and sampler["automountServiceAccountToken"] is True
    assert sampler["imagePullSecrets"] == [{"name": "regcred"}]
    # the samplers never reach the Hub in a job: they start from the store, offline
    engine = containers(sampler)["sglang"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in engine["env"]
    assert all("HF_TOKEN" not in str(c.get("env")) for c in containers(sampler).values())


def with_fields(job: RLJob, where: str, fields: dict) -> RLJob:
    wire = job.to_wire()
    target = wire["spec"]["samplerGroups"][0] if where == "group" else wire["spec"][where]
    target.update(copy.deepcopy(fields))
    return RLJob.from_manifest(wire)


FIELDS = {
    "env": [HF_TOKEN, {"name": "NCCL_DEBUG", "value": "WARN"}],
    "envFrom": [{"secretRef": {"name": "wandb"}}, {"prefix": "CFG_", "configMapRef": {"name": "knobs"}}],
    "volumes": [
        {"name": "ca", "secret": {"secretName": "corp-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"name": "scratch", "emptyDir": {}},
    ],
    "volumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True},
                     {"name": "scratch", "mountPath": "/tmp/huggingface"}],
}  # fmt: skip
WIRE_ENV_FROM = FIELDS["envFrom"]
WIRE_VOLUMES = FIELDS["volumes"]
WIRE_MOUNTS = FIELDS["volumeMounts"]


@pytest.fixture()
def job() -> RLJob:
    return load_rljob(REPO / "examples" / "rljob.yaml")


def test_trainer_fields_land_on_its_pod_and_container(job: RLJob) -> None:
    pod = children(with_fields(job, "trainer", FIELDS))[("StatefulSet", "reference-fleet-trainer")]["spec"][
        "template"
    ]["spec"]
    (trainer,) = pod["containers"]
    assert trainer["env"][-2:] == FIELDS["env"]
    assert trainer["envFrom"] == WIRE_ENV_FROM
    assert trainer["volumeMounts"][-2:] == WIRE_MOUNTS
    assert pod["volumes"][-2:] == WIRE_VOLUMES  # emptyDir: {} kept as a source
    assert pod["automountServiceAccountToken"] is False and "imagePullSecrets" not in pod


def test_router_fields_land_on_its_pod_and_container(job: RLJob) -> None:
    pod = children(with_fields(job, "router", FIELDS))[("Deployment", "reference-fleet-router")]["spec"][
        "template"
    ]["spec"]
    (router,) = pod["containers"]
    key = {
        "name": "RLFLEET_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "reference-fleet-api-key", "key": "key"}},
    }
    assert router["env"] == [{"name": "HOME", "value": "/tmp"}, key, *FIELDS["env"]]
    assert router["envFrom"] == WIRE_ENV_FROM
    assert router["volumeMounts"][-2:] == WIRE_MOUNTS and pod["volumes"][-2:] == WIRE_VOLUMES


def test_group_env_reaches_every_container_and_volumes_only_the_engine(job: RLJob) -> None:
    changed = with_fields(job, "group", {**FIELDS, "serviceAccountName": "rl-weights"})
    group = changed.spec.sampler_groups[0].name
    sg_spec = children(changed)[("SamplerGroup", f"reference-fleet-{group}")]["spec"]
    # the SamplerGroup child carries the fields in wire form (emptyDir: {} is not dropped as empty)
    assert sg_spec["env"] == FIELDS["env"] and sg_spec["volumes"] == WIRE_VOLUMES
    assert sg_spec["serviceAccountName"] == "rl-weights"
    pod = sampler_pod(changed, group)
    by_name = containers(pod)
    assert set(by_name) == {"weight-fetch", "sglang", "weight-sync"}
    for c in by_name.values():
        assert c["env"][-2:] == FIELDS["env"] and c["envFrom"] == WIRE_ENV_FROM
    assert by_name["sglang"]["volumeMounts"][-2:] == WIRE_MOUNTS
    for sync in ("weight-fetch", "weight-sync"):
        assert "/etc/ssl/corp" not in [m["mountPath"] for m in by_name[sync]["volumeMounts"]]
    assert pod["volumes"][-2:] == WIRE_VOLUMES
    assert pod["serviceAccountName"] == "rl-weights" and pod["automountServiceAccountToken"] is True


def test_a_user_env_name_replaces_the_catalog_launch_env_of_that_name(job: RLJob) -> None:
    classes = dict(CATALOG.classes)
    classes["b200"] = classes["b200"].model_copy(update={"env": {"NCCL_DEBUG": "INFO", "OTHER": "1"}})
    catalog = Catalog(classes=classes)
    changed = with_fields(job, "group", {"env": [{"name": "NCCL_DEBUG", "value": "WARN"}]})
    assert changed.spec.sampler_groups[0].accelerator == "b200"
    engine = containers(sampler_pod(changed, changed.spec.sampler_groups[0].name, catalog))["sglang"]
    nccl = [e for e in engine["env"] if e["name"] == "NCCL_DEBUG"]
    assert nccl == [{"name": "NCCL_DEBUG", "value": "WARN"}]
    assert {"name": "OTHER", "value": "1"} in engine["env"]


def test_the_refused_names_cover_everything_the_operator_sets(job: RLJob) -> None:
    """Every env name, volume and mount path of every workload (filesystem and S3 stores, with and without
    a channel) is one the API refuses to users, so a user field can never collide with the operator's."""
    s3 = s3_store(region="r", samplerSecretRef={"name": "s3-read"})
    out = children(job)
    pods = [
        out[("StatefulSet", "reference-fleet-trainer")]["spec"]["template"]["spec"],
        out[("Deployment", "reference-fleet-router")]["spec"]["template"]["spec"],
    ]
    for g in job.spec.sampler_groups:
        pods.append(sampler_pod(job, g.name))
        pods.append(sampler_pod(job, g.name, store=s3))
    s3_job = job.model_copy(deep=True)
    s3_job.spec.weight_channel.store = s3
    pods.append(children(s3_job)[("StatefulSet", "reference-fleet-trainer")]["spec"]["template"]["spec"])
    store_path = job.spec.weight_channel.store.path
    env, vols, paths = set(), set(), set()
    for pod in pods:
        vols |= {v["name"] for v in pod["volumes"]}
        for c in containers(pod).values():
            env |= {e["name"] for e in c["env"]}
            paths |= {m["mountPath"] for m in c["volumeMounts"]}
    assert {"AWS_ACCESS_KEY_ID", "HF_HUB_OFFLINE", "NODE_RANK"} <= env  # the sweep saw every kind of pod
    assert (
        sorted(e for e in env if not e.startswith(OPERATOR_ENV_PREFIX) and e not in OPERATOR_ENV_NAMES) == []
    )
    assert vols == set(OPERATOR_VOLUME_NAMES)
    # the store's own paths: its mount (a trainer mount there is refused, RLJobSpec._check_store_mount) and the
    # sampler sync containers' writable subscribers/<group>/ under it (user mounts never reach sync containers)
    reports = {p for p in paths if p.startswith(f"{store_path}/subscribers/")}
    assert len(reports) == len(job.spec.sampler_groups)
    assert paths - {store_path} - reports == set(OPERATOR_MOUNT_PATHS)
