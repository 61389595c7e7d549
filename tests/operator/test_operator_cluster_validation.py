"""The CRDs against the real kube-apiserver: valid examples are accepted (with defaults filled in), and
every invalid case of tests/api/invalid_rljobs.yaml is rejected by `kubectl apply` with its message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.invalid_rljobs import CASES, apply_case
from support.manifests import samplergroup

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())

pytestmark = pytest.mark.cluster


def test_crds_install_and_example_is_accepted_with_defaults(kube, crds, namespace: str) -> None:
    kube.kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / "rljob.yaml"))
    job = kube.get_json("rljob", "reference-fleet", "-n", namespace)
    spec = job["spec"]
    # defaults the example leaves out are filled in by the API server from the CRD
    assert spec["router"]["maxShareChange"] == 0.1 and spec["samplerGroups"][0]["kvCacheDtype"] == "auto"
    assert spec["safety"]["klSurgeFactor"] == 3.0 and spec["samplerImages"]["pullPolicy"] == "IfNotPresent"
    # a minimal job gets every nested default (default: {} on parent objects)
    minimal = {
        "apiVersion": "rlfleet.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "minimal"},
        "spec": {
            "model": {"name": "m", "path": "/m", "maxSeqLen": None},  # null: the model's own context
            "samplerGroups": [{"name": "g", "accelerator": "h100"}],
            "weightChannel": {"store": {"path": "/w"}},
        },
    }
    kube.apply(minimal, namespace=namespace)
    spec = kube.get_json("rljob", "minimal", "-n", namespace)["spec"]
    assert spec["rollout"]["promptsPerStep"] == 128 and spec["correction"]["misHigh"] == 5.0
    assert spec["correction"]["mode"] == "sc-mis-topp" and spec["local"]["model"]["hiddenSize"] == 128
    assert spec["samplerGroups"][0]["weightFormat"] == "bf16" and spec["samplerGroups"][0]["replicas"] == 1
    # degraded-but-valid: FP8 on A100 is accepted
    a100 = apply_case(
        EXAMPLE, {"set": {"spec.samplerGroups.6.weightFormat": "fp8", "metadata.name": "a100-fp8"}}
    )
    kube.apply(a100, namespace=namespace)
    # GitOps: server-side apply of the same manifest twice changes nothing; kubectl diff is clean
    gitops = apply_case(EXAMPLE, {"set": {"metadata.name": "gitops"}})
    kube.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", input=json.dumps(gitops))
    first = kube.get_json("rljob", "gitops", "-n", namespace)["metadata"]["resourceVersion"]
    kube.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", input=json.dumps(gitops))
    assert kube.get_json("rljob", "gitops", "-n", namespace)["metadata"]["resourceVersion"] == first
    diff = kube.kubectl(
        "diff", "--server-side", "-n", namespace, "-f", "-", input=json.dumps(gitops), check=False
    )
    assert diff.returncode == 0, diff.stdout + diff.stderr


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_invalid_manifest_is_rejected_by_kubectl_apply(kube, crds, namespace: str, case: dict) -> None:
    manifest = apply_case(EXAMPLE, case)
    result = kube.apply(manifest, namespace=namespace, check=False)
    assert result.returncode != 0, f"{case['name']} was accepted"
    assert case["expect"] in result.stderr, result.stderr
    name = manifest["metadata"]["name"]
    assert kube.kubectl("get", "rljob", name, "-n", namespace, check=False).returncode != 0


def test_samplergroup_crd_rejects_what_the_class_cannot_run(kube, crds, namespace: str) -> None:
    sg = samplergroup("x-h100", weightFormat="nvfp4")
    result = kube.apply(sg, namespace=namespace, check=False)
    assert result.returncode != 0 and "native NVFP4 needs Blackwell" in result.stderr
    sg["spec"]["weightFormat"] = "fp8"
    kube.apply(sg, namespace=namespace)


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("rljob*.yaml")), ids=lambda p: p.name)
def test_every_example_passes_server_side_validation(kube, crds, namespace: str, path: Path) -> None:
    result = kube.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(path), check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_crd_cel_matches_the_catalog_for_every_class_format_kv(kube, crds, namespace: str) -> None:
    """All 7 x 4 x 6 SamplerGroups (the GPU classes and cpu), server-side dry run: the API server accepts
    exactly what the catalog runs."""
    import itertools

    from rlfleet.api import KV_CACHE_DTYPES, WEIGHT_FORMATS
    from rlfleet.catalog import CatalogError, check_group, load_catalog

    catalog = load_catalog(None)
    expected, items = {}, []
    for i, (cls, fmt, kv) in enumerate(itertools.product(catalog.names(), WEIGHT_FORMATS, KV_CACHE_DTYPES)):
        name = f"combo-{i:03d}"
        try:
            check_group(cls, fmt, kv, catalog=catalog)
            expected[name] = True
        except CatalogError:
            expected[name] = False
        items.append(
            {
                "apiVersion": "rlfleet.dev/v1alpha1",
                "kind": "SamplerGroup",
                "metadata": {"name": name},
                "spec": {
                    "name": "g",
                    "accelerator": cls,
                    "weightFormat": fmt,
                    "kvCacheDtype": kv,
                    "model": {"name": "m", "path": "p"},
                },
            }
        )
    result = kube.kubectl(
        "apply",
        "--dry-run=server",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
        check=False,
    )
    accepted = {line.split("/")[1].split()[0] for line in result.stdout.splitlines() if "created" in line}
    assert len(expected) == 7 * 4 * 6 and sum(expected.values()) == len(accepted) > 0  # 6 GPU classes + cpu
    assert {n for n, ok in expected.items() if ok} == accepted


def _refused(kube, namespace: str, manifest: dict) -> str:
    result = kube.apply(manifest, namespace=namespace, check=False)
    assert result.returncode != 0, f"{manifest['metadata']['name']} update was accepted"
    return result.stderr


def test_accelerator_of_a_running_trainer_or_group_cannot_change(kube, crds, namespace: str) -> None:
    """CEL transition rules: moving the trainer or a group to other GPUs would restart its pods mid-run;
    refused unless the same change suspends the job (or the group is replaced under a new name)."""
    from rlfleet.api.rljob import GROUP_ACCELERATOR_MESSAGE, TRAINER_ACCELERATOR_MESSAGE

    job = apply_case(EXAMPLE, {"set": {"metadata.name": "moving"}})
    kube.apply(job, namespace=namespace)
    assert TRAINER_ACCELERATOR_MESSAGE in _refused(
        kube, namespace, apply_case(job, {"set": {"spec.trainer.accelerator": "h200"}})
    )
    assert GROUP_ACCELERATOR_MESSAGE in _refused(
        kube, namespace, apply_case(job, {"set": {"spec.samplerGroups.2.accelerator": "h200"}})
    )
    # a new group under a new name replaces the old one: accepted
    renamed = apply_case(
        job, {"set": {"spec.samplerGroups.2.name": "h200-fp8-b", "spec.samplerGroups.2.accelerator": "h200"}}
    )
    kube.apply(renamed, namespace=namespace)
    # suspending in the same change: accepted, and the object holds the new class
    moved = apply_case(renamed, {"set": {"spec.suspend": True, "spec.trainer.accelerator": "b300"}})
    kube.apply(moved, namespace=namespace)
    assert kube.get_json("rljob", "moving", "-n", namespace)["spec"]["trainer"]["accelerator"] == "b300"


def test_samplergroup_names_ports_and_moves_are_refused(kube, crds, namespace: str) -> None:
    from rlfleet.api.samplergroup import ACCELERATOR_CHANGE_MESSAGE, PORT_MESSAGE, SG_NAME_MESSAGE

    sg = samplergroup()  # solo-h100
    assert SG_NAME_MESSAGE in _refused(kube, namespace, {**sg, "metadata": {"name": "solo.h100"}})
    assert PORT_MESSAGE in _refused(kube, namespace, {**sg, "spec": {**sg["spec"], "port": 9400}})
    kube.apply(sg, namespace=namespace)
    assert ACCELERATOR_CHANGE_MESSAGE in _refused(
        kube, namespace, {**sg, "spec": {**sg["spec"], "accelerator": "h200"}}
    )
    kube.apply({**sg, "spec": {**sg["spec"], "accelerator": "h200", "suspend": True}}, namespace=namespace)
