"""Every name the operator puts on objects: labels, annotations, field managers, child names, ports, and
the metadata (name, labels, annotations, owner reference) every child carries.

One module so that builders, workloads, status code, handlers, tests and the Helm chart agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlfleet.api.common import API_VERSION, ENGINE_API_KEY_ENV, GROUP, SYNC_SIDECAR_PORT

# --- ownership and bookkeeping ------------------------------------------------------------------------
FIELD_MANAGER = "rlfleet-operator"  # server-side apply of children
STATUS_FIELD_MANAGER = "rlfleet-operator-status"  # server-side apply of the status subresource
# holds a SamplerGroup's spec.replicas between the operator's apply and the scale subresource (replicas.py)
REPLICAS_HANDOVER_MANAGER = "rlfleet-replicas-handover"
# kopf's finalizer name: kopf puts it on objects with a timer (WeightChannels only; RLJobs and SamplerGroups
# carry none, so they delete without the operator: docs/operations.md)
FINALIZER = f"{GROUP}/finalizer"
KOPF_PREFIX = GROUP  # kopf progress / diff-base annotations: rlfleet.dev/...

# --- labels ------------------------------------------------------------------------------------------
LABEL_JOB = f"{GROUP}/job"
LABEL_GROUP = f"{GROUP}/group"  # group name inside the job (e.g. h100-fp8)
LABEL_SAMPLERGROUP = f"{GROUP}/samplergroup"  # SamplerGroup object name (<job>-<group>): pod selector
LABEL_COMPONENT = "app.kubernetes.io/component"  # sampler | trainer | router | config | weights
LABEL_ACCELERATOR = f"{GROUP}/accelerator"
LABEL_WEIGHT_FORMAT = f"{GROUP}/weight-format"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "rlfleet-operator"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"

# --- annotations -------------------------------------------------------------------------------------
ANN_SPEC_HASH = f"{GROUP}/spec-hash"  # hash of the pod-relevant spec (rolls pods on change)
ANN_CONFIG_HASH = f"{GROUP}/config-hash"  # hash of the router's config file (rolls router pods on change)
ANN_PROM_SCRAPE = "prometheus.io/scrape"
ANN_PROM_PORT = "prometheus.io/port"
ANN_PROM_PATH = "prometheus.io/path"

# --- ports and paths ---------------------------------------------------------------------------------
SGLANG_PORT = 30000  # SamplerGroupSpec.port default
SYNC_CONTAINER = "weight-sync"  # the sampler pod's sidecar (its subscriber report, its /status)
SYNC_PORT = SYNC_SIDECAR_PORT  # weight-sync sidecar: /metrics /status /health (admission keeps SGLang off it)
ROUTER_PORT = 8000
TRAINER_RDZV_PORT = 29500
TRAINER_METRICS_PORT = 9500
CONFIG_MOUNT = "/etc/rlfleet/run"
CONFIG_FILE = "rljob.yaml"
ROUTER_CONFIG_FILE = "router.yaml"
ROUTER_TOKEN_MOUNT = "/etc/rlfleet/router-admin"
# The job's engine API key: env var of every pod that serves or calls the engines (by secretKeyRef, never
# a value in a spec) and the key of the `<job>-api-key` Secret that holds it.
API_KEY_ENV = ENGINE_API_KEY_ENV
API_KEY_SECRET_KEY = "key"
WEIGHTS_CACHE = "/var/lib/rlfleet/weights"

KINDS = ("RLJob", "SamplerGroup", "WeightChannel")
RLFLEET_API_VERSION = API_VERSION


def samplergroup_name(job: str, group: str) -> str:
    """SamplerGroup (and its Deployment and Service): <job>-<group> (<= 63 by the CRD's rules)."""
    return f"{job}-{group}"


def weightchannel_name(job: str) -> str:
    return f"{job}-weights"


def trainer_name(job: str) -> str:
    """Trainer StatefulSet and its headless Service."""
    return f"{job}-trainer"


def router_name(job: str) -> str:
    """Router Deployment and Service."""
    return f"{job}-router"


def config_name(job: str) -> str:
    """ConfigMap with the resolved run config."""
    return f"{job}-config"


def router_secret_name(job: str) -> str:
    """Secret with the router admin token (created once if the job names none)."""
    return f"{job}-router-admin"


def api_key_secret_name(owner: str) -> str:
    """Secret with the engine API key of a job (or of a SamplerGroup outside any job): created once."""
    return f"{owner}-api-key"


def samplers_policy_name(job: str) -> str:
    """NetworkPolicy of a job's sampler pods (their engine port: the router and the operator)."""
    return f"{job}-samplers"


def router_policy_name(job: str) -> str:
    """NetworkPolicy of a job's router pods (its port: the trainer and the operator)."""
    return f"{job}-router"


def sandboxes_name(job: str) -> str:
    """NetworkPolicy of a job's sandbox pods (no ingress, no egress) and the RoleBinding that lets the
    trainer manage them (rollout.sandbox.backend pods, operator/sandboxes.py)."""
    return f"{job}-sandboxes"


def trainer_service_account_name(job: str) -> str:
    """The trainer's ServiceAccount when it manages sandbox pods and the user names none."""
    return f"{job}-trainer"


def job_labels(job: str, component: str) -> dict[str, str]:
    """Common labels of every child of a job."""
    return {
        LABEL_NAME: f"rlfleet-{component}",
        LABEL_INSTANCE: job,
        LABEL_COMPONENT: component,
        LABEL_PART_OF: "rlfleet",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_JOB: job,
    }


def sampler_selector(samplergroup: str) -> dict[str, str]:
    """Pod selector of a sampler group (immutable in the Deployment: keep it minimal)."""
    return {LABEL_SAMPLERGROUP: samplergroup}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def sampler_labels(
    job: str, group: str, samplergroup: str, accelerator: str, weight_format: str
) -> dict[str, str]:
    """Labels of a sampler group's Deployment, Service and pods (the job's common labels plus the group)."""
    return {
        **job_labels(job, "sampler"),
        LABEL_GROUP: group,
        LABEL_SAMPLERGROUP: samplergroup,
        LABEL_ACCELERATOR: accelerator,
        LABEL_WEIGHT_FORMAT: weight_format,
    }


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    """Controller owner reference to `owner` (a body with apiVersion, kind, metadata.name/uid)."""
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    owner: Mapping[str, Any] | None,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """metadata of a child: its name and labels, annotations when any, and the owner reference (children
    of a job or group are garbage-collected with it)."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
    return meta
