"""Pure builders of the closed engine API (issue 32): the job's key Secret, every pod reading it by
secretKeyRef (never a value), the router's config naming it, and the NetworkPolicies among the job's
children whose selectors pick exactly the pods the workloads build."""

from __future__ import annotations

import json

import pytest
import yaml
from test_operator_builders import (  # noqa: F401
    CATALOG,
    NS,
    OWNER,
    OWNER_REFERENCES,
    children,
    job,
    sampler_deployment,
)

from rlfleet.api import RLJob, SamplerGroup
from rlfleet.operator import builders, tokens, workloads
from rlfleet.operator import naming as n
from rlfleet.operator.network_policies import NetworkPolicySettings, build_network_policies, settings_from_env
from rlfleet.router.config import RouterConfig

KEY_REF = {
    "name": "RLFLEET_API_KEY",
    "valueFrom": {"secretKeyRef": {"name": "reference-fleet-api-key", "key": "key"}},
}
OPERATOR = NetworkPolicySettings(
    "rlfleet-system", {"app.kubernetes.io/name": "rlfleet", "app.kubernetes.io/instance": "r"}
)


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_the_key_secret_is_the_jobs_own_and_random(job: RLJob) -> None:  # noqa: F811
    key = tokens.new_api_key()
    # 32 random bytes, URL-safe: it is expanded into the engines' argv, also inside the launch script's quotes
    assert (
        len(key) == 43
        and key != tokens.new_api_key()
        and set(key) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    )
    secret = builders.build_job_api_key_secret(job, NS, OWNER, key)
    assert secret == {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": "reference-fleet-api-key",
            "namespace": NS,
            "labels": n.job_labels("reference-fleet", "api-key"),
            "ownerReferences": OWNER_REFERENCES,
        },
        "type": "Opaque",
        "stringData": {"key": key},
    }


def test_every_pod_reads_the_key_by_reference_and_none_holds_a_value(job: RLJob) -> None:  # noqa: F811
    out = children(job)
    trainer = out[("StatefulSet", "reference-fleet-trainer")]["spec"]["template"]["spec"]
    router = out[("Deployment", "reference-fleet-router")]["spec"]["template"]["spec"]
    assert env_of(trainer["containers"][0])["RLFLEET_API_KEY"] == KEY_REF
    assert env_of(router["containers"][0])["RLFLEET_API_KEY"] == KEY_REF
    pod = sampler_deployment(job, "h100-fp8")["spec"]["template"]["spec"]
    for container in [*pod["initContainers"], *pod["containers"]]:  # weight-fetch, sglang, weight-sync
        assert env_of(container)["RLFLEET_API_KEY"] == KEY_REF, container["name"]
    engine = pod["containers"][0]
    assert engine["name"] == "sglang" and "--api-key '$(RLFLEET_API_KEY)'" in engine["args"][0]
    # probes and Prometheus stay on the open paths
    assert {engine[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} <= {
        "/health",
        "/health_generate",
    }
    # no child carries a key: only references
    assert "stringData" not in json.dumps(list(out.values()))


def test_a_group_outside_any_job_has_its_own_key_secret(job: RLJob) -> None:  # noqa: F811
    manifest = children(job)[("SamplerGroup", "reference-fleet-a100-bf16")]
    manifest["spec"].pop("jobName")
    manifest["metadata"]["name"] = "solo"
    sg = SamplerGroup.from_manifest(manifest)
    owner = {
        "apiVersion": "rlfleet.dev/v1alpha1",
        "kind": "SamplerGroup",
        "metadata": {"name": "solo", "uid": "s"},
    }
    secret = builders.build_group_api_key_secret(sg, NS, owner, "k")
    assert (secret["metadata"]["name"], secret["metadata"]["ownerReferences"][0]["uid"]) == (
        "solo-api-key",
        "s",
    )
    pod = workloads.build_sampler_deployment(sg, NS, owner, CATALOG, None)["spec"]["template"]["spec"]
    assert env_of(pod["containers"][0])["RLFLEET_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "solo-api-key",
        "key": "key",
    }
    assert pod["containers"][0]["args"][-2:] == [
        "--api-key",
        "$(RLFLEET_API_KEY)",
    ]  # a fixed checkpoint, no sh


def test_the_router_requires_and_presents_the_key_from_its_env(job: RLJob) -> None:  # noqa: F811
    raw = children(job)[("ConfigMap", "reference-fleet-config")]["data"][n.ROUTER_CONFIG_FILE]
    config = RouterConfig.model_validate(yaml.safe_load(raw))
    assert config.api_key_env == "RLFLEET_API_KEY" and config.api_key_file is None


# --- NetworkPolicies ----------------------------------------------------------------------------------


def test_settings_from_the_environment() -> None:
    assert settings_from_env({}) == NetworkPolicySettings()
    for off in ("false", "0", "off", "No"):
        assert settings_from_env({"RLFLEET_NETWORK_POLICIES": off}) is None
    settings = settings_from_env(
        {
            "POD_NAMESPACE": "ops",
            "RLFLEET_OPERATOR_POD_LABELS": "a=1, b=2",
            "RLFLEET_METRICS_FROM": '[{"namespaceSelector": {"matchLabels": {"m": "x"}}}]',
        }
    )
    assert settings == NetworkPolicySettings(
        "ops", {"a": "1", "b": "2"}, ({"namespaceSelector": {"matchLabels": {"m": "x"}}},)
    )
    assert settings_from_env({"RLFLEET_METRICS_FROM": "[]"}) == NetworkPolicySettings(metrics_from=())


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"RLFLEET_OPERATOR_POD_LABELS": "a"},
            "RLFLEET_OPERATOR_POD_LABELS: expected key=value[,key=value...], got 'a'",
        ),
        ({"RLFLEET_METRICS_FROM": "[{"}, "RLFLEET_METRICS_FROM: not JSON"),
        (
            {"RLFLEET_METRICS_FROM": '{"a": 1}'},
            "RLFLEET_METRICS_FROM: expected a JSON list of NetworkPolicyPeers",
        ),
    ],
)
def test_bad_settings_are_one_clear_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(
        ValueError, match="^" + message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")
    ):
        settings_from_env(env)


def job_pods(component: str) -> dict:
    """The label selector of the reference job's `component` pods."""
    return {"matchLabels": {"rlfleet.dev/job": "reference-fleet", "app.kubernetes.io/component": component}}


def test_the_policies_of_a_job(job: RLJob) -> None:  # noqa: F811
    samplers, router = build_network_policies(job, NS, OWNER, OPERATOR)
    operator_peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rlfleet-system"}},
        "podSelector": {
            "matchLabels": {"app.kubernetes.io/name": "rlfleet", "app.kubernetes.io/instance": "r"}
        },
    }
    prometheus = {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }

    def ingress(component: str, caller: str, port: int, *more: dict) -> dict:
        """A policy's spec: `component`'s pods take `caller`'s pods and the operator on `port`, Prometheus's
        scrapes there, then `more` rules."""
        tcp = [{"protocol": "TCP", "port": port}]
        return {
            "podSelector": job_pods(component),
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": job_pods(caller)}, operator_peer], "ports": tcp},
                {"from": [prometheus], "ports": tcp},
                *more,
            ],
        }

    assert samplers["metadata"]["name"] == "reference-fleet-samplers"
    assert samplers["spec"] == ingress(
        "sampler", "router", 30000, {"ports": [{"protocol": "TCP", "port": 9400}]}
    )
    assert router["metadata"]["name"] == "reference-fleet-router"
    assert router["spec"] == ingress("router", "trainer", 8000)
    for policy in (samplers, router):
        assert policy["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    # without the operator's identity (run outside the cluster) and without scrapers: only the job's pods
    bare = build_network_policies(job, NS, OWNER, NetworkPolicySettings(metrics_from=()))
    assert [[rule.get("from") for rule in p["spec"]["ingress"]] for p in bare] == [
        [[samplers["spec"]["ingress"][0]["from"][0]], None],
        [[router["spec"]["ingress"][0]["from"][0]]],
    ]
    assert build_network_policies(job, NS, OWNER, None) == []


def test_the_selectors_pick_the_pods_the_workloads_build(job: RLJob) -> None:  # noqa: F811
    """Each policy selects exactly its component's pods, and its peers are the pods of the job that call it
    (a label renamed in one place would silently open or close a port)."""
    out = builders.build_job_children(job, NS, OWNER, CATALOG, None, OPERATOR)
    by_key = {(c["kind"], c["metadata"]["name"]): c for c in out}
    labels = {
        "trainer": by_key[("StatefulSet", "reference-fleet-trainer")]["spec"]["template"]["metadata"][
            "labels"
        ],
        "router": by_key[("Deployment", "reference-fleet-router")]["spec"]["template"]["metadata"]["labels"],
        "sampler": sampler_deployment(job, "b200-nvfp4")["spec"]["template"]["metadata"]["labels"],
    }

    def picks(selector: dict) -> set[str]:
        return {c for c, pod in labels.items() if selector["matchLabels"].items() <= pod.items()}

    samplers, router = (
        by_key[("NetworkPolicy", "reference-fleet-samplers")],
        by_key[("NetworkPolicy", "reference-fleet-router")],
    )
    assert picks(samplers["spec"]["podSelector"]) == {"sampler"}
    assert picks(router["spec"]["podSelector"]) == {"router"}
    assert picks(samplers["spec"]["ingress"][0]["from"][0]["podSelector"]) == {"router"}
    assert picks(router["spec"]["ingress"][0]["from"][0]["podSelector"]) == {"trainer"}
    # the ports are the ones the containers listen on
    engine_port = sampler_deployment(job, "b200-nvfp4")["spec"]["template"]["spec"]["containers"][0]["ports"][
        0
    ]
    router_port = by_key[("Deployment", "reference-fleet-router")]["spec"]["template"]["spec"]["containers"][
        0
    ]["ports"][0]
    assert samplers["spec"]["ingress"][0]["ports"][0]["port"] == engine_port["containerPort"]
    assert router["spec"]["ingress"][0]["ports"][0]["port"] == router_port["containerPort"]
    # the policies come first: no pod starts before its policy
    assert [c["kind"] for c in out[:2]] == ["NetworkPolicy", "NetworkPolicy"]
    assert "NetworkPolicy" not in {c["kind"] for c in builders.build_job_children(job, NS, OWNER, CATALOG)}
