"""The closed engine API on the real control plane (etcd + kube-apiserver + controllers + kwok): the
operator creates the job's key Secret and its NetworkPolicies, owned by the RLJob (the API server
accepts what the builders write), every pod of the job takes the key by secretKeyRef and none carries
it, and a later reconcile never rotates it. kwok runs no CNI: whether the policies are enforced is the
cluster's CNI's business (docs/install.md, "Network policies")."""

from __future__ import annotations

import base64
import json

import pytest
from support.control_plane import get, operator_in_process
from support.waits import wait_for
from test_operator_cluster import JOB, apply_example, items, shared_volume

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

OPERATOR_LABELS = {"app.kubernetes.io/name": "rlfleet", "app.kubernetes.io/instance": "r"}


def test_the_key_secret_and_policies_are_owned_and_every_pod_references_the_key(
    kube, crds, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as the chart's operator is told who it is (templates/deployment.yaml)
    monkeypatch.setenv("POD_NAMESPACE", "rlfleet-system")
    monkeypatch.setenv(
        "RLFLEET_OPERATOR_POD_LABELS", ",".join(f"{k}={v}" for k, v in OPERATOR_LABELS.items())
    )
    with operator_in_process(kube, namespace, monkeypatch):
        shared_volume(kube, namespace)
        apply_example(kube, namespace)
        job = wait_for("the RLJob", lambda: get(kube, namespace, "rljob", JOB), 60)
        owner = {
            "apiVersion": "rlfleet.dev/v1alpha1",
            "kind": "RLJob",
            "name": JOB,
            "uid": job["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        secret = wait_for("the key Secret", lambda: get(kube, namespace, "secret", f"{JOB}-api-key"), 60)
        assert secret["metadata"]["ownerReferences"] == [owner]
        key = base64.b64decode(secret["data"]["key"]).decode()
        assert len(key) == 43

        policies = wait_for(
            "the NetworkPolicies",
            lambda: (p := items(kube, namespace, "networkpolicies")) and len(p) == 2 and p,
            60,
        )
        by_name = {p["metadata"]["name"]: p for p in policies}
        assert sorted(by_name) == [f"{JOB}-router", f"{JOB}-samplers"]
        for policy in policies:
            assert policy["metadata"]["ownerReferences"] == [owner]
            assert policy["spec"]["policyTypes"] == ["Ingress"]
        samplers = by_name[f"{JOB}-samplers"]["spec"]
        assert samplers["podSelector"] == {
            "matchLabels": {"app.kubernetes.io/component": "sampler", "rlfleet.dev/job": JOB}
        }
        (router_peer, operator_peer) = samplers["ingress"][0]["from"]
        assert router_peer == {
            "podSelector": {"matchLabels": {"app.kubernetes.io/component": "router", "rlfleet.dev/job": JOB}}
        }
        assert operator_peer == {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rlfleet-system"}},
            "podSelector": {"matchLabels": OPERATOR_LABELS},
        }
        assert samplers["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 30000}]
        router = by_name[f"{JOB}-router"]["spec"]
        assert router["ingress"][0]["from"][0] == {
            "podSelector": {"matchLabels": {"app.kubernetes.io/component": "trainer", "rlfleet.dev/job": JOB}}
        }

        # every pod of the job: the key by reference in each container, its value nowhere in the pod
        def pods() -> list[dict] | None:
            found = items(kube, namespace, "pods")
            components = {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in found}
            return found if components == {"sampler", "router", "trainer"} else None

        for pod in wait_for("sampler, router and trainer pods", pods, 90):
            spec = pod["spec"]
            for container in [*spec.get("initContainers", []), *spec["containers"]]:
                env = {e["name"]: e for e in container.get("env", [])}
                assert env["RLFLEET_API_KEY"] == {
                    "name": "RLFLEET_API_KEY",
                    "valueFrom": {"secretKeyRef": {"name": f"{JOB}-api-key", "key": "key"}},
                }, (pod["metadata"]["name"], container["name"])
            assert key not in json.dumps(pod), pod["metadata"]["name"]

        # a reconcile (a spec change) never rotates the key
        kube.kubectl(
            "patch", "rljob", JOB, "-n", namespace, "--type=merge", "-p", '{"spec": {"suspend": true}}'
        )
        wait_for(
            "the suspended groups",
            lambda: all(sg["spec"]["suspend"] for sg in items(kube, namespace, "samplergroups")),
            60,
        )
        again = get(kube, namespace, "secret", f"{JOB}-api-key")
        assert again["data"] == secret["data"]
        assert again["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]
