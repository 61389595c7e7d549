"""PURE workloads: what each pod the operator builds runs (containers, commands, env, probes, volumes),
placed and secured by podspec.py.

- the trainer StatefulSet: torchrun ranks, one pod per trainer replica, rendezvous on pod 0, one gang;
- the router Deployment: `rlfleet router serve` on the job's ConfigMap and admin token;
- a sampler group's Deployment: the engine (SGLang, or the reference engine of a CPU class), the
  weight-fetch init container and the weight-sync sidecar.

Every env var set here has a reader: the program in the container, or the container's own args
(`$(VAR)` is expanded by the kubelet).

The job's engine API key (RLFLEET_API_KEY, from the `<job>-api-key` Secret by secretKeyRef: never a value
in a spec) reaches the engine as `--api-key $(RLFLEET_API_KEY)` and is presented by the sidecar, the router
(to the engines, and required from its clients) and the trainer (docs/sampler.md, "The engine API").
"""

from __future__ import annotations

import copy
from typing import Any

from rlfleet.api import RLJob, SamplerGroup, StoreSpec
from rlfleet.api.scheduling import (
    KUEUE_POD_GROUP_COUNT_ANNOTATION,
    KUEUE_POD_GROUP_LABEL,
    KUEUE_POD_GROUP_SERVING_ANNOTATION,
    KUEUE_QUEUE_LABEL,
)
from rlfleet.catalog import (
    LAUNCH_FILE,
    MODEL_DIR_REF,
    WEIGHT_VERSION_REF,
    Catalog,
    engine_launch_for_group,
    launch_from_file,
)
from rlfleet.operator import naming as n
from rlfleet.operator.config_files import router_config
from rlfleet.operator.podspec import (
    HF_HOME,
    RESTRICTED_CONTAINER,
    class_resources,
    container_env,
    container_resources,
    optional,
    pod_affinity,
    pod_identity_spec,
    pod_placement_spec,
    pod_security_context,
    pod_template_metadata,
    pod_tolerations,
    sampler_store_volume,
    spec_hash,
    store_env,
    store_volume,
    user_volumes,
)
from rlfleet.operator.sandboxes import trainer_pod_identity
from rlfleet.store.factory import spec_uri

Manifest = dict[str, Any]

# A container that fails with an empty termination message gets its last log lines there (the kubelet
# keeps the tail), so the operator's CrashLoopBackOff reason carries the error itself (operator/pods.py).
TERMINATION_MESSAGE_POLICY = "FallbackToLogsOnError"


def api_key_env(secret: str) -> dict[str, Any]:
    """RLFLEET_API_KEY by reference to the key Secret (the pod waits for the Secret if it is not there yet)."""
    return {
        "name": n.API_KEY_ENV,
        "valueFrom": {"secretKeyRef": {"name": secret, "key": n.API_KEY_SECRET_KEY}},
    }


def sampler_api_key_secret(sg: SamplerGroup) -> str:
    """The key Secret of a group's pods: its job's, or its own outside any job."""
    return n.api_key_secret_name(sg.spec.job_name or sg.metadata.name or "")


def sampler_labels(sg: SamplerGroup) -> dict[str, str]:
    """The labels of a group's Deployment, Service and pods."""
    job = sg.spec.job_name or sg.metadata.name or ""
    return n.sampler_labels(
        job, sg.spec.name, sg.metadata.name or "", sg.spec.accelerator, sg.spec.weight_format
    )


# --- trainer -------------------------------------------------------------------------------------------


HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"


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
    extra_volumes, extra_mounts = user_volumes(t)
    master = f"{name}-0.{name}.{namespace}.svc"
    gang_labels, gang_annotations, gang_anti = trainer_gang(job)
    cls = catalog.get(t.accelerator)
    ranks = t.ranks_per_replica
    sandbox_identity, sandbox_env = trainer_pod_identity(job)  # sandbox pods: API rights, its own identity
    env: list[dict[str, Any]] = [
        {"name": "RLFLEET_JOB", "value": job.name},  # the rendezvous id ($(RLFLEET_JOB) in the args)
        {"name": "RLFLEET_CONFIG", "value": f"{n.CONFIG_MOUNT}/{n.CONFIG_FILE}"},  # trainer/entrypoint.py
        {
            "name": "RLFLEET_ROUTER_URL",
            "value": f"http://{n.router_name(job.name)}.{namespace}.svc:{n.ROUTER_PORT}",
        },
        api_key_env(n.api_key_secret_name(job.name)),  # the router requires it (trainer/entrypoint.py)
        {"name": "NNODES", "value": str(t.replicas)},
        {"name": "NPROC_PER_NODE", "value": str(ranks)},
        {
            "name": "NODE_RANK",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
        },
        {"name": "MASTER_ADDR", "value": master},
        {"name": "MASTER_PORT", "value": str(n.TRAINER_RDZV_PORT)},
        # the class's device: "cuda" (nccl) on a GPU class, "cpu" (gloo) on a CPU class (trainer/entrypoint.py)
        {"name": "RLFLEET_TRAINER_DEVICE", "value": "cuda" if cls.gpu else "cpu"},
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": HF_HOME},
        *store_env(store),
        *sandbox_env,
    ]
    config_file = f"{n.CONFIG_MOUNT}/{n.CONFIG_FILE}"
    command, args = (
        # an external trainer (slime): the bridge publishes its versions into the channel (docs/slime.md)
        (
            ["rlfleet"],
            ["slime", "bridge", "--config", config_file, "--metrics-port", str(n.TRAINER_METRICS_PORT)],
        )
        if t.external is not None
        # torchrun, but the container exits with the failed rank's code (trainer/launch.py)
        else (
            ["rlfleet", "trainer", "launch"],
            [
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
                config_file,
            ],
        )
    )
    container = {
        "name": "trainer",
        "image": t.image,
        "imagePullPolicy": job.spec.sampler_images.pull_policy,
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
        "command": command,
        "args": args,
        **container_env(env, t),
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
            *extra_mounts,
        ],
        "securityContext": dict(RESTRICTED_CONTAINER),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": n.object_meta(name, namespace, labels, owner),
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
                    **optional(
                        "affinity", pod_affinity(t, catalog, t.accelerator, own_anti_affinity=gang_anti)
                    ),
                    **optional("tolerations", pod_tolerations(t, gpu=cls.gpu)),
                    **pod_placement_spec(t),
                    "securityContext": pod_security_context(),
                    **pod_identity_spec(t),
                    **sandbox_identity,
                    "terminationGracePeriodSeconds": 120,
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": n.config_name(job.name)}},
                        {
                            "name": "dshm",
                            "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi" if cls.gpu else "1Gi"},
                        },
                        {"name": "tmp", "emptyDir": {}},
                        *volumes,
                        *extra_volumes,
                    ],
                },
            },
        },
    }


# --- router --------------------------------------------------------------------------------------------


def build_router_deployment(job: RLJob, namespace: str, owner: Manifest | None) -> Manifest:
    r = job.spec.router
    labels = n.job_labels(job.name, "router")
    secret = r.admin_token_secret or n.router_secret_name(job.name)
    config_hash = spec_hash(router_config(job, namespace))
    probe = {"httpGet": {"path": "/health", "port": n.ROUTER_PORT}, "periodSeconds": 10, "timeoutSeconds": 3}
    extra_volumes, extra_mounts = user_volumes(r)
    container = {
        "name": "router",
        "image": r.image,
        "imagePullPolicy": job.spec.sampler_images.pull_policy,
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
        "command": ["rlfleet"],
        "args": ["router", "serve", "--config", f"{n.CONFIG_MOUNT}/{n.ROUTER_CONFIG_FILE}"],
        "ports": [{"name": "http", "containerPort": n.ROUTER_PORT}],
        "readinessProbe": probe,
        "livenessProbe": {**probe, "failureThreshold": 6},
        "resources": container_resources(
            {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}, r
        ),
        # the key the router requires from its clients and presents to the engines (router.yaml apiKeyEnv)
        **container_env([{"name": "HOME", "value": "/tmp"}, api_key_env(n.api_key_secret_name(job.name))], r),
        "volumeMounts": [
            {"name": "config", "mountPath": n.CONFIG_MOUNT, "readOnly": True},
            {"name": "admin-token", "mountPath": n.ROUTER_TOKEN_MOUNT, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            *extra_mounts,
        ],
        "securityContext": {**RESTRICTED_CONTAINER, "readOnlyRootFilesystem": True},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": n.object_meta(n.router_name(job.name), namespace, labels, owner),
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": {n.LABEL_JOB: job.name, n.LABEL_COMPONENT: "router"}},
            "template": {
                "metadata": pod_template_metadata(
                    labels,
                    {
                        n.ANN_CONFIG_HASH: config_hash,
                        n.ANN_PROM_SCRAPE: "true",
                        n.ANN_PROM_PORT: str(n.ROUTER_PORT),
                        n.ANN_PROM_PATH: "/metrics",
                    },
                    r,
                ),
                "spec": {
                    **optional("affinity", pod_affinity(r, None, None)),
                    **optional("tolerations", pod_tolerations(r, gpu=False)),
                    **pod_placement_spec(r),
                    "securityContext": pod_security_context(),
                    **pod_identity_spec(r),
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": n.config_name(job.name)}},
                        {"name": "admin-token", "secret": {"secretName": secret}},
                        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
                        *extra_volumes,
                    ],
                },
            },
        },
    }


# --- sampler group -------------------------------------------------------------------------------------


def build_sampler_deployment(
    sg: SamplerGroup, namespace: str, owner: Manifest | None, catalog: Catalog, store: StoreSpec | None
) -> Manifest:
    """SGLang pods of one group: class affinity + GPU toleration, TP GPUs, flags from the catalog,
    health probes, Prometheus annotations, the weight-sync sidecar, restricted security context."""
    name = sg.metadata.name or ""
    spec = sg.spec
    cls = catalog.get(spec.accelerator)
    from_channel = bool(spec.weight_channel) and store is not None
    # the engine's API closed by the key (SGLang's and the reference engine's --api-key; the kubelet expands
    # $(VAR) from the env, so the key is in no spec); /health*, /metrics stay open for probes and Prometheus
    key_args = ["--api-key", f"$({n.API_KEY_ENV})"]
    if from_channel:
        # The engine (SGLang, or the reference engine of a CPU class) starts from the checkpoint the init
        # container fetched and verified: the newest version of this group's view (its format), never
        # spec.model.path (docs/weights.md). SGLang also takes the flags that checkpoint calls for, which
        # the launch file names (a mixture of experts: --enable-return-routed-experts), since the model
        # is not known here; the reference engine needs none.
        launch = engine_launch_for_group(
            spec, catalog, model_path=MODEL_DIR_REF, weight_version=WEIGHT_VERSION_REF
        )
        engine_command = launch_from_file(
            [*launch.argv, *key_args],
            f"{n.WEIGHTS_CACHE}/{LAUNCH_FILE}",
            checkpoint_flags=cls.engine == "sglang",
        )
        command, args = engine_command[:2], engine_command[2:]
    else:  # a standalone group serves one fixed checkpoint, which must already be in its format
        launch = engine_launch_for_group(spec, catalog, model_path=spec.model.path, weight_version=0)
        engine_command = [*launch.argv, *key_args]
        # SGLang: ["python3", "-m", "sglang.launch_server"]; the reference engine: ["rlfleet"]
        split = 3 if cls.engine == "sglang" else 1
        command, args = engine_command[:split], engine_command[split:]
    labels = sampler_labels(sg)
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
        # the channel read-only, writable only the group's own subscriber reports (subscribers/<group>/,
        # docs/weights.md); SGLang does not mount the store at all
        store_vols, store_mounts = sampler_store_volume(store, name)
        volumes += store_vols
        sync_mounts += store_mounts  # only the sync side reads the store; SGLang reads the verified cache
        store_envs = store_env(store, sampler=True)
    # the user's volumes are mounted in the engine only; their env reaches every container (an S3 store
    # reached by the sync side may need it: a CA bundle path, a proxy, workload identity's settings)
    extra_volumes, extra_mounts = user_volumes(spec)
    volumes += extra_volumes
    engine_mounts += extra_mounts
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        api_key_env(sampler_api_key_secret(sg)),
        *({"name": k, "value": v} for k, v in sorted(launch.env.items())),
    ]
    if from_channel:  # everything SGLang loads is local and verified: never reach for the Hub
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    engine = {
        "name": cls.engine,  # "sglang", or "reference" on a CPU class
        "image": spec.images.sampler,
        "imagePullPolicy": spec.images.pull_policy,
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
        "command": command,
        "args": args,
        **container_env(env, spec),
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
            spec_uri(store),  # the sidecar's --store (credentials stay in the env)
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
            *(["--lora"] if spec.lora is not None else []),  # the view is the base; versions are adapters
        ]
        sync_env: list[dict[str, Any]] = [
            {"name": "HOME", "value": "/tmp"},
            {"name": "HF_HOME", "value": HF_HOME},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            api_key_env(sampler_api_key_secret(sg)),  # presented on every engine call (sampler/sync.py)
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
                "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
                "command": ["rlfleet"],
                "args": [*sync_args, "--fetch-only"],
                **container_env(sync_env, spec),
                "resources": copy.deepcopy(cls.sync_resources),
                "volumeMounts": sync_mounts,
                "securityContext": sync_security,
            }
        )
        containers.append(
            {
                "name": n.SYNC_CONTAINER,
                "image": spec.images.sync,
                "imagePullPolicy": spec.images.pull_policy,
                "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
                "command": ["rlfleet"],
                "args": [*sync_args, "--port", str(n.SYNC_PORT)],
                **container_env(sync_env, spec),
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
        "metadata": n.object_meta(name, namespace, labels, owner),
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
                    **optional("affinity", pod_affinity(spec, catalog, spec.accelerator, spot=spec.spot)),
                    **optional(
                        "tolerations",
                        pod_tolerations(
                            spec, gpu=cls.gpu, spot=catalog.spot.toleration_wire() if spec.spot else None
                        ),
                    ),
                    **pod_placement_spec(spec),
                    "securityContext": pod_security_context(),
                    **pod_identity_spec(spec),
                    "terminationGracePeriodSeconds": 60,
                    **({"initContainers": init_containers} if init_containers else {}),
                    "containers": containers,
                    "volumes": volumes,
                },
            },
        },
    }
