"""The pure half of the validating webhook: the rejection message for a manifest under the catalog in
effect, the child-name collision check, the shared-store check (one trainer per weight channel), and
the webhook's settings names (its certificates: `rlfleet.operator.certs`).

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
    return {
        n.trainer_name(job),
        n.router_name(job),
        n.config_name(job),
        n.weightchannel_name(job),
        n.router_secret_name(job),
    }


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


def _store(job: Mapping[str, Any]) -> Mapping[str, Any]:
    return job.get("spec", {}).get("weightChannel", {}).get("store", {}) or {}


def _parts(path: str) -> list[str]:
    return [part for part in path.split("/") if part]


def _nested(a: list[str], b: list[str]) -> bool:
    """One path (as components) is the other or lies under it."""
    return a[: len(b)] == b or b[: len(a)] == a


def _store_words(store: Mapping[str, Any]) -> str:
    if store.get("type") == "s3":
        return f"s3://{store.get('bucket')}/{store.get('prefix') or ''}".rstrip("/")
    if store.get("volumeClaimName"):
        return f"PersistentVolumeClaim {store['volumeClaimName']} (mounted at {store.get('path')})"
    return f"path {store.get('path')}"


def stores_overlap(
    a: Mapping[str, Any], a_namespace: str | None, b: Mapping[str, Any], b_namespace: str | None
) -> bool:
    """Pure: two RLJobs' weight stores (`spec.weightChannel.store`) are one channel or nested in each other.

    - S3: the same bucket (bucket names are global, so across namespaces) and prefixes of which one is the
      other or lies under it, by '/' components ("jobs/a" holds "jobs/a/b", not "jobs/ab"; an empty prefix
      holds the whole bucket). The endpoint is not compared: one server may be named by several URLs.
    - filesystem on a PersistentVolumeClaim: the same claim of the same namespace, whatever the paths: the
      pods mount the claim's ROOT at `path` (operator/podspec.py `store_volume`), so the channel is the
      volume's root and two jobs on one claim write one channel.
    - filesystem without a claim (a directory already on the nodes): the same namespace and paths of which
      one is the other or lies under it."""
    kind = a.get("type") or "filesystem"
    if kind != (b.get("type") or "filesystem"):
        return False
    if kind == "s3":
        return a.get("bucket") == b.get("bucket") and _nested(
            _parts(a.get("prefix") or ""), _parts(b.get("prefix") or "")
        )
    if a_namespace != b_namespace or a.get("volumeClaimName") != b.get("volumeClaimName"):
        return False
    return bool(a.get("volumeClaimName")) or _nested(_parts(a.get("path") or ""), _parts(b.get("path") or ""))


def shared_store_message(
    job: Mapping[str, Any], namespace: str | None, other_jobs: Iterable[Mapping[str, Any]]
) -> str | None:
    """Why `job` may not use its weight store (None: no other RLJob's store overlaps it): two trainers on
    one channel would interleave two models' versions (the trainer's writer lease refuses the second one
    at start; this refuses it at `kubectl apply`). `other_jobs`: RLJobs as the API lists them (every
    namespace for an S3 store, the job's own for a filesystem one); the job itself is skipped.
    Suspended jobs run no trainer: a suspended job is admitted, and a suspended other job is not counted;
    unsuspending is a spec change, judged then. So at most one job per store runs."""
    name = job.get("metadata", {}).get("name")
    store = _store(job)
    if job.get("spec", {}).get("suspend"):
        return None
    for other in other_jobs:
        meta = other.get("metadata", {})
        other_ns = meta.get("namespace") or namespace
        if (other_ns, meta.get("name")) == (namespace, name) or other.get("spec", {}).get("suspend"):
            continue
        theirs = _store(other)
        if stores_overlap(store, namespace, theirs, other_ns):
            return (
                f"RLJob rejected by rlfleet: its weight store {_store_words(store)} overlaps the store "
                f"{_store_words(theirs)} of RLJob {other_ns}/{meta.get('name')}: one trainer per weight channel "
                "(two would interleave their models' versions); give this job its own "
                + ("bucket prefix" if store.get("type") == "s3" else "PersistentVolumeClaim or path")
            )
    return None
