"""PURE builders: RLJob / SamplerGroup spec -> the child manifests (dicts ready for server-side apply).

No I/O here. Handlers read what is needed (observed SamplerGroups, the WeightChannel), call
`build_job_children` / `build_samplergroup_children`, and apply the results. The objects without pods
(ConfigMap, WeightChannel, SamplerGroups, Services, the router's and the API key's Secrets) are built here,
the NetworkPolicies in network_policies.py; the pods' workloads in workloads.py, their placement, rights and resources in podspec.py, the config files in
config_files.py, every name and label in naming.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from rlfleet.api import RLJob, SamplerGroup, SamplerGroupTemplate, StoreSpec
from rlfleet.api.common import API_VERSION
from rlfleet.catalog import Catalog
from rlfleet.operator import naming as n
from rlfleet.operator.config_files import router_config, run_config
from rlfleet.operator.network_policies import NetworkPolicySettings, build_network_policies
from rlfleet.operator.sandboxes import build_sandbox_children
from rlfleet.operator.workloads import (
    build_router_deployment,
    build_sampler_deployment,
    build_trainer_statefulset,
    sampler_labels,
)

Manifest = dict[str, Any]


# --- RLJob children ------------------------------------------------------------------------------------


def build_samplergroup(
    job: RLJob,
    group: SamplerGroupTemplate,
    namespace: str,
    owner: Manifest | None,
    weight_format: str | None = None,
    replicas: int | None = None,
) -> Manifest:
    """The SamplerGroup of one group, from the RLJob and its decisions (decide.py): `weight_format` is the
    decided one (None: the RLJob's). `replicas` only to create it (the RLJob's): after that its scale
    subresource owns them (replicas.py), and the builder leaves them out."""
    name = n.samplergroup_name(job.name, group.name)
    labels = {**n.job_labels(job.name, "sampler"), n.LABEL_GROUP: group.name}
    spec: dict[str, Any] = {
        "name": group.name,
        "accelerator": group.accelerator,
        **({"replicas": replicas} if replicas is not None else {}),
        "weightFormat": weight_format or group.weight_format,
        "kvCacheDtype": group.kv_cache_dtype,
        "extraArgs": list(group.extra_args),
        "quarantined": group.quarantined,
        "spot": group.spot,
        "jobName": job.name,
        "model": {"name": job.spec.model.name, "path": job.spec.model.path},
        "weightChannel": n.weightchannel_name(job.name),
        "suspend": job.spec.suspend,
        "images": job.spec.sampler_images.to_wire(),
    }
    if group.tensor_parallel is not None:
        spec["tensorParallel"] = group.tensor_parallel
    if group.egress_price_per_gb is not None:
        spec["egressPricePerGb"] = group.egress_price_per_gb
    if job.spec.trainer.lora is not None:  # every group serves the trainer's adapters on its own base
        spec["lora"] = job.spec.trainer.lora.to_wire()
    spec.update(group.placement_wire())
    return {
        "apiVersion": API_VERSION,
        "kind": "SamplerGroup",
        "metadata": n.object_meta(name, namespace, labels, owner),
        "spec": spec,
    }


def build_weightchannel(job: RLJob, namespace: str, owner: Manifest | None) -> Manifest:
    wc = job.spec.weight_channel
    return {
        "apiVersion": API_VERSION,
        "kind": "WeightChannel",
        "metadata": n.object_meta(
            n.weightchannel_name(job.name), namespace, n.job_labels(job.name, "weights"), owner
        ),
        "spec": {
            "jobName": job.name,
            "store": wc.store.to_wire(),
            "retention": wc.retention.to_wire(),
            "deltas": wc.deltas.to_wire(),
        },
    }


def build_config_map(job: RLJob, namespace: str, owner: Manifest | None) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": n.object_meta(
            n.config_name(job.name), namespace, n.job_labels(job.name, "config"), owner
        ),
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
        "metadata": n.object_meta(
            n.router_secret_name(job.name), namespace, n.job_labels(job.name, "router"), owner
        ),
        "type": "Opaque",
        "stringData": {"token": token},
    }


def build_api_key_secret(
    owner_name: str, namespace: str, labels: dict[str, str], owner: Manifest | None, key: str
) -> Manifest:
    """The engine API key Secret of a job (or of a SamplerGroup outside any job), created once (never
    re-applied: the key is stable). Every pod reads it by secretKeyRef (workloads.api_key_env)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": n.object_meta(n.api_key_secret_name(owner_name), namespace, labels, owner),
        "type": "Opaque",
        "stringData": {n.API_KEY_SECRET_KEY: key},
    }


def build_job_api_key_secret(job: RLJob, namespace: str, owner: Manifest | None, key: str) -> Manifest:
    return build_api_key_secret(job.name, namespace, n.job_labels(job.name, "api-key"), owner, key)


def _service(meta: Manifest, selector: dict[str, str], ports: dict[str, int], **spec: Any) -> Manifest:
    """A Service of `meta` over the pods of `selector`, each named port served on the same target port;
    `spec`: the rest of its spec (a headless one's clusterIP None)."""
    port_list = [{"name": name, "port": port, "targetPort": port} for name, port in ports.items()]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {**spec, "selector": selector, "ports": port_list},
    }


def build_trainer_service(job: RLJob, namespace: str, owner: Manifest | None) -> Manifest:
    """Headless Service: stable DNS for torchrun rendezvous (ready or not)."""
    labels = n.job_labels(job.name, "trainer")
    return _service(
        n.object_meta(n.trainer_name(job.name), namespace, labels, owner),
        {n.LABEL_JOB: job.name, n.LABEL_COMPONENT: "trainer"},
        {"rdzv": n.TRAINER_RDZV_PORT, "metrics": n.TRAINER_METRICS_PORT},
        clusterIP="None",
        publishNotReadyAddresses=True,
    )


def build_router_service(job: RLJob, namespace: str, owner: Manifest | None) -> Manifest:
    labels = n.job_labels(job.name, "router")
    return _service(
        n.object_meta(n.router_name(job.name), namespace, labels, owner),
        {n.LABEL_JOB: job.name, n.LABEL_COMPONENT: "router"},
        {"http": n.ROUTER_PORT},
    )


def build_job_children(
    job: RLJob,
    namespace: str,
    owner: Manifest | None,
    catalog: Catalog,
    observed_groups: dict[str, Manifest] | None = None,
    network: NetworkPolicySettings | None = None,
    sandbox_roles: Mapping[str, Manifest] | None = None,
    weight_formats: Mapping[str, str] | None = None,
) -> list[Manifest]:
    """Every child of an RLJob in apply order (config and trainer before samplers: the trainer asks for
    whole GPU nodes, so it should reach the scheduler before the sampler pods fragment them; the
    NetworkPolicies, with `network`, before any pod; with sandboxes in the cluster, the trainer's account,
    its RoleBinding to its backend's role (`sandbox_roles`: backend -> roleRef, operator/sandboxes.py) and
    the sandbox pods' policy before the trainer). `weight_formats`: the decided weightFormat per group
    (decide.py `Decisions.weight_formats`). A group not in `observed_groups` is created with the RLJob's
    replicas; an observed one is built without them (replicas.py).
    The Secrets are created apart, once."""
    observed_groups = observed_groups or {}
    children = [
        *build_network_policies(job, namespace, owner, network),
        *build_sandbox_children(
            job, namespace, owner, (sandbox_roles or {}).get(job.spec.rollout.sandbox.backend)
        ),
        build_config_map(job, namespace, owner),
        build_weightchannel(job, namespace, owner),
        build_trainer_service(job, namespace, owner),
        build_trainer_statefulset(job, namespace, owner, catalog),
        build_router_service(job, namespace, owner),
        build_router_deployment(job, namespace, owner),
    ]
    for g in job.spec.sampler_groups:
        name = n.samplergroup_name(job.name, g.name)
        children.append(
            build_samplergroup(
                job,
                g,
                namespace,
                owner,
                (weight_formats or {}).get(g.name),
                None if name in observed_groups else g.replicas,
            )
        )
    return children


# --- SamplerGroup children -----------------------------------------------------------------------------


def build_sampler_service(sg: SamplerGroup, namespace: str, owner: Manifest | None) -> Manifest:
    """Headless Service per group: DNS returns every ready replica (the router picks per replica)."""
    name = sg.metadata.name or ""
    return _service(
        n.object_meta(name, namespace, sampler_labels(sg), owner),
        n.sampler_selector(name),
        {"http": sg.spec.port, "sync": n.SYNC_PORT},
        clusterIP="None",
    )


def build_group_api_key_secret(
    sg: SamplerGroup, namespace: str, owner: Manifest | None, key: str
) -> Manifest:
    """The API key Secret of a SamplerGroup outside any job (a job's groups use the job's)."""
    return build_api_key_secret(sg.metadata.name or "", namespace, sampler_labels(sg), owner, key)


def build_samplergroup_children(
    sg: SamplerGroup, namespace: str, owner: Manifest | None, catalog: Catalog, store: StoreSpec | None
) -> list[Manifest]:
    return [
        build_sampler_service(sg, namespace, owner),
        build_sampler_deployment(sg, namespace, owner, catalog, store),
    ]
