"""PURE config files: what the job's programs read from its ConfigMap (`<job>-config`).

- `run_config`: the resolved RLJob (defaults filled) the trainer reads (`rlfleet trainer run --config`);
- `router_config`: the router's config file (`rlfleet router serve --config`), whose hash also rolls
  the router's pods when it changes.
"""

from __future__ import annotations

from typing import Any

from rlfleet.api import RLJob
from rlfleet.operator import naming as n


def router_config(job: RLJob, namespace: str) -> dict[str, Any]:
    """The router's config file (router/config.py RouterConfig): the job's groups, the one source of the
    router's membership. Each group's replica URL is its headless Service, which the router looks up
    itself: one replica per ready pod (router/membership.py); the rebalancer pushes only shares and
    quarantine."""
    groups = job.spec.sampler_groups
    static = job.spec.router.static_shares
    out_groups = []
    for g in groups:
        svc = n.samplergroup_name(job.name, g.name)
        share = static.get(g.name, 0.0) if job.spec.router.policy == "static" else 1.0 / len(groups)
        out_groups.append(
            {
                "name": g.name,
                "share": share,
                "replicas": [f"http://{svc}.{namespace}.svc:{n.SGLANG_PORT}"],
                "quarantined": g.quarantined,
            }
        )
    return {
        "host": "0.0.0.0",
        "port": n.ROUTER_PORT,
        "groups": out_groups,
        "adminTokenFile": f"{n.ROUTER_TOKEN_MOUNT}/token",
    }


def run_config(job: RLJob, namespace: str) -> dict[str, Any]:
    """The resolved RLJob (defaults filled) the trainer reads, with the cluster endpoints it needs."""
    wire = job.to_wire()
    wire["metadata"] = {"name": job.name, "namespace": namespace}
    wire.pop("status", None)
    return wire
