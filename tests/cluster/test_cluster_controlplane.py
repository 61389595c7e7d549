"""Proof that the `kube` fixture is a real control plane: each test needs a component that only a real
kube-apiserver / kube-scheduler / kube-controller-manager / kwok provides, and fails without it."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from typing import Any

import pytest
import yaml
from support.waits import wait_for

pytestmark = pytest.mark.cluster

H100_PRODUCT = "NVIDIA-H100-80GB-HBM3"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def gpu_pod_template(app: str, gpus: int, product: str) -> dict[str, Any]:
    return {
        "metadata": {"labels": {"app": app}},
        "spec": {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "nvidia.com/gpu.product", "operator": "In", "values": [product]}
                                ]
                            }
                        ]
                    }
                }
            },
            "tolerations": [GPU_TOLERATION],
            "containers": [
                {
                    "name": "main",
                    "image": "registry.invalid/sampler:test",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ],
        },
    }


def deployment(name: str, replicas: int, gpus: int, product: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": gpu_pod_template(name, gpus, product),
        },
    }


def test_versions_are_the_pinned_release(kube) -> None:
    versions = json.loads(kube.kubectl("version", "-o", "json").stdout)
    assert versions["clientVersion"]["gitVersion"] == "v1.36.3"
    assert versions["serverVersion"]["gitVersion"] == "v1.36.3"
    # env(): our kubectl first on PATH, KUBECONFIG pointing at this control plane
    env = kube.env()
    assert shutil.which("kubectl", path=env["PATH"]) == str(kube.bin_dir / "kubectl")
    out = subprocess.run(
        ["kubectl", "get", "--raw", "/version"], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout)["gitVersion"] == "v1.36.3"


def test_api_client_talks_to_the_control_plane(kube) -> None:
    from kubernetes import client

    with kube.api_client() as api:
        names = {n.metadata.name for n in client.CoreV1Api(api).list_node().items}
    assert set(kube.cpu_nodes) | set(kube.gpu_nodes["h100"]) <= names
    assert api.configuration.host == kube.server


def test_fake_gpu_nodes_are_ready_labelled_and_tainted(kube) -> None:
    nodes = {n["metadata"]["name"]: n for n in kube.get_json("nodes")["items"]}
    expected = [name for names in kube.gpu_nodes.values() for name in names] + kube.cpu_nodes
    assert sorted(nodes) == sorted(expected)
    assert set(kube.gpu_nodes) == {"a100", "h100", "h200", "b200", "b300", "rtx-pro-6000"}
    for name, node in nodes.items():
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True", name
    for name in kube.gpu_nodes["b300"]:
        labels = nodes[name]["metadata"]["labels"]
        assert labels["nvidia.com/gpu.product"] == "NVIDIA-B300-SXM6-AC"
        assert (labels["nvidia.com/gpu.compute.major"], labels["nvidia.com/gpu.compute.minor"]) == ("10", "3")
        assert labels["nvidia.com/gpu.family"] == "blackwell"
        assert nodes[name]["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in nodes[name]["spec"][
            "taints"
        ]
    for name in kube.cpu_nodes:
        assert "nvidia.com/gpu" not in nodes[name]["status"]["allocatable"]


def test_node_leases_are_renewed(kube) -> None:
    """kwok heartbeats: a node's Lease renewTime moves forward (else nodes go NotReady after ~50 s)."""
    node = kube.gpu_nodes["h100"][0]

    def renew_time() -> str:
        return kube.get_json("lease", node, "-n", "kube-node-lease")["spec"]["renewTime"]

    first = wait_for(
        "the node lease",
        lambda: (
            kube.kubectl("get", "lease", node, "-n", "kube-node-lease", check=False).returncode == 0
            and renew_time()
        ),
    )
    wait_for("a lease renewal", lambda: renew_time() != first, timeout=45, interval=1)


def test_h100_affinity_binds_only_to_h100_nodes_and_pods_run(kube, namespace) -> None:
    manifest = deployment("sampler-h100", replicas=3, gpus=4, product=H100_PRODUCT)
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))
    kube.kubectl("rollout", "status", "deployment/sampler-h100", "-n", namespace, "--timeout=90s")
    pods = kube.get_json("pods", "-n", namespace, "-l", "app=sampler-h100")["items"]
    assert len(pods) == 3
    for pod in pods:
        assert pod["spec"]["nodeName"] in kube.gpu_nodes["h100"]
        assert pod["status"]["phase"] == "Running"
        assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "True"
    # 3 pods x 4 GPUs on 2 nodes x 8 GPUs: the scheduler must have spread them over both nodes
    assert {p["spec"]["nodeName"] for p in pods} == set(kube.gpu_nodes["h100"])


def test_more_gpus_than_exist_stay_pending_with_a_scheduler_event(kube, namespace) -> None:
    manifest = deployment("too-big", replicas=1, gpus=9, product=H100_PRODUCT)  # nodes have 8
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))

    def failed_scheduling() -> list[dict]:
        events = kube.get_json("events", "-n", namespace, "--field-selector", "reason=FailedScheduling")[
            "items"
        ]
        return [e for e in events if e["involvedObject"]["kind"] == "Pod"]

    events = wait_for("a FailedScheduling event", failed_scheduling, timeout=60)
    assert "Insufficient nvidia.com/gpu" in events[0]["message"]
    pods = kube.get_json("pods", "-n", namespace, "-l", "app=too-big")["items"]
    assert len(pods) == 1
    assert pods[0]["status"]["phase"] == "Pending"
    assert not pods[0]["spec"].get("nodeName")


WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.controlplane-test.rlfleet.dev"},
    "spec": {
        "group": "controlplane-test.rlfleet.dev",
        "names": {"kind": "Widget", "plural": "widgets", "singular": "widget", "listKind": "WidgetList"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "x-kubernetes-validations": [
                                    {
                                        "rule": "self.minReplicas <= self.maxReplicas",
                                        "message": "minReplicas must not exceed maxReplicas",
                                    }
                                ],
                                "properties": {
                                    "minReplicas": {"type": "integer", "default": 1},
                                    "maxReplicas": {"type": "integer", "default": 4},
                                    "format": {"type": "string", "default": "bf16"},
                                },
                            },
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}


@pytest.fixture
def widget_crd(kube):
    kube.kubectl("apply", "-f", "-", input=json.dumps(WIDGET_CRD))
    name = WIDGET_CRD["metadata"]["name"]
    kube.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=30s")
    yield name
    kube.kubectl("delete", "crd", name, "--wait=false", check=False)


def widget(name: str, spec: dict[str, Any]) -> str:
    return json.dumps(
        {
            "apiVersion": "controlplane-test.rlfleet.dev/v1",
            "kind": "Widget",
            "metadata": {"name": name},
            "spec": spec,
        }
    )


def test_crd_cel_rule_defaults_and_pruning(kube, namespace, widget_crd) -> None:
    # Discovery can lag Established by a moment: retry the first create until the kind is known.
    bad = wait_for(
        "the Widget kind to be served",
        lambda: (
            (
                r := kube.kubectl(
                    "create",
                    "-n",
                    namespace,
                    "-f",
                    "-",
                    check=False,
                    input=widget("bad", {"minReplicas": 5, "maxReplicas": 2}),
                )
            )
            and "the server doesn't have a resource type" not in r.stderr
            and "no matches for kind" not in r.stderr
            and r
        ),
        timeout=30,
    )
    assert bad.returncode != 0
    assert "minReplicas must not exceed maxReplicas" in bad.stderr

    unknown = widget("good", {"maxReplicas": 3, "bogus": "x"})
    strict = kube.kubectl("create", "-n", namespace, "-f", "-", input=unknown, check=False)
    assert strict.returncode != 0 and 'unknown field "spec.bogus"' in strict.stderr  # kubectl's default
    kube.kubectl("create", "--validate=ignore", "-n", namespace, "-f", "-", input=unknown)
    stored = kube.get_json("widgets.controlplane-test.rlfleet.dev", "good", "-n", namespace)
    assert stored["spec"] == {"minReplicas": 1, "maxReplicas": 3, "format": "bf16"}  # defaulted, pruned


def test_deleting_an_owner_garbage_collects_its_children(kube, namespace) -> None:
    kube.kubectl("create", "configmap", "owner", "-n", namespace)
    owner_uid = kube.get_json("configmap", "owner", "-n", namespace)["metadata"]["uid"]
    for name, owners in (
        ("child", [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}]),
        ("orphan", []),
    ):
        manifest = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "ownerReferences": owners},
        }
        kube.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest))
    kube.kubectl("delete", "configmap", "owner", "-n", namespace)

    def child_gone() -> bool:
        return kube.kubectl("get", "configmap", "child", "-n", namespace, check=False).returncode != 0

    wait_for("the garbage collector to delete the child", child_gone, timeout=60)
    kube.kubectl("get", "configmap", "orphan", "-n", namespace)  # unowned objects stay


def test_server_side_apply_twice_changes_nothing(kube, namespace) -> None:
    manifests = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa-config"}, "data": {"a": "1"}},
        deployment("ssa-deploy", replicas=1, gpus=1, product=H100_PRODUCT),
    ]
    text = yaml.safe_dump_all(manifests)
    args = ("apply", "--server-side", "--field-manager=rlfleet-test", "-n", namespace, "-f", "-")
    kube.kubectl(*args, input=text)

    def snapshot() -> dict[str, tuple[str, str]]:
        objs = kube.get_json(
            "configmap/ssa-config", "deployment/ssa-deploy", "-n", namespace, "--show-managed-fields"
        )["items"]
        return {
            o["kind"]: (o["metadata"]["resourceVersion"], json.dumps(o["metadata"]["managedFields"]))
            for o in objs
        }

    # let the deployment controller finish writing status (its own field manager) before comparing
    kube.kubectl("rollout", "status", "deployment/ssa-deploy", "-n", namespace, "--timeout=60s")
    before = snapshot()
    kube.kubectl(*args, input=text)
    assert snapshot() == before
    diff = kube.kubectl(
        "diff",
        "--server-side",
        "--field-manager=rlfleet-test",
        "-n",
        namespace,
        "-f",
        "-",
        input=text,
        check=False,
    )
    assert diff.returncode == 0, diff.stdout + diff.stderr
    managers = {m["manager"] for m in json.loads(before["ConfigMap"][1])}
    assert "rlfleet-test" in managers


def test_service_account_tokens_and_root_ca(kube, namespace, tmp_path) -> None:
    """What the operator's RBAC tests need: TokenRequest works and the token authenticates."""
    kube.kubectl("create", "serviceaccount", "operator", "-n", namespace)
    token = kube.kubectl("create", "token", "operator", "-n", namespace, "--duration=10m").stdout.strip()
    payload = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))
    assert payload["sub"] == f"system:serviceaccount:{namespace}:operator"
    as_sa = kube.token_kubeconfig(token, tmp_path / "sa.kubeconfig")
    whoami = kube.kubectl("auth", "whoami", "-o", "json", f"--kubeconfig={as_sa}")
    assert json.loads(whoami.stdout)["status"]["userInfo"]["username"] == payload["sub"]
    # RBAC holds for the token: a fresh ServiceAccount may not list pods
    denied = kube.kubectl("get", "pods", "-n", namespace, f"--kubeconfig={as_sa}", check=False)
    assert denied.returncode != 0 and "Forbidden" in denied.stderr
    root_ca = wait_for(
        "kube-root-ca.crt",
        lambda: (
            kube.kubectl("get", "configmap", "kube-root-ca.crt", "-n", namespace, check=False).returncode == 0
        ),
    )
    assert root_ca


def test_warm_start_time_is_reported(kube) -> None:
    """Measured, printed, not asserted on wall time (docs/testing.md records the numbers)."""
    print(f"\n[controlplane] fixture start took {kube.start_seconds:.1f}s", file=sys.stderr)
    assert kube.start_seconds > 0
