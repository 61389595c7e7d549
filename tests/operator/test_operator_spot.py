"""Spot sampler groups (`spot: true`): RLJob group -> SamplerGroup spec -> the pods' spot flavor
(the catalog's spot node terms ANDed with the class's and the user's, the spot tolerations), exactly."""

from __future__ import annotations

from typing import Any

import pytest
from test_operator_builders import CATALOG, NS, OWNER, REPO  # the builder tests' one copy

from rlfleet.api import RLJob, SamplerGroup, load_rljob
from rlfleet.catalog import CatalogError, catalog_from_mapping
from rlfleet.operator import builders, workloads

GPU = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
GKE_TAINT = {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
AKS_TAINT = {
    "key": "kubernetes.azure.com/scalesetpriority",
    "operator": "Equal",
    "value": "spot",
    "effect": "NoSchedule",
}
SPOT_LABELS = [
    {"key": "cloud.google.com/gke-spot", "operator": "In", "values": ["true"]},
    {"key": "eks.amazonaws.com/capacityType", "operator": "In", "values": ["SPOT"]},
    {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["spot"]},
    {"key": "kubernetes.azure.com/scalesetpriority", "operator": "In", "values": ["spot"]},
]
H100_PRODUCT = {
    "key": "nvidia.com/gpu.product",
    "operator": "In",
    "values": ["NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-SXM5-80GB", "NVIDIA-H100-PCIe", "NVIDIA-H100-NVL"],
}
H100_GKE = {
    "key": "cloud.google.com/gke-accelerator",
    "operator": "In",
    "values": ["nvidia-h100-80gb", "nvidia-h100-mega-80gb"],
}


def job_with(group_fields: dict[str, Any], name: str = "h100-fp8") -> RLJob:
    job = load_rljob(REPO / "examples" / "rljob.yaml")
    manifest = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    for g in manifest["spec"]["samplerGroups"]:
        if g["name"] == name:
            g.update(group_fields)
    return RLJob.from_manifest(manifest)


def pod_spec(job: RLJob, group: str = "h100-fp8", catalog=CATALOG) -> tuple[dict, dict]:
    """(SamplerGroup manifest, the Deployment's pod spec) of `group`."""
    sgs = {
        c["metadata"]["name"]: c
        for c in builders.build_job_children(job, NS, OWNER, catalog)
        if c["kind"] == "SamplerGroup"
    }
    sg_manifest = sgs[f"reference-fleet-{group}"]
    sg = SamplerGroup.from_manifest(sg_manifest)
    deployment = workloads.build_sampler_deployment(
        sg,
        NS,
        sg_manifest | {"metadata": {**sg_manifest["metadata"], "uid": "sg"}},
        catalog,
        job.spec.weight_channel.store,
    )
    return sg_manifest, deployment["spec"]["template"]["spec"]


def required_terms(spec: dict) -> list[dict]:
    return spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]


def test_the_catalog_names_h100_nodes_as_these_tests_expect() -> None:
    # the expected terms below are written out by hand; this pins the class's two terms they build on
    assert CATALOG.get("h100").node_selector_terms() == [
        {"matchExpressions": [H100_PRODUCT]},
        {"matchExpressions": [H100_GKE]},
    ]


def test_an_on_demand_group_has_no_spot_flavor() -> None:
    sg, spec = pod_spec(job_with({}))
    assert sg["spec"]["spot"] is False
    assert spec["tolerations"] == [GPU]
    assert required_terms(spec) == [{"matchExpressions": [H100_PRODUCT]}, {"matchExpressions": [H100_GKE]}]


def test_a_spot_group_requires_a_spot_node_of_its_class_and_tolerates_the_spot_taints() -> None:
    sg, spec = pod_spec(job_with({"spot": True}))
    assert sg["spec"]["spot"] is True
    assert SamplerGroup.from_manifest(sg).spec.spot is True
    assert spec["tolerations"] == [GPU, GKE_TAINT, AKS_TAINT]
    # (product | gke accelerator) & (gke spot | eks spot | karpenter spot | aks spot): 2 x 4 terms
    assert required_terms(spec) == [
        {"matchExpressions": [H100_PRODUCT, SPOT_LABELS[0]]},
        {"matchExpressions": [H100_PRODUCT, SPOT_LABELS[1]]},
        {"matchExpressions": [H100_PRODUCT, SPOT_LABELS[2]]},
        {"matchExpressions": [H100_PRODUCT, SPOT_LABELS[3]]},
        {"matchExpressions": [H100_GKE, SPOT_LABELS[0]]},
        {"matchExpressions": [H100_GKE, SPOT_LABELS[1]]},
        {"matchExpressions": [H100_GKE, SPOT_LABELS[2]]},
        {"matchExpressions": [H100_GKE, SPOT_LABELS[3]]},
    ]
    # the other groups of the job stay on-demand
    other, other_spec = pod_spec(job_with({"spot": True}), "h200-fp8")
    assert other["spec"]["spot"] is False and other_spec["tolerations"] == [GPU]


def test_the_users_placement_is_anded_with_the_spot_flavor_and_its_tolerations_follow() -> None:
    zone = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-east1-b"]}
    user_toleration = {"key": "team", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}
    job = job_with(
        {
            "spot": True,
            "tolerations": [user_toleration, GKE_TAINT],  # the GKE one again: not duplicated
            "nodeSelector": {"cloud.google.com/gke-nodepool": "spot-h100"},
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [zone]}]
                    }
                }
            },
        }
    )
    _, spec = pod_spec(job)
    assert spec["tolerations"] == [GPU, GKE_TAINT, AKS_TAINT, user_toleration]
    assert spec["nodeSelector"] == {"cloud.google.com/gke-nodepool": "spot-h100"}
    terms = required_terms(spec)
    assert len(terms) == 8
    assert terms[0] == {"matchExpressions": [H100_PRODUCT, SPOT_LABELS[0], zone]}
    assert terms[7] == {"matchExpressions": [H100_GKE, SPOT_LABELS[3], zone]}


def test_a_catalog_override_replaces_the_spot_flavor_whole() -> None:
    catalog = catalog_from_mapping(
        {
            "spot": {
                "nodeLabels": [{"key": "example.com/capacity", "values": ["preemptible"]}],
                "tolerations": [
                    {"key": "example.com/preemptible", "operator": "Exists", "effect": "NoExecute"}
                ],
            }
        }
    )
    _, spec = pod_spec(job_with({"spot": True}), catalog=catalog)
    assert spec["tolerations"] == [
        GPU,
        {"key": "example.com/preemptible", "operator": "Exists", "effect": "NoExecute"},
    ]
    label = {"key": "example.com/capacity", "operator": "In", "values": ["preemptible"]}
    assert required_terms(spec) == [
        {"matchExpressions": [H100_PRODUCT, label]},
        {"matchExpressions": [H100_GKE, label]},
    ]


@pytest.mark.parametrize(
    ("spot", "message"),
    [
        ({"nodeLabels": []}, "spot is invalid: nodeLabels"),
        (
            {"nodeLabels": [{"key": "a/b", "operator": "Exists", "values": ["x"]}]},
            "operator In takes values, Exists none",
        ),
        ({"nodeLabels": [{"key": "a/b"}]}, "operator In takes values, Exists none"),
        ({"nodeLabels": [{"key": "a/b", "values": ["x"]}], "taints": []}, "spot is invalid: taints"),
    ],
)
def test_a_bad_spot_flavor_is_refused_with_where(spot: dict, message: str) -> None:
    with pytest.raises(CatalogError, match=message):
        catalog_from_mapping({"spot": spot})


def test_a_spot_group_on_the_cpu_class_requires_only_a_spot_node() -> None:
    from rlfleet.api import SamplerGroupSpec

    spec = SamplerGroupSpec.model_validate(
        {"name": "cpu", "accelerator": "cpu", "spot": True, "model": {"name": "m", "path": "/m"}}
    )
    sg = SamplerGroup.from_manifest(
        {
            "apiVersion": "rlfleet.dev/v1alpha1",
            "kind": "SamplerGroup",
            "metadata": {"name": "cpu-spot", "namespace": NS},
            "spec": spec.to_wire(),
        }
    )
    deployment = workloads.build_sampler_deployment(sg, NS, None, CATALOG, None)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["tolerations"] == [GKE_TAINT, AKS_TAINT]
    assert required_terms(pod) == [{"matchExpressions": [r]} for r in SPOT_LABELS]
