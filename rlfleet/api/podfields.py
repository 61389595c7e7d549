"""Pod template fields every rlfleet pod role shares besides its placement: env and envFrom (secrets by
reference only), imagePullSecrets, serviceAccountName, extra volumes and volumeMounts
(docs/operations.md, "Gated models and private registries").

The models mirror the core/v1 types they become (EnvVar, EnvFromSource, Volume, VolumeMount), a subset
typed so that `kubectl apply` and `rlfleet run --local` refuse bad input before the operator builds a
pod. The operator ADDS them to what it owns and refuses what would collide with it: the env names it
sets (RLFLEET_*, torchrun's, HOME / HF_HOME, the weight store's AWS_*), its volume names and its mount
paths. A literal value for a name that looks like a secret (HF_TOKEN, WANDB_API_KEY, ...) is refused:
it would sit in the RLJob, its SamplerGroups and every pod spec for anyone who may read them.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from rlfleet.api.common import (
    DNS_SUBDOMAIN_PATTERN,
    QUANTITY_PATTERN,
    ApiModel,
    LocalObjectReference,
    cel_list,
    cel_rules,
)

# Env the operator sets on some role's containers (operator/workloads.py; a test builds every workload
# and checks each name it sets is here or comes from the catalog's launch env).
OPERATOR_ENV_PREFIX = "RLFLEET_"
OPERATOR_ENV_NAMES: tuple[str, ...] = (
    "HOME", "HF_HOME", "HF_HUB_OFFLINE", "POD_NAME",
    "NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",
)  # fmt: skip
# Volumes and mount paths of the operator's pods (operator/naming.py and workloads.py; the same test
# keeps them covered). A user mount at one of these paths or under the operator's own directories would
# hide what the operator mounts there.
OPERATOR_VOLUME_NAMES: tuple[str, ...] = ("config", "admin-token", "dshm", "tmp", "weights", "weights-cache")
OPERATOR_MOUNT_PATHS: tuple[str, ...] = (
    "/etc/rlfleet/run", "/etc/rlfleet/router-admin", "/var/lib/rlfleet/weights", "/dev/shm", "/tmp",
)  # fmt: skip
OPERATOR_MOUNT_DIRS: tuple[str, ...] = ("/etc/rlfleet/", "/var/lib/rlfleet/")

ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# A name segment that says "secret": HF_TOKEN, WANDB_API_KEY, DB_PASSWORD, AWS_SECRET_ACCESS_KEY
# (not TOKENIZERS_PARALLELISM: the segment must end at '_' or the end).
SECRET_NAME_PATTERN = (
    r"(?i)(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?|APIKEY|API_KEY|ACCESS_KEY|PRIVATE_KEY)(_|$)"
)
MOUNT_PATH_PATTERN = r"^/[^:]*$"

ENV_RESERVED_RULE = (
    f"!self.name.startsWith('{OPERATOR_ENV_PREFIX}') && !(self.name in {cel_list(OPERATOR_ENV_NAMES)})"
)
ENV_RESERVED_MESSAGE = (
    f"env must not set the names the operator sets ({OPERATOR_ENV_PREFIX}*, {', '.join(OPERATOR_ENV_NAMES)}): "
    "torchrun, the cache paths and the programs read them; the weight store's AWS_* come from "
    "weightChannel.store (secretRef, region, endpoint)"
)
ENV_SECRET_RULE = f"!has(self.value) || self.value == '' || !self.name.matches('{SECRET_NAME_PATTERN}')"
ENV_SECRET_MESSAGE = (
    "env: a name that looks like a secret (…TOKEN, …SECRET, …PASSWORD, …API_KEY, …) takes no literal value: "
    "it would be readable in the RLJob, its SamplerGroups and the pod specs; use valueFrom.secretKeyRef "
    "(or envFrom secretRef)"
)
ENV_ONE_SOURCE_RULE = "!(has(self.value) && has(self.valueFrom))"
ENV_ONE_SOURCE_MESSAGE = "env: set value or valueFrom, not both"
ONE_OF_RULE = "[{}].filter(x, x).size() == 1"
VOLUME_RESERVED_RULE = f"!(self.name in {cel_list(OPERATOR_VOLUME_NAMES)})"
VOLUME_RESERVED_MESSAGE = f"volumes must not use the operator's volume names ({', '.join(OPERATOR_VOLUME_NAMES)}): pick another name"
MOUNT_RESERVED_RULE = (
    f"!(self.mountPath in {cel_list(OPERATOR_MOUNT_PATHS)}) && "
    f"!{cel_list(OPERATOR_MOUNT_DIRS)}.exists(d, self.mountPath.startsWith(d))"
)
MOUNT_RESERVED_MESSAGE = (
    f"volumeMounts must not mount at the operator's paths ({', '.join(OPERATOR_MOUNT_PATHS)}) or under "
    f"{' or '.join(OPERATOR_MOUNT_DIRS)}: the operator mounts the run config, tokens, weights and scratch "
    "space there (a subdirectory of /tmp, e.g. /tmp/huggingface for a model cache volume, is fine)"
)
MOUNT_VOLUME_RULE = "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && self.volumes.exists(v, v.name == m.name))"
MOUNT_VOLUME_MESSAGE = "volumeMounts: every mount names a volume of the same role's volumes"
# The object-level rules of the fields below: every model that inherits them and sets its own
# x-kubernetes-validations lists them too (pydantic replaces a parent's json_schema_extra).
POD_FIELDS_RULES: list[Any] = [
    {"rule": MOUNT_VOLUME_RULE, "message": MOUNT_VOLUME_MESSAGE, "fieldPath": ".volumeMounts"},
]

Quantity = Annotated[str, Field(max_length=64, pattern=QUANTITY_PATTERN)]
EnvName = Annotated[str, Field(min_length=1, max_length=128, pattern=ENV_NAME_PATTERN)]
ObjectName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)]
KeyName = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")]


def _one_of_rule(names: list[str], message: str) -> dict[str, Any]:
    """The CEL rule: exactly one of the (camelCase) fields is set."""
    return {"rule": ONE_OF_RULE.format(", ".join(f"has(self.{n})" for n in names)), "message": message}


def _one_of(names: list[str], message: str) -> ConfigDict:
    return cel_rules(_one_of_rule(names, message))


def _check_one_of(model: ApiModel, fields: tuple[str, ...], message: str) -> None:
    if sum(getattr(model, f) is not None for f in fields) != 1:
        raise ValueError(message)


class SecretKeySelector(ApiModel):
    """One key of a Secret in the pod's namespace (core/v1 SecretKeySelector)."""

    name: ObjectName
    """Secret name."""
    key: KeyName
    """Key in the Secret."""
    optional: bool | None = None
    """Start the container even when the Secret or key is missing."""


class ConfigMapKeySelector(ApiModel):
    """One key of a ConfigMap in the pod's namespace (core/v1 ConfigMapKeySelector)."""

    name: ObjectName
    """ConfigMap name."""
    key: KeyName
    """Key in the ConfigMap."""
    optional: bool | None = None
    """Start the container even when the ConfigMap or key is missing."""


class ObjectFieldSelector(ApiModel):
    """A field of the pod (core/v1 ObjectFieldSelector), e.g. metadata.namespace or spec.nodeName."""

    field_path: str = Field(min_length=1, max_length=256)
    """Path of the field."""


_ENV_SOURCE_MESSAGE = "env valueFrom: set exactly one of secretKeyRef, configMapKeyRef, fieldRef"


class EnvVarSource(ApiModel):
    """Where an env value comes from: a Secret key, a ConfigMap key or a pod field."""

    model_config = _one_of(["secretKeyRef", "configMapKeyRef", "fieldRef"], _ENV_SOURCE_MESSAGE)

    secret_key_ref: SecretKeySelector | None = None
    """A key of a Secret (the way to pass tokens and keys)."""
    config_map_key_ref: ConfigMapKeySelector | None = None
    """A key of a ConfigMap."""
    field_ref: ObjectFieldSelector | None = None
    """A field of the pod."""

    @model_validator(mode="after")
    def _check(self) -> EnvVarSource:
        _check_one_of(self, ("secret_key_ref", "config_map_key_ref", "field_ref"), _ENV_SOURCE_MESSAGE)
        return self


class EnvVar(ApiModel):
    """One environment variable of the role's containers (core/v1 EnvVar)."""

    model_config = cel_rules(
        {"rule": ENV_RESERVED_RULE, "message": ENV_RESERVED_MESSAGE, "fieldPath": ".name"},
        {"rule": ENV_SECRET_RULE, "message": ENV_SECRET_MESSAGE, "fieldPath": ".value"},
        {"rule": ENV_ONE_SOURCE_RULE, "message": ENV_ONE_SOURCE_MESSAGE},
    )

    name: EnvName
    """Variable name (not RLFLEET_* nor another name the operator sets)."""
    value: str | None = Field(default=None, max_length=4096)
    """A literal value (refused for names that look like secrets: use valueFrom.secretKeyRef)."""
    value_from: EnvVarSource | None = None
    """The value from a Secret key, a ConfigMap key or a pod field."""

    @model_validator(mode="after")
    def _check(self) -> EnvVar:
        if self.name.startswith(OPERATOR_ENV_PREFIX) or self.name in OPERATOR_ENV_NAMES:
            raise ValueError(f"{ENV_RESERVED_MESSAGE} (got {self.name})")
        if self.value is not None and self.value_from is not None:
            raise ValueError(ENV_ONE_SOURCE_MESSAGE)
        if self.value and looks_like_secret(self.name):
            raise ValueError(f"{ENV_SECRET_MESSAGE} (got {self.name})")
        return self


def looks_like_secret(name: str) -> bool:
    """Whether an env name has a segment that says it holds a secret (SECRET_NAME_PATTERN)."""
    return re.search(SECRET_NAME_PATTERN, name) is not None


class NamedSource(ApiModel):
    """A Secret or ConfigMap in the pod's namespace, all of whose keys become env variables."""

    name: ObjectName
    """Object name."""
    optional: bool | None = None
    """Start the container even when it is missing."""


_ENV_FROM_MESSAGE = "envFrom: set exactly one of secretRef, configMapRef"


class EnvFromSource(ApiModel):
    """Every key of a Secret or ConfigMap as env variables (core/v1 EnvFromSource). Names the operator
    sets itself keep the operator's value (Kubernetes: env wins over envFrom)."""

    model_config = _one_of(["secretRef", "configMapRef"], _ENV_FROM_MESSAGE)

    prefix: str | None = Field(default=None, max_length=253, pattern=ENV_NAME_PATTERN)
    """Prepended to every key."""
    secret_ref: NamedSource | None = None
    """A Secret."""
    config_map_ref: NamedSource | None = None
    """A ConfigMap."""

    @model_validator(mode="after")
    def _check(self) -> EnvFromSource:
        _check_one_of(self, ("secret_ref", "config_map_ref"), _ENV_FROM_MESSAGE)
        return self


class KeyToPath(ApiModel):
    """One key of a Secret or ConfigMap projected to a file (core/v1 KeyToPath)."""

    key: KeyName
    """The key."""
    path: str = Field(min_length=1, max_length=1024, pattern=r"^[^/].*$")
    """Relative file path in the volume."""


class SecretVolumeSource(ApiModel):
    """A Secret as files (core/v1 SecretVolumeSource)."""

    secret_name: ObjectName
    """Secret name."""
    items: list[KeyToPath] = Field(default_factory=list, max_length=64)
    """Only these keys, at these paths (none: every key, named by key)."""
    optional: bool | None = None
    """Start the pod even when the Secret is missing."""


class ConfigMapVolumeSource(ApiModel):
    """A ConfigMap as files (core/v1 ConfigMapVolumeSource)."""

    name: ObjectName
    """ConfigMap name."""
    items: list[KeyToPath] = Field(default_factory=list, max_length=64)
    """Only these keys, at these paths (none: every key, named by key)."""
    optional: bool | None = None
    """Start the pod even when the ConfigMap is missing."""


class PersistentVolumeClaimVolumeSource(ApiModel):
    """A PersistentVolumeClaim in the pod's namespace (e.g. a shared model cache)."""

    claim_name: ObjectName
    """Claim name."""
    read_only: bool | None = None
    """Mount read-only."""


class EmptyDirVolumeSource(ApiModel):
    """Scratch space that lives as long as the pod."""

    medium: Literal["Memory"] | None = None
    """Memory (tmpfs); unset: the node's disk."""
    size_limit: Quantity | None = None
    """Size limit, e.g. 10Gi."""


class CSIVolumeSource(ApiModel):
    """A CSI ephemeral volume, e.g. the Secrets Store CSI driver (core/v1 CSIVolumeSource)."""

    driver: str = Field(min_length=1, max_length=253)
    """CSI driver name."""
    read_only: bool | None = None
    """Mount read-only."""
    volume_attributes: dict[str, Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=dict, max_length=32
    )
    """Driver-specific attributes (e.g. secretProviderClass)."""
    node_publish_secret_ref: LocalObjectReference | None = None
    """Secret the driver reads when mounting."""


_VOLUME_SOURCE_MESSAGE = "volumes: set exactly one of secret, configMap, persistentVolumeClaim, emptyDir, csi"
_VOLUME_SOURCES = ("secret", "config_map", "persistent_volume_claim", "empty_dir", "csi")


class Volume(ApiModel):
    """An extra pod volume (core/v1 Volume; the sources above only)."""

    model_config = cel_rules(
        {"rule": VOLUME_RESERVED_RULE, "message": VOLUME_RESERVED_MESSAGE, "fieldPath": ".name"},
        _one_of_rule(
            ["secret", "configMap", "persistentVolumeClaim", "emptyDir", "csi"],
            _VOLUME_SOURCE_MESSAGE,
        ),
    )

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    """Volume name (a DNS label; not one of the operator's: config, admin-token, dshm, tmp, weights, weights-cache)."""
    secret: SecretVolumeSource | None = None
    """A Secret as files."""
    config_map: ConfigMapVolumeSource | None = None
    """A ConfigMap as files."""
    persistent_volume_claim: PersistentVolumeClaimVolumeSource | None = None
    """A PersistentVolumeClaim."""
    empty_dir: EmptyDirVolumeSource | None = None
    """Scratch space."""
    csi: CSIVolumeSource | None = None
    """A CSI ephemeral volume."""

    @model_validator(mode="after")
    def _check(self) -> Volume:
        if self.name in OPERATOR_VOLUME_NAMES:
            raise ValueError(f"{VOLUME_RESERVED_MESSAGE} (got {self.name})")
        _check_one_of(self, _VOLUME_SOURCES, _VOLUME_SOURCE_MESSAGE)
        return self


class VolumeMount(ApiModel):
    """A mount of one of the role's volumes in its main container (core/v1 VolumeMount)."""

    model_config = cel_rules(
        {"rule": MOUNT_RESERVED_RULE, "message": MOUNT_RESERVED_MESSAGE, "fieldPath": ".mountPath"}
    )

    name: str = Field(min_length=1, max_length=63)
    """Name of a volume of the same role."""
    mount_path: str = Field(min_length=1, max_length=1024, pattern=MOUNT_PATH_PATTERN)
    """Absolute path in the container."""
    sub_path: str | None = Field(default=None, max_length=1024, pattern=r"^[^/].*$")
    """Mount only this path inside the volume."""
    read_only: bool | None = None
    """Mount read-only."""

    @model_validator(mode="after")
    def _check(self) -> VolumeMount:
        path = self.mount_path.rstrip("/") or "/"
        if path in OPERATOR_MOUNT_PATHS or path.startswith(OPERATOR_MOUNT_DIRS):
            raise ValueError(f"{MOUNT_RESERVED_MESSAGE} (got {self.mount_path})")
        return self


def template_wire(model: ApiModel) -> dict[str, Any]:
    """Wire form of one env / volume / mount entry: unset fields left out, but an empty source kept
    (`emptyDir: {}` is a volume source, not an empty map to drop)."""
    return model.model_dump(mode="json", by_alias=True, exclude_defaults=True)


class PodTemplateFields(ApiModel):
    """Env, identity, registry secrets and extra volumes of one pod role (a base of PodPlacement)."""

    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """Extra environment variables of the role's containers (a sampler group's: the engine and its weight-fetch / weight-sync containers). Secrets by reference only: valueFrom.secretKeyRef, e.g. HF_TOKEN for a gated model."""
    env_from: list[EnvFromSource] = Field(default_factory=list, max_length=16)
    """Every key of a Secret or ConfigMap as env variables, on the same containers as env; names the operator sets keep its value."""
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16)
    """Secrets (kubernetes.io/dockerconfigjson) to pull the role's images from a private registry."""
    service_account_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """ServiceAccount of the pods (e.g. one bound to a cloud role: IRSA, GKE Workload Identity). Setting it mounts its token (automountServiceAccountToken: true), which workload identity reads; unset, the pods run as the namespace's default account with no token mounted."""
    volumes: list[Volume] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """Extra pod volumes (secret, configMap, persistentVolumeClaim, emptyDir, csi)."""
    volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=16)
    """Mounts of those volumes in the role's main container (the trainer, the engine, the router)."""

    @model_validator(mode="after")
    def _check_pod_fields(self) -> PodTemplateFields:
        for what, names in (("env", [e.name for e in self.env]), ("volumes", [v.name for v in self.volumes])):
            dups = sorted({x for x in names if names.count(x) > 1})
            if dups:
                raise ValueError(f"{what}: names must be unique (duplicated: {', '.join(dups)})")
        unknown = sorted({m.name for m in self.volume_mounts} - {v.name for v in self.volumes})
        if unknown:
            raise ValueError(f"{MOUNT_VOLUME_MESSAGE} (unknown: {', '.join(unknown)})")
        return self

    def pod_fields_wire(self) -> dict[str, Any]:
        """The fields that are set, in wire form (what a SamplerGroup child inherits)."""
        wire = self.model_dump(
            mode="json", by_alias=True, exclude_defaults=True, include=set(PodTemplateFields.model_fields)
        )
        return {k: v for k, v in wire.items() if v not in ([], None)}
