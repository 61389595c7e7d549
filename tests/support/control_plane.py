"""rlfleet on the test control plane (the `kube` and `namespace` fixtures, tests/conftest.py): what the
cluster tests set up alike, before each test's own objects."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from kopf.testing import KopfRunner

from support import manifests

REPO = Path(__file__).resolve().parents[2]
# two sampler groups of other classes and weight formats: what the rebalancer and the optimizer choose between
B200_NVFP4_AND_A100_BF16 = (
    {"name": "b200-nvfp4", "accelerator": "b200", "replicas": 1, "weightFormat": "nvfp4"},
    {"name": "a100-bf16", "accelerator": "a100", "replicas": 1, "weightFormat": "bf16"},
)


def install_crds(kube: Any) -> None:
    """rlfleet's CRDs (crds/) applied server-side, and Established: RLJobs, SamplerGroups and
    WeightChannels can be created once it returns. Idempotent: every test module may call it."""
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    for name in ("rljobs", "samplergroups", "weightchannels"):
        kube.kubectl("wait", "--for=condition=Established", f"crd/{name}.rlfleet.dev", "--timeout=60s")


@contextmanager
def operator_in_process(kube: Any, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[KopfRunner]:
    """The operator's handlers run by kopf in this process (KopfRunner) against the control plane (KUBECONFIG
    set for the test), on `namespace` only. When the block ends without an error, the operator stopped
    without an exception and logged no traceback."""
    monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig))
    with KopfRunner(
        ["run", "--standalone", "--namespace", namespace, "-m", "rlfleet.operator.handlers"], timeout=60
    ) as runner:
        yield runner
    assert runner.exception is None, runner.output
    assert "Traceback" not in runner.output, runner.output


def get(kube: Any, namespace: str, *what: str) -> Any:
    """`kubectl get <what> -n <namespace> -o json`, parsed; None when kubectl fails (not there yet, or gone)."""
    result = kube.kubectl("get", *what, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def rljob(name: str, sampler_groups: Any = B200_NVFP4_AND_A100_BF16, **spec: Any) -> dict[str, Any]:
    """An RLJob of Qwen3-8B trained on one 8-GPU b200 replica, its channel on the filesystem at
    /weights/<name> (a path of the pods: kwok's pods never read it); `spec` adds or replaces fields."""
    return manifests.rljob(
        name,
        sampler_groups,
        **{
            "model": {"name": "qwen3-8b", "path": "Qwen/Qwen3-8B"},
            "trainer": {"accelerator": "b200", "replicas": 1, "gpusPerReplica": 8},
            "weightChannel": {"store": {"type": "filesystem", "path": f"/weights/{name}"}},
        }
        | spec,
    )


def optimized_rljob(
    name: str, prometheus_url: str, demand: float, max_replicas: dict[str, int], **optimize: Any
) -> dict[str, Any]:
    """`rljob(name)` with the fleet-mix optimizer on (spec.router.optimize): every 5 s it plans for `demand`
    usable tokens/s, each group between 0 and its `max_replicas`, from the groups' throughput at
    `prometheus_url` (kwok's pods make none) against a reference fleet of 2500 tok/s per GPU; `optimize`
    adds fields."""
    return rljob(
        name,
        router={
            "rebalanceIntervalSeconds": 5,
            "prometheusUrl": prometheus_url,
            "reference": {"tokensPerGpuSecond": 2500},
            "optimize": {
                "enabled": True,
                "demand": {"usableTokensPerSecond": demand},
                "groups": {group: {"maxReplicas": most} for group, most in max_replicas.items()},
                **optimize,
            },
        },
    )


def events(kube: Any, namespace: str, reason: str) -> list[dict[str, Any]]:
    """The namespace's Events of `reason`."""
    return [e for e in kube.get_json("events", "-n", namespace)["items"] if e.get("reason") == reason]


# the catalog's GKE spot label and taint (rlfleet/catalog/classes.py)
SPOT_LABEL = "cloud.google.com/gke-spot"
SPOT_TAINT = {"key": SPOT_LABEL, "value": "true", "effect": "NoSchedule"}


def spot_h100_node(name: str) -> dict[str, Any]:
    """A kwok node of 8 H100s (GPU Feature Discovery's product label, the GPU taint) that is a GKE spot node:
    labelled and tainted so, as the test control plane's own nodes are not (tests/cluster/controlplane.py)."""
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"}
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        SPOT_LABEL: "true",
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {
            "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}, SPOT_TAINT]
        },
        "status": {"allocatable": resources, "capacity": resources},
    }


def bind_claim(kube: Any, namespace: str, claim: str, host_path: Path, access_mode: str, size: str) -> str:
    """A PersistentVolume on `host_path` of this machine, statically bound to the claim `claim` of
    `namespace` (the test control plane has no provisioner; kwok never mounts it); returns its name."""
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"{claim}-{namespace}"},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": [access_mode],
            "storageClassName": "",
            "hostPath": {"path": str(host_path)},
            "claimRef": {"namespace": namespace, "name": claim},
        },
    }
    kube.kubectl("apply", "-f", "-", input=json.dumps(pv))
    return pv["metadata"]["name"]


@contextmanager
def fresh_namespace(kube: Any, prefix: str, ready_s: int = 30) -> Iterator[str]:
    """A new namespace `<prefix>-<random>`, yielded once its default ServiceAccount exists (the
    kube-controller-manager makes it; pods need it); deleted (without waiting) when the block ends."""
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    kube.kubectl("create", "namespace", name)
    try:
        kube.kubectl("wait", "--for=create", "serviceaccount/default", "-n", name, f"--timeout={ready_s}s")
        yield name
    finally:
        kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


# The chart's grants for the operator's sandbox children of a job (tests/ship/test_ship_chart.py pins them),
# besides `bind` on the sandbox role (`bind_rule`).
SANDBOX_CHILD_GRANTS = [
    {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["create", "patch"]},
    {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["rolebindings"], "verbs": ["create", "patch"]},
]


def bind_rule(role: str) -> dict[str, Any]:
    """`bind` on the Role `role`: what lets an account create a RoleBinding to it without holding its rights."""
    return {
        "apiGroups": ["rbac.authorization.k8s.io"],
        "resources": ["roles"],
        "verbs": ["bind"],
        "resourceNames": [role],
    }


def account_env(
    kube: Any, namespace: str, name: str, rules: list[dict[str, Any]], directory: Path
) -> dict[str, str]:
    """A ServiceAccount `name` of `namespace` holding a Role of `rules` (its own name): the environment in
    which kubectl acts as it (a kubeconfig of its token, written in `directory`)."""
    account = {"kind": "ServiceAccount", "name": name, "namespace": namespace}
    objects = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
        *manifests.role_and_binding(name, rules, account),
    ]
    kube.kubectl("apply", "-n", namespace, "-f", "-", input="\n---\n".join(json.dumps(o) for o in objects))
    token = kube.kubectl("create", "token", name, "-n", namespace, "--duration=1h").stdout.strip()
    return {**kube.env(), "KUBECONFIG": str(kube.token_kubeconfig(token, directory / f"{name}.kubeconfig"))}


def applies_children_by_bind_alone(
    kube: Any, namespace: str, children: list[dict[str, Any]], role: str, directory: Path
) -> dict[str, str]:
    """The operator's sandbox `children` (its ServiceAccount and RoleBinding to the sandbox Role `role`) as
    the operator applies them (server-side apply, its field manager), by an account holding none of the
    role's rights: with the chart's grants but no `bind` on the role the API server refuses the RoleBinding
    (it would grant rights the account does not hold); with `bind` as well they apply. Returns that second
    account's kubectl environment."""

    def apply_as(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                str(kube.kubectl_bin),
                "apply",
                "--server-side",
                "--field-manager=rlfleet-operator",
                "-n",
                namespace,
                "-f",
                "-",
            ],
            input="\n---\n".join(json.dumps(o) for o in children),
            env=env,
            text=True,
            capture_output=True,
            timeout=60,
        )

    refused = apply_as(account_env(kube, namespace, "op-without-bind", SANDBOX_CHILD_GRANTS, directory))
    assert refused.returncode != 0, refused.stdout
    assert "attempting to grant RBAC permissions not currently held" in refused.stderr, refused.stderr
    operator = account_env(kube, namespace, "op", [*SANDBOX_CHILD_GRANTS, bind_rule(role)], directory)
    applied = apply_as(operator)
    assert applied.returncode == 0, applied.stderr
    return operator


def role_grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    """What a Role's or ClusterRole's rules grant, one (API group, resource, verb) each."""
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
