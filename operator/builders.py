"""PURE builders: RLJob / SamplerGroup spec -> child manifests (dicts ready for server-side apply).

No I/O here. Handlers read what is needed (observed SamplerGroups, the WeightChannel), call these,
and apply the results. Everything a child needs is derived from the API models and the catalog.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any
from urllib.parse import urlencode

import yaml

from rlfleet.api import RLJob, SamplerGroup, SamplerGroupTemplate, StoreSpec
from rlfleet.api.common import API_VERSION, WEIGHT_FORMATS
from rlfleet.api.scheduling import (
    KUEUE_POD_GROUP_COUNT_ANNOTATION,
    KUEUE_POD_GROUP_LABEL,
    KUEUE_POD_GROUP_SERVING_ANNOTATION,
    KUEUE_QUEUE_LABEL,
    PodPlacement,
    compact,
)
from rlfleet.catalog import (
    GPU_RESOURCE,
    GPU_TOLERATION,
    LAUNCH_FILE,
    MODEL_DIR_REF,
    WEIGHT_VERSION_REF,
    Catalog,
    engine_launch_for_group,
    launch_from_file,
)
from rlfleet.operator import naming as n

Manifest = dict[str, Any]

SGLANG_PORT = 30000  # SamplerGroupSpec.port default
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


def owner_reference(owner: Manifest) -> dict[str, Any]:
    """Controller owner reference to `owner` (a body with apiVersion, kind, metadata.name/uid)."""
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(name: str, namespace: str, labels: dict[str, str], owner: Manifest | None,
          annotations: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
    return meta


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": NON_ROOT_UID,
        "runAsGroup": NON_ROOT_UID,
        "fsGroup": NON_ROOT_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"


def _and_terms(catalog_terms: list[dict[str, Any]], user_terms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Node selector terms are ORed, requirements inside a term ANDed: (c1 | c2) & (u1 | u2) is the
    cross product of terms, each with both sides' requirements."""
    if not user_terms:
        return catalog_terms
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


def pod_affinity(placement: PodPlacement, catalog: Catalog | None, accelerator: str | None,
                 own_anti_affinity: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:  # fmt: skip
    """The pods' affinity: the catalog's accelerator node terms AND the user's required node terms (the
    class is never replaced), the user's preferences, and pod (anti-)affinity terms of user and operator."""
    user = compact(placement.affinity.to_wire()) if placement.affinity is not None else {}
    affinity: dict[str, Any] = {}
    node = user.get("nodeAffinity", {})
    user_required = node.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get(
        "nodeSelectorTerms", []
    )
    required = user_required
    if catalog is not None and accelerator is not None:
        required = _and_terms(catalog.get(accelerator).node_selector_terms(), user_required)
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


def pod_tolerations(placement: PodPlacement, gpu: bool) -> list[dict[str, Any]]:
    """The GPU toleration (GPU pods) followed by the user's, without duplicates."""
    out = [dict(GPU_TOLERATION)] if gpu else []
    for t in placement.tolerations:
        wire = compact(t.to_wire())
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


def pod_template_metadata(labels: dict[str, str], annotations: dict[str, str],
                          placement: PodPlacement) -> dict[str, Any]:  # fmt: skip
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


def trainer_gang(job: RLJob) -> tuple[dict[str, str], dict[str, str], list[dict[str, Any]]]:
    """(labels, annotations, anti-affinity terms) that make the trainer replicas ONE gang: with a Kueue
    queue named in podLabels, a Kueue pod group of all replicas (admitted together or not at all); with
    more than one replica, one replica per node (docs/scheduling.md)."""
    t = job.spec.trainer
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    if KUEUE_QUEUE_LABEL in t.pod_labels:
        labels[KUEUE_POD_GROUP_LABEL] = n.trainer_name(job.name)
        annotations[KUEUE_POD_GROUP_COUNT_ANNOTATION] = str(t.replicas)
        annotations[KUEUE_POD_GROUP_SERVING_ANNOTATION] = "true"  # long-running: replaced pods rejoin
    anti: list[dict[str, Any]] = []
    if t.replicas > 1:
        anti.append(
            {
                "labelSelector": {"matchLabels": {n.LABEL_JOB: job.name, n.LABEL_COMPONENT: "trainer"}},
                "topologyKey": HOSTNAME_TOPOLOGY,
            }
        )
    return labels, annotations, anti


def _optional(key: str, value: Any) -> dict[str, Any]:
    return {key: value} if value else {}


def channel_views(job: RLJob) -> list[str]:
    """Views the channel publishes: the groups' weight formats, always including bf16, canonical order."""
    wanted = {"bf16", *(g.weight_format for g in job.spec.sampler_groups)}
    return [f for f in WEIGHT_FORMATS if f in wanted]


def store_uri(store: StoreSpec) -> str:
    """The sidecar's --store argument: a filesystem path, or s3://bucket/prefix[?endpoint=URL]."""
    if store.type == "filesystem":
        return store.path or ""
    uri = f"s3://{store.bucket}/{store.prefix.strip('/')}".rstrip("/")
    if store.endpoint:
        uri += "?" + urlencode({"endpoint": store.endpoint})
    return uri


def store_env(store: StoreSpec) -> list[dict[str, Any]]:
    """S3 credentials by reference (never copied into the pod spec), region, endpoint."""
    env: list[dict[str, Any]] = []
    if store.type == "s3":
        if store.secret_ref is not None:
            for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
                env.append(
                    {"name": key, "valueFrom": {"secretKeyRef": {"name": store.secret_ref.name, "key": key}}}
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


def _hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# --- RLJob children ------------------------------------------------------------------------------------


def build_samplergroup(job: RLJob, group: SamplerGroupTemplate, namespace: str, owner: Manifest | None,
                       observed: Manifest | None = None) -> Manifest:  # fmt: skip
    """The SamplerGroup of one group. A `kubectl scale` override survives until the group's replicas
    change in the RLJob (the annotation remembers which RLJob value the operator last applied)."""
    name = n.samplergroup_name(job.name, group.name)
    replicas = group.replicas
    if observed is not None:
        last = observed.get("metadata", {}).get("annotations", {}).get(n.ANN_JOB_REPLICAS)
        current = observed.get("spec", {}).get("replicas")
        if last == str(group.replicas) and isinstance(current, int):
            replicas = current
    labels = {**n.job_labels(job.name, "sampler"), n.LABEL_GROUP: group.name}
    spec: dict[str, Any] = {
        "name": group.name,
        "accelerator": group.accelerator,
        "replicas": replicas,
        "weightFormat": group.weight_format,
        "kvCacheDtype": group.kv_cache_dtype,
        "extraArgs": list(group.extra_args),
        "quarantined": group.quarantined,
        "jobName": job.name,
        "model": {"name": job.spec.model.name, "path": job.spec.model.path},
        "weightChannel": n.weightchannel_name(job.name),
        "suspend": job.spec.suspend,
        "images": job.spec.sampler_images.to_wire(),
    }
    if group.tensor_parallel is not None:
        spec["tensorParallel"] = group.tensor_parallel
    spec.update(group.placement_wire())
    return {
        "apiVersion": API_VERSION,
        "kind": "SamplerGroup",
        "metadata": _meta(name, namespace, labels, owner, {n.ANN_JOB_REPLICAS: str(group.replicas)}),
        "spec": spec,
    }


def build_weightchannel(job: RLJob, namespace: str, owner: Manifest | None) -> Manifest:
    wc = job.spec.weight_channel
    return {
        "apiVersion": API_VERSION,
        "kind": "WeightChannel",
        "metadata": _meta(
            n.weightchannel_name(job.name), namespace, n.job_labels(job.name, "weights"), owner
        ),
        "spec": {
            "jobName": job.name,
            "store": wc.store.to_wire(),
            "views": channel_views(job),
            "retention": wc.retention.to_wire(),
        },
    }


def router_config(job: RLJob, namespace: str) -> dict[str, Any]:
    """The router's config file (router/config.py RouterConfig). Groups keyed by group name; each group
    starts with its headless Service as the replica URL (the rebalancer pushes per-pod URLs/shares)."""
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
                "replicas": [f"http://{svc}.{namespace}.svc:{SGLANG_PORT}"],
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


def build_config_map(job: RLJob, namespace: str, owner: Manifest | None) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(n.config_name(job.name), namespace, n.job_labels(job.name, "config"), owner),
        "data": {
            n.CONFIG_FILE: yaml.safe_dump(run_config(job, namespace), sort_keys=False),
            n.ROUTER_CONFIG_FILE: yaml.safe_dump(router_config(job, namespace), sort_keys=False),
        },
    }


def build_router_secret(job: RLJob, namespace: str, owner: Manifest | None, token: str) -> Manifest:
    """Admin token Secret, created once (never re-applied, so the token is stable)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(n.router_secret_name(job.name), namespace, n.job_labels(job.name, "router"), owner),
        "type": "Opaque",
        "stringData": {"token": token},
    }


def _common_env(job: RLJob, namespace: str) -> list[dict[str, Any]]:
    return [
        {"name": "RLFLEET_JOB", "value": job.name},
        {"name": "RLFLEET_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {
            "name": "RLFLEET_ROUTER_URL",
            "value": f"http://{n.router_name(job.name)}.{namespace}.svc:{n.ROUTER_PORT}",
        },
        {"name": "RLFLEET_WEIGHT_CHANNEL", "value": n.weightchannel_name(job.name)},
        {"name": "RLFLEET_CONFIG", "value": f"{n.CONFIG_MOUNT}/{n.CONFIG_FILE}"},
    ]


def build_trainer_service(job: RLJob, namespace: str, owner: Manifest | None) -> Manifest:
    """Headless Service: stable DNS for torchrun rendezvous (ready or not)."""
    labels = n.job_labels(job.name, "trainer")
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(n.trainer_name(job.name), namespace, labels, owner),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {n.LABEL_JOB: job.name, n.LABEL_COMPONENT: "trainer"},
            "ports": [
                {"name": "rdzv", "port": n.TRAINER_RDZV_PORT, "targetPort": n.TRAINER_RDZV_PORT},
                {"name": "metrics", "port": n.TRAINER_METRICS_PORT, "targetPort": n.TRAINER_METRICS_PORT},
            ],
        },
    }


def build_trainer_statefulset(
    job: RLJob, namespace: str, owner: Manifest | None, catalog: Catalog
) -> Manifest:
    """torchrun ranks: one pod per trainer replica, GPUs of the trainer class, c10d rendezvous on pod 0."""
    t = job.spec.trainer
    name = n.trainer_name(job.name)
    labels = n.job_labels(job.name, "trainer")
    selector = {n.LABEL_JOB: job.name, n.LABEL_COMPONENT: "trainer"}
    store = job.spec.weight_channel.store
    volumes, mounts = store_volume(store, read_only=False)
    master = f"{name}-0.{name}.{namespace}.svc"
    gang_labels, gang_annotations, gang_anti = trainer_gang(job)
    cls = catalog.get(t.accelerator)
    ranks = t.ranks_per_replica
    env = [
        *_common_env(job, namespace),
        {"name": "NNODES", "value": str(t.replicas)},
        {"name": "NPROC_PER_NODE", "value": str(ranks)},
        {
            "name": "NODE_RANK",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
        },
        {"name": "MASTER_ADDR", "value": master},
        {"name": "MASTER_PORT", "value": str(n.TRAINER_RDZV_PORT)},
        {"name": "RLFLEET_TRAINER_BACKEND", "value": t.backend},
        # the class's device: "cuda" (nccl) on a GPU class, "cpu" (gloo) on a CPU class (trainer/entrypoint.py)
        {"name": "RLFLEET_TRAINER_DEVICE", "value": "cuda" if cls.gpu else "cpu"},
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": HF_HOME},
        *store_env(store),
    ]
    container = {
        "name": "trainer",
        "image": t.image,
        "imagePullPolicy": job.spec.sampler_images.pull_policy,
        "command": ["torchrun"],
        "args": [
            "--nnodes=$(NNODES)",
            "--nproc-per-node=$(NPROC_PER_NODE)",
            "--node-rank=$(NODE_RANK)",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=$(MASTER_ADDR):$(MASTER_PORT)",
            "--rdzv-id=$(RLFLEET_JOB)",
            "-m",
            "rlfleet.cli",
            "trainer",
            "run",
            "--config",
            f"{n.CONFIG_MOUNT}/{n.CONFIG_FILE}",
        ],  # fmt: skip
        "env": env,
        "ports": [
            {"name": "rdzv", "containerPort": n.TRAINER_RDZV_PORT},
            {"name": "metrics", "containerPort": n.TRAINER_METRICS_PORT},
        ],
        "resources": container_resources(class_resources(cls.trainer_resources, ranks if cls.gpu else 0), t),
        "volumeMounts": [
            {"name": "config", "mountPath": n.CONFIG_MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            *mounts,
        ],
        "securityContext": dict(RESTRICTED_CONTAINER),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(name, namespace, labels, owner),
        "spec": {
            "serviceName": name,
            "replicas": 0 if job.spec.suspend else t.replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": pod_template_metadata(
                    {**labels, **gang_labels},
                    {
                        n.ANN_PROM_SCRAPE: "true",
                        n.ANN_PROM_PORT: str(n.TRAINER_METRICS_PORT),
                        n.ANN_PROM_PATH: "/metrics",
                        **gang_annotations,
                    },
                    t,
                ),
                "spec": {
                    **_optional("affinity", pod_affinity(t, catalog, t.accelerator, own_anti_affinity=gang_anti)),
                    **_optional("tolerations", pod_tolerations(t, gpu=cls.gpu)),
                    **pod_placement_spec(t),
                    "securityContext": pod_security_context(),
                    "automountServiceAccountToken": False,  # no API rights: the operator writes its status
                    "terminationGracePeriodSeconds": 120,
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": n.config_name(job.name)}},
                        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi" if cls.gpu else "1Gi"}},
                        {"name": "tmp", "emptyDir": {}},
                        *volumes,
                    ],
                },
            },
        },
    }


def build_router_service(job: RLJob, namespace: str, owner: Manifest | None) -> Manifest:
    labels = n.job_labels(job.name, "router")
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(n.router_name(job.name), namespace, labels, owner),
        "spec": {
            "selector": {n.LABEL_JOB: job.name, n.LABEL_COMPONENT: "router"},
            "ports": [{"name": "http", "port": n.ROUTER_PORT, "targetPort": n.ROUTER_PORT}],
        },
    }


def build_router_deployment(job: RLJob, namespace: str, owner: Manifest | None) -> Manifest:
    r = job.spec.router
    labels = n.job_labels(job.name, "router")
    secret = r.admin_token_secret or n.router_secret_name(job.name)
    config_hash = _hash(router_config(job, namespace))
    probe = {"httpGet": {"path": "/health", "port": n.ROUTER_PORT}, "periodSeconds": 10, "timeoutSeconds": 3}
    container = {
        "name": "router",
        "image": r.image,
        "imagePullPolicy": job.spec.sampler_images.pull_policy,
        "command": ["rlfleet"],
        "args": ["router", "serve", "--config", f"{n.CONFIG_MOUNT}/{n.ROUTER_CONFIG_FILE}"],
        "ports": [{"name": "http", "containerPort": n.ROUTER_PORT}],
        "readinessProbe": probe,
        "livenessProbe": {**probe, "failureThreshold": 6},
        "resources": container_resources(
            {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}, r
        ),
        "env": [{"name": "HOME", "value": "/tmp"}],
        "volumeMounts": [
            {"name": "config", "mountPath": n.CONFIG_MOUNT, "readOnly": True},
            {"name": "admin-token", "mountPath": n.ROUTER_TOKEN_MOUNT, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": {**RESTRICTED_CONTAINER, "readOnlyRootFilesystem": True},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(n.router_name(job.name), namespace, labels, owner),
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": {n.LABEL_JOB: job.name, n.LABEL_COMPONENT: "router"}},
            "template": {
                "metadata": pod_template_metadata(
                    labels,
                    {
                        "rlfleet.dev/config-hash": config_hash,
                        n.ANN_PROM_SCRAPE: "true",
                        n.ANN_PROM_PORT: str(n.ROUTER_PORT),
                        n.ANN_PROM_PATH: "/metrics",
                    },
                    r,
                ),
                "spec": {
                    **_optional("affinity", pod_affinity(r, None, None)),
                    **_optional("tolerations", pod_tolerations(r, gpu=False)),
                    **pod_placement_spec(r),
                    "securityContext": pod_security_context(),
                    "automountServiceAccountToken": False,
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": n.config_name(job.name)}},
                        {"name": "admin-token", "secret": {"secretName": secret}},
                        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
                    ],
                },
            },
        },
    }


def build_job_children(job: RLJob, namespace: str, owner: Manifest | None, catalog: Catalog,
                       observed_groups: dict[str, Manifest] | None = None) -> list[Manifest]:  # fmt: skip
    """Every child of an RLJob in apply order (config and trainer before samplers: the trainer asks for
    whole GPU nodes, so it should reach the scheduler before the sampler pods fragment them)."""
    observed_groups = observed_groups or {}
    children = [
        build_config_map(job, namespace, owner),
        build_weightchannel(job, namespace, owner),
        build_trainer_service(job, namespace, owner),
        build_trainer_statefulset(job, namespace, owner, catalog),
        build_router_service(job, namespace, owner),
        build_router_deployment(job, namespace, owner),
    ]
    for g in job.spec.sampler_groups:
        name = n.samplergroup_name(job.name, g.name)
        children.append(build_samplergroup(job, g, namespace, owner, observed_groups.get(name)))
    return children


# --- SamplerGroup children -----------------------------------------------------------------------------


def build_sampler_service(sg: SamplerGroup, namespace: str, owner: Manifest | None) -> Manifest:
    """Headless Service per group: DNS returns every ready replica (the router picks per replica)."""
    name = sg.metadata.name or ""
    labels = _sampler_labels(sg)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, namespace, labels, owner),
        "spec": {
            "clusterIP": "None",
            "selector": n.sampler_selector(name),
            "ports": [
                {"name": "http", "port": sg.spec.port, "targetPort": sg.spec.port},
                {"name": "sync", "port": n.SYNC_PORT, "targetPort": n.SYNC_PORT},
            ],
        },
    }


def _sampler_labels(sg: SamplerGroup) -> dict[str, str]:
    job = sg.spec.job_name or sg.metadata.name or ""
    return {
        **n.job_labels(job, "sampler"),
        n.LABEL_GROUP: sg.spec.name,
        n.LABEL_SAMPLERGROUP: sg.metadata.name or "",
        n.LABEL_ACCELERATOR: sg.spec.accelerator,
        n.LABEL_WEIGHT_FORMAT: sg.spec.weight_format,
    }


def build_sampler_deployment(sg: SamplerGroup, namespace: str, owner: Manifest | None, catalog: Catalog,
                             store: StoreSpec | None) -> Manifest:  # fmt: skip
    """SGLang pods of one group: class affinity + GPU toleration, TP GPUs, flags from the catalog,
    health probes, Prometheus annotations, the weight-sync sidecar, restricted security context."""
    name = sg.metadata.name or ""
    spec = sg.spec
    cls = catalog.get(spec.accelerator)
    from_channel = bool(spec.weight_channel) and store is not None
    if from_channel:
        # The engine (SGLang, or the reference engine of a CPU class) starts from the checkpoint the init
        # container fetched and verified: the newest version of this group's view (its format), never
        # spec.model.path (docs/weights.md).
        launch = engine_launch_for_group(
            spec, catalog, model_path=MODEL_DIR_REF, weight_version=WEIGHT_VERSION_REF
        )
        engine_command = launch_from_file(launch.argv, f"{n.WEIGHTS_CACHE}/{LAUNCH_FILE}")
        command, args = engine_command[:2], engine_command[2:]
    else:  # a standalone group serves one fixed checkpoint, which must already be in its format
        launch = engine_launch_for_group(spec, catalog, model_path=spec.model.path, weight_version=0)
        engine_command = launch.argv
        # SGLang: ["python3", "-m", "sglang.launch_server"]; the reference engine: ["rlfleet"]
        split = 3 if cls.engine == "sglang" else 1
        command, args = engine_command[:split], engine_command[split:]
    labels = _sampler_labels(sg)
    port = spec.port
    volumes = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi" if cls.gpu else "1Gi"}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "weights-cache", "emptyDir": {}},
    ]
    engine_mounts = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "weights-cache", "mountPath": n.WEIGHTS_CACHE},
    ]
    sync_mounts = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "weights-cache", "mountPath": n.WEIGHTS_CACHE},
    ]
    store_envs: list[dict[str, Any]] = []
    if store is not None:
        # read-write: the sync containers write their subscriber reports (subscribers/<group>/<pod>.json,
        # docs/weights.md) next to the versions they read; SGLang does not mount the store at all
        store_vols, store_mounts = store_volume(store, read_only=False)
        volumes += store_vols
        sync_mounts += store_mounts  # only the sync side reads the store; SGLang reads the verified cache
        store_envs = store_env(store)
    env = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        *({"name": k, "value": v} for k, v in sorted(launch.env.items())),
    ]
    if from_channel:  # everything SGLang loads is local and verified: never reach for the Hub
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    engine = {
        "name": cls.engine,  # "sglang", or "reference" on a CPU class
        "image": spec.images.sampler,
        "imagePullPolicy": spec.images.pull_policy,
        "command": command,
        "args": args,
        "env": env,
        "ports": [{"name": "http", "containerPort": port}],
        "startupProbe": {
            # model load + CUDA graph capture can take many minutes on big models
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": 10,
            "failureThreshold": 180,
        },
        "readinessProbe": {
            "httpGet": {"path": "/health_generate", "port": port},
            "periodSeconds": 15,
            "timeoutSeconds": 10,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": 30,
            "timeoutSeconds": 10,
            "failureThreshold": 5,
        },
        "resources": container_resources(
            class_resources(cls.sampler_resources, launch.tensor_parallel if cls.gpu else 0), spec
        ),
        "volumeMounts": engine_mounts,
        "securityContext": dict(RESTRICTED_CONTAINER),
    }
    containers = [engine]
    init_containers: list[dict[str, Any]] = []
    if from_channel and store is not None:
        sync_args = [
            "sampler",
            "sync",
            "--store",
            store_uri(store),
            "--view",
            spec.weight_format,
            "--engine-url",
            f"http://127.0.0.1:{port}",
            "--group",
            name,
            "--replica",
            "$(POD_NAME)",
            "--cache-dir",
            n.WEIGHTS_CACHE,
            "--require-checkpoint",
        ]  # fmt: skip
        sync_env = [
            {"name": "HOME", "value": "/tmp"},
            {"name": "HF_HOME", "value": HF_HOME},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            *store_envs,
        ]
        sync_security = {**RESTRICTED_CONTAINER, "readOnlyRootFilesystem": True}
        init_containers.append(
            {
                # waits for the newest version of the view (version 0 comes from the base checkpoint
                # before the trainer's first step), downloads + verifies it, writes the launch file
                "name": "weight-fetch",
                "image": spec.images.sync,
                "imagePullPolicy": spec.images.pull_policy,
                "command": ["rlfleet"],
                "args": [*sync_args, "--fetch-only"],
                "env": sync_env,
                "resources": copy.deepcopy(cls.sync_resources),
                "volumeMounts": sync_mounts,
                "securityContext": sync_security,
            }
        )
        containers.append(
            {
                "name": "weight-sync",
                "image": spec.images.sync,
                "imagePullPolicy": spec.images.pull_policy,
                "command": ["rlfleet"],
                "args": [*sync_args, "--port", str(n.SYNC_PORT)],
                "env": sync_env,
                "ports": [{"name": "sync", "containerPort": n.SYNC_PORT}],
                "readinessProbe": {"httpGet": {"path": "/health", "port": n.SYNC_PORT}, "periodSeconds": 10},
                "resources": copy.deepcopy(cls.sync_resources),
                "volumeMounts": sync_mounts,
                "securityContext": sync_security,
            }
        )
    replicas = 0 if spec.suspend else spec.replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, namespace, labels, owner),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": n.sampler_selector(name)},
            # GPUs are scarce: never surge, replace one replica at a time
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {
                "metadata": pod_template_metadata(
                    labels,
                    {n.ANN_PROM_SCRAPE: "true", n.ANN_PROM_PORT: str(port), n.ANN_PROM_PATH: "/metrics"},
                    spec,
                ),
                "spec": {
                    **_optional("affinity", pod_affinity(spec, catalog, spec.accelerator)),
                    **_optional("tolerations", pod_tolerations(spec, gpu=cls.gpu)),
                    **pod_placement_spec(spec),
                    "securityContext": pod_security_context(),
                    "automountServiceAccountToken": False,
                    "terminationGracePeriodSeconds": 60,
                    **({"initContainers": init_containers} if init_containers else {}),
                    "containers": containers,
                    "volumes": volumes,
                },
            },
        },
    }


def build_samplergroup_children(sg: SamplerGroup, namespace: str, owner: Manifest | None, catalog: Catalog,
                                store: StoreSpec | None) -> list[Manifest]:  # fmt: skip
    return [
        build_sampler_service(sg, namespace, owner),
        build_sampler_deployment(sg, namespace, owner, catalog, store),
    ]
