"""SamplerGroup: one accelerator + precision group of SGLang sampler replicas (owned by an RLJob)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field, model_validator

from rlfleet.api.common import (
    API_VERSION,
    DNS_LABEL_PATTERN,
    MAX_GROUP_NAME,
    ApiModel,
    Condition,
    KvCacheDtype,
    WeightFormat,
    conditions_field,
    kube_manifest_check,
)
from rlfleet.api.meta import ObjectMeta

ACCELERATOR_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class SamplerGroupTemplate(ApiModel):
    """One sampler group of an RLJob: which GPU class, how many replicas, which precision."""

    name: str = Field(min_length=1, max_length=MAX_GROUP_NAME, pattern=DNS_LABEL_PATTERN)
    """Group name, unique in the job (DNS label, <= 24 characters); the SamplerGroup is named <job>-<name>."""
    accelerator: str = Field(min_length=1, max_length=63, pattern=ACCELERATOR_PATTERN)
    """Accelerator class from the catalog (a100, h100, h200, b200, b300, rtx-pro-6000, or a class added by a catalog override). Pods are placed only on nodes labelled for this class."""
    replicas: int = Field(default=1, ge=0, le=1024)
    """Number of SGLang server replicas (each with tensorParallel GPUs). 0 keeps the group defined but idle."""
    weight_format: WeightFormat = "bf16"
    """Precision of the served weights: bf16, fp8 (block-128), nvfp4 (native only on Blackwell) or mxfp4 (MoE models). The weight channel publishes this view."""
    kv_cache_dtype: KvCacheDtype = "auto"
    """SGLang --kv-cache-dtype: auto (model dtype), bf16, fp8_e4m3, fp8_e5m2, mxfp8 (sm100+) or nvfp4 (sm100/sm120)."""
    tensor_parallel: int | None = Field(default=None, ge=1, le=8)
    """GPUs per replica (SGLang --tp-size, and the nvidia.com/gpu request). Default: the class's default TP from the catalog."""
    extra_args: list[str] = Field(default_factory=list, max_length=64)
    """Extra SGLang command-line arguments appended verbatim (e.g. ["--mem-fraction-static", "0.85"])."""
    quarantined: bool = False
    """Manually quarantine the group: the router sends it no new sessions (its pods keep running)."""

    @model_validator(mode="after")
    def _check_against_catalog(self) -> SamplerGroupTemplate:
        # Same rule as the CRD's CEL (generated from the built-in catalog), but against the catalog
        # loaded at runtime, so local mode and overridden catalogs give the same clear message.
        from rlfleet import catalog

        catalog.check_group(self.accelerator, self.weight_format, self.kv_cache_dtype)
        return self


class SamplerImages(ApiModel):
    """Container images of a sampler pod."""

    sampler: str = Field(default="ghcr.io/rlfleet/sampler:0.1.0", min_length=1, max_length=512)
    """SGLang server image (FROM lmsysorg/sglang plus rlfleet[sampler])."""
    sync: str = Field(default="ghcr.io/rlfleet/sampler:0.1.0", min_length=1, max_length=512)
    """Weight-sync sidecar image (runs `rlfleet sampler sync`)."""
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """imagePullPolicy of the containers."""


class GroupModelRef(ApiModel):
    """The model a sampler group serves."""

    name: str = Field(min_length=1, max_length=253)
    """Served model name (SGLang --served-model-name)."""
    path: str = Field(min_length=1, max_length=2048)
    """Initial weights: Hugging Face id or a path on the shared volume (SGLang --model-path)."""


class SamplerGroupSpec(SamplerGroupTemplate):
    """Desired state of a SamplerGroup (written by the operator from its RLJob; may be created by hand)."""

    job_name: str | None = Field(default=None, max_length=63)
    """Name of the RLJob this group belongs to (empty for a standalone group)."""
    model: GroupModelRef
    """Model to serve."""
    weight_channel: str | None = Field(default=None, max_length=253)
    """Name of the WeightChannel the sidecar follows (none: the group serves its initial weights)."""
    suspend: bool = False
    """Scale the group's pods to zero while keeping spec.replicas (set from the RLJob's suspend)."""
    port: int = Field(default=30000, ge=1024, le=65535)
    """Port of the SGLang HTTP server in the pod."""
    sampling_mask_max_tokens: int = Field(default=4096, ge=1, le=65536)
    """SGLang --sampling-mask-max-tokens: the largest kept set a request may ask for."""
    images: SamplerImages = Field(default_factory=SamplerImages, json_schema_extra={"default": {}})
    """Container images."""


class ShareChange(ApiModel):
    """One change of a group's routing share."""

    time: datetime
    """When the share changed."""
    from_share: float = Field(alias="from", ge=0.0, le=1.0)
    """Share before the change."""
    to_share: float = Field(alias="to", ge=0.0, le=1.0)
    """Share after the change."""
    reason: str = Field(default="", max_length=256)
    """Why (policy, quarantine, manual, ...)."""


class SamplerGroupStatus(ApiModel):
    """Observed state of a SamplerGroup (operator, rebalancer and sync sidecars write parts of it)."""

    phase: Literal["Pending", "Running", "Degraded", "Suspended", "Quarantined", "Failed"] | None = None
    """Pending (pods not ready), Running, Degraded (some replicas not ready), Suspended, Quarantined, Failed."""
    observed_generation: int | None = Field(default=None, ge=0)
    """metadata.generation the status was computed from."""
    replicas: int | None = Field(default=None, ge=0)
    """Pods of the group's Deployment (scale subresource statusReplicasPath)."""
    ready_replicas: int | None = Field(default=None, ge=0)
    """Pods that pass their readiness probe (/health_generate)."""
    ready: str | None = Field(default=None, max_length=32)
    """Ready replicas over desired replicas, e.g. "2/2" (printer column)."""
    selector: str | None = Field(default=None, max_length=1024)
    """Label selector of the group's pods (scale subresource labelSelectorPath)."""
    selected_accelerator: str | None = Field(default=None, max_length=63)
    """Accelerator class the pods are placed on."""
    selection_reason: str | None = Field(default=None, max_length=1024)
    """Why this class and these flags (node labels matched, precision mode)."""
    degraded_precision: bool | None = None
    """True when the class runs the weight format only in a degraded form (e.g. FP8 weight-only W8A16 on A100)."""
    precision_note: str | None = Field(default=None, max_length=1024)
    """What the degraded form means (kernels, compute dtype)."""
    tokens_per_second: float | None = Field(default=None, ge=0.0)
    """Delivered generation throughput (sglang:generation_tokens_total rate), tokens/s."""
    share: float | None = Field(default=None, ge=0.0, le=1.0)
    """Current routing share of new sessions (0..1)."""
    applied_weight_version: int | None = Field(default=None, ge=0)
    """Lowest weight version applied by the group's ready replicas."""
    version_lag: int | None = Field(default=None, ge=0)
    """Latest channel version minus appliedWeightVersion."""
    kl: float | None = None
    """Sampler/trainer KL estimate (kl_k3) of this group's tokens."""
    oor_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    """Share of this group's tokens whose ratio p/q falls outside the MIS band."""
    token_share: float | None = Field(default=None, ge=0.0, le=1.0)
    """This group's share of all trained tokens."""
    oor_share: float | None = Field(default=None, ge=0.0, le=1.0)
    """This group's share of all out-of-range tokens (compare with tokenShare)."""
    cost_per_1m_tokens: float | None = Field(default=None, ge=0.0, alias="costPer1MTokens")
    """Cost per million useful (in-band) tokens at the catalog's price per GPU-hour."""
    quarantined: bool | None = None
    """True when the group gets no new sessions (manual or by the collapse detector)."""
    share_history: list[ShareChange] = Field(default_factory=list, max_length=5)
    """The last (at most 5) share changes, newest last."""
    conditions: list[Condition] = conditions_field()
    """Ready, Progressing, Degraded (and CollapseRisk) conditions."""
    message: str | None = Field(default=None, max_length=4096)
    """Human-readable summary of the state."""


class SamplerGroup(ApiModel):
    """A SamplerGroup object (kind SamplerGroup, short name sg)."""

    api_version: Literal["rlfleet.dev/v1alpha1"] = API_VERSION
    """API version."""
    kind: Literal["SamplerGroup"] = "SamplerGroup"
    """Kind."""
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    """Object metadata."""
    spec: SamplerGroupSpec
    """Desired state."""
    status: SamplerGroupStatus | None = None
    """Observed state."""

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> SamplerGroup:
        """Parse a SamplerGroup manifest (a dict from YAML or the API)."""
        return cls.model_validate(kube_manifest_check(manifest, "SamplerGroup"))
