"""PURE pod shaping shared by every workload the operator builds (workloads.py): where a pod may run
(the catalog's node terms AND the user's, tolerations, node selector, priority), with which rights
(non-root uid, restricted containers), with which resources (the class's defaults, its GPUs, the user's
overrides), its template metadata, and how it reaches the weight store (URI, credentials by reference,
PVC). No I/O.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rlfleet.api import StoreSpec
from rlfleet.api.common import SUBSCRIBERS_DIR
from rlfleet.api.podfields import template_wire
from rlfleet.api.scheduling import PodPlacement, compact
from rlfleet.catalog import GPU_RESOURCE, GPU_TOLERATION, Catalog

RESTRICTED_CONTAINER: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
}
NON_ROOT_UID = 10001
"""The one uid of every rlfleet image (images/Dockerfile.*: USER 10001:10001) and of every pod the
operator builds; the chart runs the operator with it too."""
HF_HOME = "/tmp/huggingface"
"""Hugging Face cache of the trainer and SGLang, on the pod's writable /tmp emptyDir (the image's own
home belongs to the image user and the root filesystem may be read-only)."""


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": NON_ROOT_UID,
        "runAsGroup": NON_ROOT_UID,
        "fsGroup": NON_ROOT_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _and_terms(catalog_terms: list[dict[str, Any]], user_terms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Node selector terms are ORed, requirements inside a term ANDed: (c1 | c2) & (u1 | u2) is the
    cross product of terms, each with both sides' requirements."""
    if not user_terms:
        return catalog_terms
    if not catalog_terms:  # a CPU class requires no node: the user's terms alone
        return user_terms
    out = []
    for c in catalog_terms:
        for u in user_terms:
            term: dict[str, Any] = {}
            for key in ("matchExpressions", "matchFields"):
                reqs = [*c.get(key, []), *u.get(key, [])]
                if reqs:
                    term[key] = reqs
            out.append(term)
    return out


def pod_affinity(
    placement: PodPlacement,
    catalog: Catalog | None,
    accelerator: str | None,
    own_anti_affinity: list[dict[str, Any]] | None = None,
    spot: bool = False,
) -> dict[str, Any] | None:
    """The pods' affinity: the catalog's accelerator node terms AND (with `spot`) the catalog's spot node
    terms AND the user's required node terms (the class is never replaced), the user's preferences, and
    pod (anti-)affinity terms of user and operator."""
    user = compact(placement.affinity.to_wire()) if placement.affinity is not None else {}
    affinity: dict[str, Any] = {}
    node = user.get("nodeAffinity", {})
    user_required = node.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get(
        "nodeSelectorTerms", []
    )
    required = user_required
    if catalog is not None and spot:
        required = _and_terms(catalog.spot.node_selector_terms(), required)
    if catalog is not None and accelerator is not None:
        required = _and_terms(catalog.get(accelerator).node_selector_terms(), required)
    node_affinity: dict[str, Any] = {}
    if required:
        node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": required}
    if node.get("preferredDuringSchedulingIgnoredDuringExecution"):
        node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] = node[
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
    if node_affinity:
        affinity["nodeAffinity"] = node_affinity
    for key, own in (("podAffinity", None), ("podAntiAffinity", own_anti_affinity)):
        terms = {k: list(v) for k, v in user.get(key, {}).items() if v}
        if own:
            terms["requiredDuringSchedulingIgnoredDuringExecution"] = [
                *terms.get("requiredDuringSchedulingIgnoredDuringExecution", []),
                *own,
            ]
        if terms:
            affinity[key] = terms
    return affinity or None


def pod_tolerations(
    placement: PodPlacement, gpu: bool, spot: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The GPU toleration (GPU pods), the spot flavor's (a spot group's: `spot`), then the user's,
    without duplicates."""
    out = [dict(GPU_TOLERATION)] if gpu else []
    for wire in [*(spot or []), *(compact(t.to_wire()) for t in placement.tolerations)]:
        if wire not in out:
            out.append(wire)
    return out


def container_resources(defaults: dict[str, dict[str, str]], placement: PodPlacement) -> dict[str, Any]:
    """The operator's requests/limits with the user's merged over them per resource name (the CRD and
    pydantic refuse nvidia.com/gpu there, so the GPU count stays the spec's)."""
    out = {kind: dict(values) for kind, values in defaults.items()}
    if placement.resources is not None:
        for kind in ("requests", "limits"):
            extra = getattr(placement.resources, kind)
            if extra:
                out.setdefault(kind, {}).update(extra)
    return out


def class_resources(defaults: dict[str, dict[str, str]], gpus: int) -> dict[str, dict[str, str]]:
    """The catalog class's default requests/limits of a container, plus `gpus` nvidia.com/gpu (request and
    limit) when gpus > 0 (a CPU class asks for none)."""
    out = {kind: dict(values) for kind, values in defaults.items()}
    if gpus > 0:
        out.setdefault("requests", {})[GPU_RESOURCE] = str(gpus)
        out.setdefault("limits", {})[GPU_RESOURCE] = str(gpus)
    return out


def pod_template_metadata(
    labels: dict[str, str], annotations: dict[str, str], placement: PodPlacement
) -> dict[str, Any]:
    """Pod template labels and annotations: the user's extras, then the operator's (which win; the API
    refuses user keys that collide with them)."""
    return {
        "labels": {**placement.pod_labels, **labels},
        "annotations": {**placement.pod_annotations, **annotations},
    }


def pod_placement_spec(placement: PodPlacement) -> dict[str, Any]:
    """nodeSelector and priorityClassName of the pod spec (only when set)."""
    out: dict[str, Any] = {}
    if placement.node_selector:
        out["nodeSelector"] = dict(placement.node_selector)
    if placement.priority_class_name:
        out["priorityClassName"] = placement.priority_class_name
    return out


def pod_identity_spec(placement: PodPlacement) -> dict[str, Any]:
    """serviceAccountName, its token and imagePullSecrets of the pod spec. The pods need no API rights (the
    operator writes their status), so no token is mounted unless the user names a ServiceAccount: then
    its projected token is what workload identity (IRSA, GKE Workload Identity) exchanges for cloud
    credentials, so it is mounted (docs/operations.md, "Gated models and private registries")."""
    out: dict[str, Any] = {"automountServiceAccountToken": placement.service_account_name is not None}
    if placement.service_account_name:
        out["serviceAccountName"] = placement.service_account_name
    if placement.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": s.name} for s in placement.image_pull_secrets]
    return out


def container_env(own: list[dict[str, Any]], placement: PodPlacement) -> dict[str, Any]:
    """`env` (the operator's, then the user's) and `envFrom` of a container. The API refuses user names
    the operator sets; a user name equal to one of the catalog's launch env replaces it (one entry per
    name). Kubernetes gives env precedence over envFrom, so the operator's names keep their values."""
    user = [template_wire(e) for e in placement.env]
    names = {e["name"] for e in user}
    out: dict[str, Any] = {"env": [e for e in own if e["name"] not in names] + user}
    if placement.env_from:
        out["envFrom"] = [template_wire(e) for e in placement.env_from]
    return out


def user_volumes(placement: PodPlacement) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) the user adds to the pod and its main container (names and paths that collide
    with the operator's are refused by the API)."""
    return (
        [template_wire(v) for v in placement.volumes],
        [template_wire(m) for m in placement.volume_mounts],
    )


def optional(key: str, value: Any) -> dict[str, Any]:
    """`{key: value}` when `value` is set, else nothing (a pod spec carries no empty fields)."""
    return {key: value} if value else {}


def spec_hash(data: Any) -> str:
    """A short digest of `data` for a pod template annotation: a change of what the pods read rolls them."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# --- the weight store ------------------------------------------------------------------------------


def store_env(store: StoreSpec, sampler: bool = False) -> list[dict[str, Any]]:
    """S3 credentials by reference (never copied into the pod spec), region, endpoint. A sampler pod takes
    `samplerSecretRef`, and the trainer's `secretRef` only where `sharedCredentials` says so (credentials
    per role, docs/install.md "Store credentials"); otherwise none (the pod's own identity, if any)."""
    env: list[dict[str, Any]] = []
    if store.type == "s3":
        if sampler:
            secret_ref = store.sampler_secret_ref or (store.secret_ref if store.shared_credentials else None)
        else:
            secret_ref = store.secret_ref
        if secret_ref is not None:
            for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
                env.append(
                    {"name": key, "valueFrom": {"secretKeyRef": {"name": secret_ref.name, "key": key}}}
                )
        if store.region:
            env.append({"name": "AWS_DEFAULT_REGION", "value": store.region})
        if store.endpoint:
            env.append({"name": "AWS_ENDPOINT_URL", "value": store.endpoint})
    return env


def store_volume(store: StoreSpec, read_only: bool) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) for a filesystem store backed by a PVC; nothing for S3 or hostless paths."""
    if store.type != "filesystem" or not store.volume_claim_name:
        return [], []
    volume = {
        "name": "weights",
        "persistentVolumeClaim": {"claimName": store.volume_claim_name, "readOnly": read_only},
    }
    mount = {"name": "weights", "mountPath": store.path, "readOnly": read_only}
    return [volume], [mount]


def sampler_store_volume(store: StoreSpec, group: str) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) of a filesystem store for a sampler pod's sync containers: the channel READ-ONLY
    (versions, pointer, checkpoints: a sampler never writes them), and writable only the directory of its
    own group's subscriber reports, `subscribers/<group>/` (docs/weights.md), mounted over it as a subPath
    of the same claim (the kubelet creates that directory on the volume before the container starts, and
    the runtime mounts the deeper path after the read-only one). So a compromised sampler pod cannot
    rewrite a version, move the pointer or plant a checkpoint. Nothing for S3 or a path without a claim."""
    if store.type != "filesystem" or not store.volume_claim_name or store.path is None:
        return [], []
    volume = {"name": "weights", "persistentVolumeClaim": {"claimName": store.volume_claim_name}}
    mounts: list[dict] = [
        {"name": "weights", "mountPath": store.path, "readOnly": True},
        {
            "name": "weights",
            "mountPath": f"{store.path.rstrip('/')}/{SUBSCRIBERS_DIR}/{group}",
            "subPath": f"{SUBSCRIBERS_DIR}/{group}",
        },
    ]
    return [volume], mounts
