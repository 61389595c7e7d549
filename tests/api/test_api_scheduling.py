"""Placement fields of the trainer, the sampler groups and the router: pydantic refusals and the CRD rules
(the same cases against the real kube-apiserver: tests/api/invalid_rljobs.yaml)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from support.manifests import samplergroup

from rlfleet import catalog
from rlfleet.api import RLJob, SamplerGroup
from rlfleet.api import scheduling as s
from rlfleet.api.common import QUANTITY_PATTERN
from rlfleet.api.crdgen import rljob_crd, samplergroup_crd
from rlfleet.api.podfields import ENV_RESERVED_RULE, ENV_SECRET_RULE, MOUNT_VOLUME_RULE
from rlfleet.operator import naming as n

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml"


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def test_the_gpu_resource_is_the_catalogs() -> None:
    assert s.GPU_RESOURCE_NAME == catalog.GPU_RESOURCE
    assert catalog.GPU_TOLERATION["key"] == s.GPU_RESOURCE_NAME


def test_every_label_the_operator_puts_on_pods_is_refused_as_a_user_label() -> None:
    operator_keys = {
        *n.job_labels("j", "trainer"),
        n.LABEL_GROUP,
        n.LABEL_SAMPLERGROUP,
        n.LABEL_ACCELERATOR,
        n.LABEL_WEIGHT_FORMAT,
        s.KUEUE_POD_GROUP_LABEL,
    }
    for key in operator_keys:
        assert key.startswith(s.OPERATOR_LABEL_PREFIX) or key in s.OPERATOR_LABEL_KEYS, key
        manifest = example()
        manifest["spec"]["trainer"]["podLabels"] = {key: "x"}
        with pytest.raises(ValidationError, match="podLabels must not set the operator's own labels"):
            RLJob.from_manifest(manifest)
    for key in (
        n.ANN_PROM_SCRAPE,
        n.ANN_PROM_PORT,
        n.ANN_PROM_PATH,
        n.ANN_SPEC_HASH,
        "rlfleet.dev/config-hash",
        s.KUEUE_POD_GROUP_COUNT_ANNOTATION,
        s.KUEUE_POD_GROUP_SERVING_ANNOTATION,
    ):
        manifest = example()
        manifest["spec"]["router"]["podAnnotations"] = {key: "x"}
        with pytest.raises(
            ValidationError, match="podAnnotations must not set the operator's own annotations"
        ):
            RLJob.from_manifest(manifest)


def test_kueue_queue_label_and_foreign_keys_are_accepted() -> None:
    manifest = example()
    manifest["spec"]["trainer"].update(
        {
            "podLabels": {s.KUEUE_QUEUE_LABEL: "team-a", "team": "rl"},
            "podAnnotations": {
                "example.com/owner": "rl team",
                "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
            },
            "nodeSelector": {"cloud.google.com/gke-nodepool": "b200-pool"},
            "priorityClassName": "rl-high",
            "resources": {"requests": {"cpu": "16", "memory": "128Gi"}, "limits": {"memory": "256Gi"}},
            "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        }
    )
    job = RLJob.from_manifest(manifest)
    assert job.spec.trainer.pod_labels[s.KUEUE_QUEUE_LABEL] == "team-a"
    assert job.spec.trainer.resources is not None and job.spec.trainer.resources.requests["cpu"] == "16"
    again = RLJob.from_manifest(job.to_wire())  # wire form round-trips
    assert again.spec.trainer.placement_wire() == job.spec.trainer.placement_wire()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "podLabels",
            {"bad key!": "x"},
            "label and annotation keys must be Kubernetes qualified names: got bad key!",
        ),
        ("nodeSelector", {"pool": "not a value"}, "String should match pattern"),
        ("podLabels", {"team": "x" * 64}, "at most 63 characters"),
        ("resources", {"requests": {"cpu": 16}}, "Input should be a valid string"),
        ("tolerations", [{"operator": "Exists", "value": "v"}], "toleration: operator Exists takes no value"),
        (
            "affinity",
            {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {}}]}},
            "topologyKey",
        ),
        (
            "affinity",
            {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}},
            "at least 1 item",
        ),
    ],
)
def test_bad_placement_is_refused_with_the_field_named(field: str, value: object, message: str) -> None:
    for where in ("trainer", "router", "group"):
        manifest = example()
        target = manifest["spec"]["samplerGroups"][0] if where == "group" else manifest["spec"][where]
        target[field] = copy.deepcopy(value)
        with pytest.raises(ValidationError) as info:
            RLJob.from_manifest(manifest)
        assert message in str(info.value), (where, str(info.value))


def test_a_standalone_samplergroup_takes_the_same_fields() -> None:
    sg = SamplerGroup.from_manifest(
        samplergroup(nodeSelector={"pool": "rl"}, podLabels={s.KUEUE_QUEUE_LABEL: "serving"})
    )
    assert sg.spec.placement_wire() == {
        "nodeSelector": {"pool": "rl"},
        "podLabels": {s.KUEUE_QUEUE_LABEL: "serving"},
    }
    with pytest.raises(ValidationError, match="resources must not set nvidia.com/gpu"):
        SamplerGroup.from_manifest(samplergroup(resources={"limits": {"nvidia.com/gpu": "8"}}))


def test_every_role_has_the_placement_fields_and_rules_in_the_crds() -> None:
    rules = {s.GPU_OVERRIDE_RULE, s.POD_LABELS_RULE, s.POD_ANNOTATIONS_RULE, s.LABEL_KEYS_RULE}
    rl = rljob_crd(catalog.load_catalog(None))["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = rl["properties"]["spec"]["properties"]
    sg = samplergroup_crd(catalog.load_catalog(None))["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    roles = {
        "trainer": spec["trainer"],
        "router": spec["router"],
        "samplerGroups[]": spec["samplerGroups"]["items"],
        "SamplerGroup.spec": sg["properties"]["spec"],
    }
    for role, schema in roles.items():
        props = schema["properties"]
        assert {
            "nodeSelector",
            "tolerations",
            "affinity",
            "priorityClassName",
            "resources",
            "podLabels",
            "podAnnotations",
        } <= set(props), role
        found = {
            v["rule"]
            for key in ("resources", "podLabels", "podAnnotations")
            for v in props[key].get("x-kubernetes-validations", [])
        }
        assert found == rules, role
        assert (
            props["resources"]["properties"]["requests"]["additionalProperties"]["pattern"]
            == QUANTITY_PATTERN
        )
        # the pod template fields (rlfleet/api/podfields.py) and their rules, on every role
        assert {"env", "envFrom", "imagePullSecrets", "serviceAccountName", "volumes", "volumeMounts"} <= set(
            props
        )
        assert MOUNT_VOLUME_RULE in {v["rule"] for v in schema["x-kubernetes-validations"]}, role
        env_rules = {v["rule"] for v in props["env"]["items"]["x-kubernetes-validations"]}
        assert {ENV_RESERVED_RULE, ENV_SECRET_RULE} <= env_rules, role
