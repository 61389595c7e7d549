"""Shared pieces of the API models: the base class, enums, conditions, and small helpers.

Every model is camelCase on the wire (YAML / Kubernetes) and snake_case in Python. Field docstrings
become the `description` of every CRD field (pydantic `use_attribute_docstrings`), so the docstring
IS the user documentation: write it for the person reading `kubectl explain`.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "rlfleet.dev"
VERSION = "v1alpha1"
API_VERSION: Literal["rlfleet.dev/v1alpha1"] = (
    "rlfleet.dev/v1alpha1"  # GROUP/VERSION, typed as the models' apiVersion
)

# Weight formats a sampler group can serve (each is a published precision view of the channel).
WeightFormat = Literal["bf16", "fp8", "nvfp4", "mxfp4"]
WEIGHT_FORMATS: tuple[str, ...] = ("bf16", "fp8", "nvfp4", "mxfp4")


def views_to_publish(weight_formats: Iterable[str]) -> list[str]:
    """The one rule for the precision views a weight channel publishes for every version: each weight
    format a sampler group of the job names, once, in canonical order (WEIGHT_FORMATS). A group at 0
    replicas counts too: scaled up later, it launches from its view, which a trainer already running
    must have been publishing (docs/weights.md, "Views")."""
    wanted = set(weight_formats)
    unknown = wanted - set(WEIGHT_FORMATS)
    if unknown:
        raise ValueError(f"unknown weight format(s) {sorted(unknown)}; known: {list(WEIGHT_FORMATS)}")
    return [f for f in WEIGHT_FORMATS if f in wanted]


# SGLang --kv-cache-dtype values (auto = the model dtype).
KvCacheDtype = Literal["auto", "bf16", "fp8_e4m3", "fp8_e5m2", "mxfp8", "nvfp4"]
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "bf16", "fp8_e4m3", "fp8_e5m2", "mxfp8", "nvfp4")
CorrectionMode = Literal["sc-mis-topp", "sc-mis", "mis", "sc", "none"]
RouterPolicy = Literal["throughput", "cost", "static"]
SafetyAction = Literal["alert", "quarantine-group", "pause"]
ConditionStatus = Literal["True", "False", "Unknown"]

# Kubernetes object names used as prefixes of child names: the job name + "-" + group name must fit a
# DNS-1035 label (63) because it names the group's Service.
DNS_LABEL_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# DNS-1123 subdomain: names of Secrets, PersistentVolumeClaims, WeightChannels.
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
MAX_JOB_NAME = 38
MAX_GROUP_NAME = 24
# Suffixes of the job's own children (<job>-trainer Service and StatefulSet, <job>-router Service and
# Deployment, <job>-config, <job>-weights, <job>-router-admin): a sampler group of the same name would
# collide with them (operator/naming.py builds the names; a test checks the two agree).
RESERVED_GROUP_NAMES: tuple[str, ...] = ("trainer", "router", "router-admin", "config", "weights")
# The environment variable that carries a job's engine API key in its pods (from the `<job>-api-key`
# Secret by secretKeyRef): SGLang's and the reference engine's `--api-key $(RLFLEET_API_KEY)`, the
# sidecar, the router (data plane) and the trainer present it (docs/sampler.md, "The engine API").
ENGINE_API_KEY_ENV = "RLFLEET_API_KEY"
# How a sidecar's subscriber report (last_error) begins when its engine served weights the sidecar had not
# applied and it applied the channel's version again (sampler/syncer.py); the operator's SamplerGroup
# status shows it as reason ForeignWeightVersion (operator/group_status.py).
FOREIGN_WEIGHTS_PREFIX = "foreign weight version:"
# The channel's directory of subscriber reports (subscribers/<group>/<replica>.json, rlfleet/channel.py):
# the only part of a filesystem store a sampler pod may write (operator/podspec.py sampler_store_volume).
SUBSCRIBERS_DIR = "subscribers"
# Port of the weight-sync sidecar in every sampler pod (SGLang must listen elsewhere).
SYNC_SIDECAR_PORT = 9400
# A Kubernetes resource quantity (apimachinery resource.Quantity): "16", 128Gi, 500m, 1e3.
QUANTITY_PATTERN = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[mkMGTPE]|[eE][+-]?[0-9]+)?$"
HTTP_URL_PATTERN = r"^https?://[^\s/]+(/\S*)?$"
# Sampling-mask cap of SGLang (`--sampling-mask-max-tokens`, default 4096): a finite top_k must fit it.
MAX_TOP_K = 4096


class ApiModel(BaseModel):
    """Base of every API model: camelCase aliases, unknown fields rejected, docstrings as descriptions."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=False,
    )

    def to_wire(self) -> dict[str, Any]:
        """JSON-able dict with camelCase keys, unset optional fields left out (what goes to the API)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def cel_rules(*rules: dict[str, Any]) -> ConfigDict:
    """A model's config holding its CEL rules (`x-kubernetes-validations` of its schema; each rule: rule,
    message and, where it names one field, its fieldPath)."""
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": list(rules)})


class Condition(ApiModel):
    """A Kubernetes-style condition (metav1.Condition)."""

    type: str = Field(max_length=64)
    """Condition type: Ready, Progressing, Degraded or CollapseRisk."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: str = Field(default="", max_length=128)
    """Machine-readable CamelCase reason of the last transition."""
    message: str = Field(default="", max_length=4096)
    """Human-readable explanation."""
    last_transition_time: datetime | None = None
    """When the status last changed."""
    observed_generation: int | None = Field(default=None, ge=0)
    """metadata.generation of the spec this condition was computed from."""


def conditions_field() -> Any:
    """A conditions list: a map keyed by type (merge-friendly for server-side apply)."""
    return Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class LocalObjectReference(ApiModel):
    """Reference to an object in the same namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """Name of the referenced object (e.g. a Secret)."""


def cel_list(values: tuple[str, ...] | list[str]) -> str:
    """A CEL list literal of strings."""
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


def kube_manifest_check(manifest: Any, kind: str) -> dict[str, Any]:
    """Check the envelope of a manifest (apiVersion/kind); return it as a dict. Clear errors."""
    if not isinstance(manifest, dict):
        raise ValueError(f"{kind} manifest must be a mapping, got {type(manifest).__name__}")
    api_version = manifest.get("apiVersion")
    if api_version != API_VERSION:
        raise ValueError(f"{kind} manifest: apiVersion must be {API_VERSION!r}, got {api_version!r}")
    if manifest.get("kind") != kind:
        raise ValueError(f"manifest kind must be {kind!r}, got {manifest.get('kind')!r}")
    return manifest
