"""SamplerGroup: one accelerator + precision group of SGLang sampler replicas (owned by an RLJob)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from rlfleet.api.common import (
    DNS_LABEL_PATTERN,
    DNS_SUBDOMAIN_PATTERN,
    MAX_GROUP_NAME,
    RESERVED_GROUP_NAMES,
    SYNC_SIDECAR_PORT,
    ApiModel,
    Condition,
    KvCacheDtype,
    WeightFormat,
    cel_list,
    cel_rules,
    conditions_field,
    kube_manifest_check,
)
from rlfleet.api.lora_spec import LoraSpec
from rlfleet.api.meta import KubeObject
from rlfleet.api.podfields import POD_FIELDS_RULES
from rlfleet.api.scheduling import PodPlacement

ACCELERATOR_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"

# Cross-field rules: CEL in the CRD and the pydantic check share the message (kubectl apply and
# `rlfleet run --local` say the same words).
RESERVED_NAME_RULE = f"!(self.name in {cel_list(RESERVED_GROUP_NAMES)})"
RESERVED_NAME_MESSAGE = (
    f"group name must not be one of {', '.join(RESERVED_GROUP_NAMES)}: the job's own children are named "
    "<job>-trainer, <job>-router, ... and <job>-<group> would collide with them"
)
# SGLang flags the operator sets from the spec. The GPU-count flags must follow tensorParallel (the pod
# requests exactly tensorParallel GPUs); the others follow model, port, weightFormat, kvCacheDtype, ...
# Option strings as SGLang 0.5.23's parser spells them (tests/api/test_api_models.py reads the parser).
OWNED_SGLANG_FLAGS: tuple[str, ...] = (
    "--tp-size", "--tensor-parallel-size", "--dp-size", "--data-parallel-size",
    "--pp-size", "--pipeline-parallel-size", "--nnodes",
    "--model-path", "--model", "--served-model-name", "--host", "--port", "--dtype",
    "--quantization", "--fp8-gemm-backend", "--fp4-gemm-backend", "--kv-cache-dtype",
    "--sampling-mask-max-tokens", "--weight-version",
)  # fmt: skip
EXTRA_ARGS_RULE = (
    f"!has(self.extraArgs) || self.extraArgs.all(a, !(a in {cel_list(OWNED_SGLANG_FLAGS)}) && "
    f"!{cel_list(OWNED_SGLANG_FLAGS)}.exists(f, a.startsWith(f + '=')))"
)
EXTRA_ARGS_MESSAGE = (
    "extraArgs must not set flags the operator derives from the spec: the GPU count (--tp-size, --dp-size, "
    "--pp-size, --nnodes) follows tensorParallel, which is also the pod's GPU request; --model-path, --port, "
    "--quantization, --kv-cache-dtype and the like follow model, port, weightFormat and kvCacheDtype"
)
# Flags of `rlfleet sampler serve` the operator sets for a reference-engine class (besides the
# SGLang-named ones above, which the reference server spells the same way).
OWNED_REFERENCE_FLAGS: tuple[str, ...] = ("--engine", "--weight-format", "--kv-cache-dtype", "--port-file")
REFERENCE_EXTRA_ARGS_MESSAGE = (
    "extraArgs of a reference-engine class (cpu) go to `rlfleet sampler serve --engine reference` and must not "
    "set the flags the operator derives from the spec (--engine, --weight-format, --kv-cache-dtype, "
    '--port-file, --model-path, --port, ...); e.g. ["--threads", "2"] or ["--max-tokens-per-second", "400"]'
)
PORT_RULE = f"self.port != {SYNC_SIDECAR_PORT}"
PORT_MESSAGE = f"port {SYNC_SIDECAR_PORT} is the weight-sync sidecar's port in the same pod: pick another"
ACCELERATOR_CHANGE_RULE = "self.suspend || self.accelerator == oldSelf.accelerator"
ACCELERATOR_CHANGE_MESSAGE = (
    "accelerator cannot change on an existing SamplerGroup (its pods would restart mid-run on other GPUs): "
    "set suspend: true in the same change, or create a new group and delete this one"
)


SG_NAME_RULE = f"size(self.metadata.name) <= 63 && self.metadata.name.matches('{DNS_LABEL_PATTERN}')"
SG_NAME_MESSAGE = (
    "metadata.name must be a DNS-1035 label of at most 63 characters (lowercase letters, digits and '-', "
    "starting with a letter; no dots): it names the group's Deployment and Service"
)


def owned_flags_in(args: list[str]) -> list[str]:
    """The arguments of `args` that set a flag of OWNED_SGLANG_FLAGS (`--flag` or `--flag=value`)."""
    return [a for a in args if a.split("=", 1)[0] in OWNED_SGLANG_FLAGS]


# a group's own CEL rules, which SamplerGroupSpec lists again (pydantic replaces a parent's json_schema_extra)
_GROUP_RULES = (
    {"rule": RESERVED_NAME_RULE, "message": RESERVED_NAME_MESSAGE, "fieldPath": ".name"},
    {"rule": EXTRA_ARGS_RULE, "message": EXTRA_ARGS_MESSAGE, "fieldPath": ".extraArgs"},
)


class SamplerGroupTemplate(PodPlacement):
    """One sampler group of an RLJob: which GPU class, how many replicas, which precision."""

    model_config = cel_rules(
        *_GROUP_RULES,
        *POD_FIELDS_RULES,
    )

    name: str = Field(min_length=1, max_length=MAX_GROUP_NAME, pattern=DNS_LABEL_PATTERN)
    """Group name, unique in the job (DNS label, <= 24 characters); the SamplerGroup is named <job>-<name>."""
    accelerator: str = Field(min_length=1, max_length=63, pattern=ACCELERATOR_PATTERN)
    """Accelerator class from the catalog (a100, h100, h200, b200, b300, rtx-pro-6000, cpu, or a class added by a catalog override). Pods are placed only on nodes labelled for this class; cpu runs the reference engine on CPU (no GPU request)."""
    replicas: int = Field(default=1, ge=0, le=1024)
    """Number of engine replicas (SGLang servers with tensorParallel GPUs each, or reference engines on a CPU class). 0 keeps the group defined but idle."""
    weight_format: WeightFormat = "bf16"
    """Precision of the served weights: bf16, fp8 (block-128), nvfp4 (native only on Blackwell) or mxfp4 (MoE models). The weight channel publishes this view."""
    kv_cache_dtype: KvCacheDtype = "auto"
    """SGLang --kv-cache-dtype: auto (model dtype), bf16, fp8_e4m3, fp8_e5m2, mxfp8 (sm100+) or nvfp4 (sm100/sm120)."""
    tensor_parallel: int | None = Field(default=None, ge=1, le=8)
    """GPUs per replica (SGLang --tp-size, and the nvidia.com/gpu request). Default: the class's default TP from the catalog. A CPU class (reference engine) runs one process per replica: 1 or unset."""
    extra_args: list[Annotated[str, Field(max_length=1024)]] = Field(default_factory=list, max_length=64)
    """Extra engine command-line arguments appended verbatim: SGLang's (e.g. ["--mem-fraction-static", "0.85"]), or on a CPU class the reference engine's (e.g. ["--threads", "2"])."""
    quarantined: bool = False
    """Manually quarantine the group: the router sends it no new sessions (its pods keep running)."""
    spot: bool = False
    """Run the group on spot / preemptible capacity: its pods also require a spot node and tolerate the spot taints (the catalog's spot flavor: GKE, EKS, Karpenter and AKS labels by default, docs/scheduling.md "Spot groups")."""
    egress_price_per_gb: float | None = Field(default=None, ge=0.0, le=1000.0)
    """USD per GB (10^9 bytes) of weights its replicas read from the weight channel, for a group that pays for that traffic (in another region or cloud than the store): the bytes each replica reads per version x versions per hour x this price is its weight traffic's cost per replica-hour, counted in its cost per usable token by `rlfleet fleet plan` and `measured_economics` (docs/economics.md, "Weight traffic"), and by the operator from the trainer's stored bytes of the group's view: in its status costs (the share policy) and per replica in the fleet-mix optimizer's plan. Unset: its weight traffic is free."""

    @model_validator(mode="after")
    def _check_against_catalog(self) -> SamplerGroupTemplate:
        # Same rule as the CRD's CEL (generated from the built-in catalog), but against the catalog
        # loaded at runtime, so local mode and overridden catalogs give the same clear message.
        from rlfleet import catalog

        if self.name in RESERVED_GROUP_NAMES:
            raise ValueError(RESERVED_NAME_MESSAGE)
        owned = owned_flags_in(self.extra_args)
        if owned:
            raise ValueError(f"{EXTRA_ARGS_MESSAGE} (got {', '.join(owned)})")
        catalog.check_group(self.accelerator, self.weight_format, self.kv_cache_dtype)
        cls = catalog.get_catalog().get(self.accelerator)
        catalog.check_tensor_parallel(cls, self.tensor_parallel)
        if cls.engine == "reference":
            owned = [a for a in self.extra_args if a.split("=", 1)[0] in OWNED_REFERENCE_FLAGS]
            if owned:
                raise ValueError(f"{REFERENCE_EXTRA_ARGS_MESSAGE} (got {', '.join(owned)})")
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

    model_config = cel_rules(
        *_GROUP_RULES,
        {"rule": PORT_RULE, "message": PORT_MESSAGE, "fieldPath": ".port"},
        {"rule": ACCELERATOR_CHANGE_RULE, "message": ACCELERATOR_CHANGE_MESSAGE, "fieldPath": ".accelerator"},
        *POD_FIELDS_RULES,
    )

    job_name: str | None = Field(default=None, max_length=63, pattern=DNS_LABEL_PATTERN)
    """Name of the RLJob this group belongs to (empty for a standalone group)."""
    model: GroupModelRef
    """Model to serve."""
    weight_channel: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """Name of the WeightChannel the sidecar follows (none: the group serves its initial weights)."""
    suspend: bool = False
    """Scale the group's pods to zero while keeping spec.replicas (set from the RLJob's suspend)."""
    port: int = Field(default=30000, ge=1024, le=65535)
    """Port of the SGLang HTTP server in the pod."""
    sampling_mask_max_tokens: int = Field(default=4096, ge=1, le=65536)
    """SGLang --sampling-mask-max-tokens: the largest kept set a request may ask for."""
    images: SamplerImages = Field(default_factory=SamplerImages, json_schema_extra={"default": {}})
    lora: LoraSpec | None = None
    """Serve the job's LoRA adapters (the operator copies the RLJob's trainer.lora): the engine starts from the group's base view with LoRA enabled (SGLang --enable-lora, --max-lora-rank, --lora-target-modules) and the weight-sync sidecar loads each version's adapter (docs/weights.md, "LoRA"). Absent: every version is a full view of the group's format."""
    """Container images."""

    @model_validator(mode="after")
    def _check_port(self) -> SamplerGroupSpec:
        if self.port == SYNC_SIDECAR_PORT:
            raise ValueError(PORT_MESSAGE)
        return self


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


class SteadyThroughput(ApiModel):
    """The group's last steady decode throughput per replica, as the fleet-mix optimizer read it."""

    tokens_per_second_per_replica: float = Field(ge=0.0)
    """Decode tokens/s of the group over its ready replicas, read while ready replicas = spec.replicas and unchanged."""
    replicas: int = Field(ge=1, le=1024)
    """The ready replicas it was read over."""
    weight_format: str = Field(max_length=16)
    """The weightFormat it was read at (a figure of another format is not used)."""
    measured_at: datetime | None = None
    """When it was read."""
    saturated: bool = True
    """A reading with requests queued (at this weightFormat) is behind it; false: read only while the group was demand-limited (its queues empty), a lower bound on its capacity."""


class PrecisionCooldown(ApiModel):
    """The precision autopilot's step-down state of a group (in the RLJob's status.decisions)."""

    cooldown_intervals: int | None = Field(default=None, ge=1, le=100000)
    """The group's cool-down, doubled by a breach after a step down (absent: the RLJob's router.autopilot.cooldownIntervals)."""
    on_probation: bool = False
    """True from a step down until the group has stayed within its budget for a cool-down at the cheaper format; a breach meanwhile steps it up and doubles the cool-down."""


class SamplerGroupStatus(ApiModel):
    """Observed state of a SamplerGroup (operator, rebalancer and sync sidecars write parts of it)."""

    phase: Literal["Pending", "Running", "Degraded", "Suspended", "Quarantined", "Failed"] | None = None
    """Pending (pods not ready), Running, Degraded (some replicas not ready), Suspended, Quarantined, Failed."""
    reason: str | None = Field(default=None, max_length=128)
    """Machine-readable CamelCase reason of the phase (the Ready condition's reason)."""
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
    """Decode throughput, tokens/s: the per-interval increase of sglang:realtime_tokens_total{mode="decode"} (the sglang:gen_throughput gauge for a pod seen the first time). Not generation_tokens_total, which SGLang counts only when a request finishes."""
    share: float | None = Field(default=None, ge=0.0, le=1.0)
    """Current routing share of new sessions (0..1)."""
    share_percent: float | None = Field(default=None, ge=0.0, le=100.0)
    """share as a percentage (printer column), written by the operator from share."""
    applied_weight_version: int | None = Field(default=None, ge=0)
    """Lowest weight version applied by the group's ready replicas."""
    version_lag: int | None = Field(default=None, ge=0)
    """Latest channel version minus appliedWeightVersion."""
    weight_sync_failures: int | None = Field(default=None, ge=0)
    """Failed weight syncs (store, checksum, engine) the group's live replicas report since they started; the reason of a failure still current is in the WeightsSynced condition and the message."""
    kl: float | None = None
    """Sampler/trainer KL estimate (kl_k3) of this group's tokens."""
    oor_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    """Share of this group's tokens whose ratio p/q falls outside the MIS band."""
    token_share: float | None = Field(default=None, ge=0.0, le=1.0)
    """This group's share of all trained tokens."""
    oor_share: float | None = Field(default=None, ge=0.0, le=1.0)
    """This group's share of all out-of-range tokens (compare with tokenShare)."""
    routing_mismatch: float | None = Field(default=None, ge=0.0, le=1.0)
    """A mixture of experts only: share of this group's trained tokens whose routed experts (in any layer) differ from the ones the trainer's router picks at the same weights (the trainer's routing_mismatch_tokens)."""
    usable_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    """Share of the tokens this group sampled at the trainer's latest step that were trained on and inside the MIS band (trained / sampled x (1 - oorFraction)): a group answering invalid tokens (dropped) shows it here (printer column Usable)."""
    invalid_tokens: dict[str, int] | None = Field(default=None, max_length=64)
    """The group's tokens at the trainer's latest step that failed validation, by reason (a token failing several checks counts under each; rejected_by_objective: the objective could not use it); absent: none."""
    cost_per_hour: float | None = Field(default=None, ge=0.0)
    """USD per hour of the group's GPUs (replicas x tensorParallel) at the catalog's price per GPU-hour, and of its weight traffic (egressCostPerHour) where it pays for it."""
    egress_cost_per_hour: float | None = Field(default=None, ge=0.0)
    """With spec.egressPricePerGb: USD per hour its ready replicas pay for the weights they read (the trainer's stored bytes of its view per second, smoothed, x 3600 / 1e9 x the price x ready replicas; docs/economics.md "Weight traffic"), part of costPerHour and costPer1MTokens; absent: no price, or no reading yet."""
    cost_per_1m_tokens: float | None = Field(default=None, ge=0.0, alias="costPer1MTokens")
    """USD per million usable tokens (trained on and inside the MIS band: tokens/s x usableFraction) at the catalog's price per GPU-hour (and its weight traffic, egressCostPerHour)."""
    quarantined: bool | None = None
    """True when the group gets no new sessions (manual, by the collapse detector or held by the precision autopilot: the RLJob's status.decisions says which)."""
    share_history: list[ShareChange] = Field(default_factory=list, max_length=5)
    """The last (at most 5) share changes, newest last."""
    conditions: list[Condition] = conditions_field()
    """Ready, Progressing, Degraded (and CollapseRisk) conditions."""
    message: str | None = Field(default=None, max_length=4096)
    """Human-readable summary of the state."""


class SamplerGroup(KubeObject[SamplerGroupSpec, SamplerGroupStatus]):
    """A SamplerGroup object (kind SamplerGroup, short name sg)."""

    kind: Literal["SamplerGroup"] = "SamplerGroup"
    """Kind."""

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> SamplerGroup:
        """Parse a SamplerGroup manifest (a dict from YAML or the API)."""
        sg = cls.model_validate(kube_manifest_check(manifest, "SamplerGroup"))
        name = sg.metadata.name
        if name is not None and not (len(name) <= 63 and re.fullmatch(DNS_LABEL_PATTERN, name)):
            raise ValueError(f"{SG_NAME_MESSAGE}: got {name!r}")
        return sg
