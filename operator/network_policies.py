"""PURE NetworkPolicies among a job's children (docs/install.md, "Network policies").

The engines' API is closed by the job's key (`--api-key`); these policies close the ports too, for
clusters whose CNI enforces NetworkPolicy (Calico, Cilium, kube-router, ...; a plain bridge CNI does not):
- `<job>-samplers`: a sampler pod's engine port only from the job's router pods and the operator's pods
  (the router's traffic, the operator's /metrics scrape), plus the metrics scrapers (`metrics_from`,
  Prometheus; the engine serves /metrics on its API port); the sidecar's port (/metrics /status /health,
  read-only) from anywhere. The sidecar reaches its engine over the pod's loopback, which no policy
  filters, and the kubelet's probes come from the node;
- `<job>-router`: the router's port only from the job's trainer pods, the operator's pods (the
  rebalancer's admin API) and the metrics scrapers.

`settings_from_env` reads the operator's settings once (the chart sets them: networkPolicy.*); `None`
turns the policies off.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlfleet.api import RLJob
from rlfleet.operator import naming as n

Manifest = dict[str, Any]

ENABLED_ENV = "RLFLEET_NETWORK_POLICIES"
OPERATOR_LABELS_ENV = "RLFLEET_OPERATOR_POD_LABELS"
METRICS_FROM_ENV = "RLFLEET_METRICS_FROM"
NAMESPACE_ENV = "POD_NAMESPACE"
# kube-prometheus-stack's and the Prometheus operator's pods carry this label, in any namespace
DEFAULT_METRICS_FROM: tuple[Manifest, ...] = (
    {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
)
OFF_VALUES = frozenset({"0", "false", "off", "no"})


@dataclass(frozen=True)
class NetworkPolicySettings:
    operator_namespace: str | None = None
    """The operator's namespace (its pods are let in when this and the labels are known)."""
    operator_pod_labels: Mapping[str, str] = field(default_factory=dict)
    metrics_from: tuple[Manifest, ...] = DEFAULT_METRICS_FROM
    """NetworkPolicyPeers that scrape /metrics on the engines' and the router's ports."""


def settings_from_env(environ: Mapping[str, str] | None = None) -> NetworkPolicySettings | None:
    """The operator's settings (None: policies off); ValueError naming the variable on bad input."""
    env = os.environ if environ is None else environ
    if env.get(ENABLED_ENV, "true").strip().lower() in OFF_VALUES:
        return None
    labels: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in env.get(OPERATOR_LABELS_ENV, "").split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{OPERATOR_LABELS_ENV}: expected key=value[,key=value...], got {pair!r}")
        labels[key] = value
    metrics_from = DEFAULT_METRICS_FROM
    if (raw := env.get(METRICS_FROM_ENV, "").strip()) != "":
        try:
            peers = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{METRICS_FROM_ENV}: not JSON ({exc})") from None
        if not isinstance(peers, list) or not all(isinstance(p, dict) for p in peers):
            raise ValueError(
                f"{METRICS_FROM_ENV}: expected a JSON list of NetworkPolicyPeers, got {raw[:200]!r}"
            )
        metrics_from = tuple(peers)
    return NetworkPolicySettings(env.get(NAMESPACE_ENV) or None, labels, metrics_from)


def _pods(job: str, component: str) -> Manifest:
    """Peer: the job's pods of one component, in the policy's own namespace."""
    return {"podSelector": {"matchLabels": {n.LABEL_JOB: job, n.LABEL_COMPONENT: component}}}


def _operator(settings: NetworkPolicySettings) -> list[Manifest]:
    """Peer: the operator's pods, when it knows who it is (in a cluster: the chart says)."""
    if not settings.operator_namespace or not settings.operator_pod_labels:
        return []
    return [
        {
            "namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": settings.operator_namespace}
            },
            "podSelector": {"matchLabels": dict(settings.operator_pod_labels)},
        }
    ]


def _policy(
    name: str, job: RLJob, namespace: str, owner: Manifest | None, component: str, ingress: list[Manifest]
) -> Manifest:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": n.object_meta(name, namespace, n.job_labels(job.name, component), owner),
        "spec": {
            "podSelector": {"matchLabels": {n.LABEL_JOB: job.name, n.LABEL_COMPONENT: component}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def build_network_policies(
    job: RLJob, namespace: str, owner: Manifest | None, settings: NetworkPolicySettings | None
) -> list[Manifest]:
    """The job's sampler and router policies (none when `settings` is None: policies off)."""
    if settings is None:
        return []
    engine = [{"protocol": "TCP", "port": n.SGLANG_PORT}]
    router = [{"protocol": "TCP", "port": n.ROUTER_PORT}]
    metrics = list(settings.metrics_from)
    samplers = [
        {"from": [_pods(job.name, "router"), *_operator(settings)], "ports": engine},
        *([{"from": metrics, "ports": engine}] if metrics else []),
        {"ports": [{"protocol": "TCP", "port": n.SYNC_PORT}]},  # the sidecar: read-only, open
    ]
    routers = [
        {"from": [_pods(job.name, "trainer"), *_operator(settings)], "ports": router},
        *([{"from": metrics, "ports": router}] if metrics else []),
    ]
    return [
        _policy(n.samplers_policy_name(job.name), job, namespace, owner, "sampler", samplers),
        _policy(n.router_policy_name(job.name), job, namespace, owner, "router", routers),
    ]
