"""Manifests as the user writes them (plain dicts: RLJobs, standalone SamplerGroups, Pods, a Role and its
binding), for the tests that build their own."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

API = "rlfleet.dev/v1alpha1"
RBAC = "rbac.authorization.k8s.io"


def rljob(
    name: str, sampler_groups: Iterable[Mapping[str, Any]], namespace: str | None = None, **spec: Any
) -> dict[str, Any]:
    """An RLJob of model m at /m with its channel on the filesystem at /w; `spec` adds or replaces
    top-level fields of its spec."""
    return {
        "apiVersion": API,
        "kind": "RLJob",
        "metadata": {"name": name} | ({"namespace": namespace} if namespace else {}),
        "spec": {
            "model": {"name": "m", "path": "/m"},
            "samplerGroups": [dict(group) for group in sampler_groups],
            "weightChannel": {"store": {"type": "filesystem", "path": "/w"}},
            **spec,
        },
    }


def pod_manifest(name: str, **spec: Any) -> dict[str, Any]:
    """A bare v1 Pod named `name` with `spec` as its spec."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def samplergroup(name: str = "solo-h100", /, **spec: Any) -> dict[str, Any]:
    """A standalone SamplerGroup object `name`: group h100 on the h100 class serving model m at p; `spec`
    adds or replaces fields of its spec."""
    return {
        "apiVersion": API,
        "kind": "SamplerGroup",
        "metadata": {"name": name},
        "spec": {"name": "h100", "accelerator": "h100", "model": {"name": "m", "path": "p"}, **spec},
    }


def role_and_binding(
    name: str, rules: list[dict[str, Any]], subject: dict[str, str], *, cluster_wide: bool = False
) -> list[dict[str, Any]]:
    """A Role of `rules` (a ClusterRole when `cluster_wide`) and the RoleBinding (ClusterRoleBinding)
    granting it to `subject`, both named `name`; namespaced ones take the namespace they are applied in."""
    kind = "ClusterRole" if cluster_wide else "Role"
    return [
        {"apiVersion": f"{RBAC}/v1", "kind": kind, "metadata": {"name": name}, "rules": rules},
        {
            "apiVersion": f"{RBAC}/v1",
            "kind": f"{kind}Binding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": RBAC, "kind": kind, "name": name},
            "subjects": [subject],
        },
    ]
