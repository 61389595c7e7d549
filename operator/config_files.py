"""PURE config files: what the job's programs read from its ConfigMap (`<job>-config`).

- `run_config`: the resolved RLJob (defaults filled) the trainer reads (`rlfleet trainer run --config`);
- `router_config`: the router's config file (`rlfleet router serve --config`), whose hash also rolls
  the router's pods when it changes.
"""

from __future__ import annotations

from typing import Any

from rlfleet.api import RLJob
from rlfleet.operator import naming as n
from rlfleet.router.config import DEFAULT_CONTEXT_TOKENS, max_body_bytes_for


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
        # the largest legitimate request: a prompt of the whole context (docs/router.md, "Bounds")
        "maxBodyBytes": max_body_bytes_for(job.spec.model.max_seq_len or DEFAULT_CONTEXT_TOKENS),
        # the job's engine key (env from its Secret): required from clients, presented to the engines
        "apiKeyEnv": n.API_KEY_ENV,
    }


def run_config(job: RLJob, namespace: str) -> dict[str, Any]:
    """The resolved RLJob (defaults filled) the trainer reads, with the cluster endpoints it needs."""
    wire = job.to_wire()
    wire["metadata"] = {"name": job.name, "namespace": namespace}
    wire.pop("status", None)
    return wire
