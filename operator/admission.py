"""The pure half of the validating webhook: the rejection message for a manifest under the catalog in
effect, the child-name collision check, and the webhook's settings names (its certificates:
`rlfleet.operator.certs`).

No kopf handlers live here, so importing this module registers nothing (the handlers are in
`rlfleet.operator.webhook`, imported only by `rlfleet operator run --webhook-port`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from rlfleet.api import RLJob, SamplerGroup, format_validation_error
from rlfleet.catalog import CatalogError
from rlfleet.operator import naming as n

WEBHOOK_ENV = {
    "port": "RLFLEET_WEBHOOK_PORT",
    "addr": "RLFLEET_WEBHOOK_ADDR",
    "host": "RLFLEET_WEBHOOK_HOST",
    "cert": "RLFLEET_WEBHOOK_CERT",
    "key": "RLFLEET_WEBHOOK_KEY",
    "managed": "RLFLEET_WEBHOOK_MANAGED",
    "secret": "RLFLEET_WEBHOOK_CERT_SECRET",
    "secret_namespace": "RLFLEET_WEBHOOK_CERT_SECRET_NAMESPACE",
    "configuration": "RLFLEET_WEBHOOK_CONFIGURATION",
    "check_interval": "RLFLEET_WEBHOOK_CERT_CHECK_SECONDS",
}


def admission_message(kind: str, manifest: dict[str, Any]) -> str | None:
    """None if the object is valid against the runtime catalog, else the rejection message."""
    try:
        if kind == "RLJob":
            RLJob.from_manifest(manifest)
        else:
            SamplerGroup.from_manifest(manifest)
    except ValidationError as exc:
        return f"{kind} rejected by rlfleet (catalog in effect): " + "; ".join(
            line.strip() for line in format_validation_error(exc).splitlines()
        )
    except (CatalogError, ValueError) as exc:
        return f"{kind} rejected by rlfleet (catalog in effect): {exc}"
    return None


def own_child_names(job: str) -> set[str]:
    """Names of a job's own children (besides its groups): <job>-trainer, -router, -config, ..."""
    return {n.trainer_name(job), n.router_name(job), n.config_name(job), n.weightchannel_name(job),
            n.router_secret_name(job)}  # fmt: skip


def in_namespace(index: Any, namespace: str | None) -> list[dict[str, Any]]:
    """The objects of one namespace in a kopf index keyed (namespace, name): what the RLJob pipeline has
    `collision_message` compare a job against (the webhook lists them from the API instead)."""
    return [obj for (ns, _), store in list(index.items()) if ns == namespace for obj in store]


def collision_message(
    job: Mapping[str, Any],
    other_jobs: Iterable[Mapping[str, Any]],
    samplergroups: Iterable[Mapping[str, Any]],
) -> str | None:
    """Why `job`'s children would collide with another object of the namespace (None: they would not).

    CEL sees one object, so it cannot tell that job `a` with group `b-c` and job `a-b` with group `c`
    both want SamplerGroup (Deployment, Service) `a-b-c`, or that job `a`'s group `b-trainer` is named
    like job `a-b`'s trainer. The webhook asks this with the namespace's objects as the API lists them, the
    RLJob pipeline with the operator's indexes."""
    name = job.get("metadata", {}).get("name") or ""
    groups = {
        n.samplergroup_name(name, g.get("name", "")) for g in job.get("spec", {}).get("samplerGroups", [])
    }
    mine = groups | own_child_names(name)
    for sg in samplergroups:
        sg_name = sg.get("metadata", {}).get("name")
        owner = sg.get("spec", {}).get("jobName")
        if owner != name and sg_name in mine:
            whose = f"RLJob {owner}" if owner else "no RLJob (a standalone group)"
            return (
                f"RLJob rejected by rlfleet: the name {sg_name} (Deployment and Service) is taken by SamplerGroup "
                f"{sg_name} of {whose}: rename this job or its group"
            )
    for other in other_jobs:
        other_name = other.get("metadata", {}).get("name")
        if other_name == name:
            continue
        taken = sorted(groups & own_child_names(other_name or ""))
        if taken:
            return (
                f"RLJob rejected by rlfleet: group child {taken[0]} is named like a child of RLJob {other_name}: "
                "rename this job or its group"
            )
    return None
