"""WeightChannel: versioned weights from the trainer to every sampler group, one view per precision."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from rlfleet.api.common import (
    DNS_SUBDOMAIN_PATTERN,
    HTTP_URL_PATTERN,
    ApiModel,
    Condition,
    LocalObjectReference,
    WeightFormat,
    cel_rules,
    conditions_field,
    kube_manifest_check,
)
from rlfleet.api.meta import KubeObject

STORE_RULE = "self.type == 'filesystem' ? has(self.path) : has(self.bucket)"
STORE_MESSAGE = "store: type filesystem needs path; type s3 needs bucket"
STORE_PATH_RULE = "!has(self.path) || self.path.startsWith('/')"
SAMPLER_SECRET_RULE = "!has(self.samplerSecretRef) || self.type == 's3'"
SAMPLER_SECRET_MESSAGE = (
    "store.samplerSecretRef is for type s3 (a filesystem store's sampler pods already mount the channel "
    "read-only, and only their group's subscriber reports writable)"
)
SHARED_CREDENTIALS_RULE = (
    "self.type != 's3' || !has(self.secretRef) || has(self.samplerSecretRef) || "
    "(has(self.sharedCredentials) && self.sharedCredentials)"
)
SHARED_CREDENTIALS_MESSAGE = (
    "store.secretRef alone would give every sampler pod the trainer's write credentials to the channel: set "
    "store.samplerSecretRef (an identity that reads the channel and writes only subscribers/: docs/install.md, "
    "'Store credentials') or, for one identity in every role on purpose, store.sharedCredentials: true"
)
SHARED_CREDENTIALS_SCOPE_RULE = (
    "!(has(self.sharedCredentials) && self.sharedCredentials) || (self.type == 's3' && has(self.secretRef) && "
    "!has(self.samplerSecretRef))"
)
SHARED_CREDENTIALS_SCOPE_MESSAGE = (
    "store.sharedCredentials is for type s3 with secretRef and without samplerSecretRef (it lets the sampler "
    "pods use secretRef)"
)
STORE_PATH_MESSAGE = (
    "store.path must be an absolute path (the volume's mount path in every pod; a relative path would "
    "resolve against each process's working directory)"
)
# S3 bucket naming rules (3-63 characters: lowercase letters, digits, dots and hyphens).
BUCKET_PATTERN = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"


class StoreSpec(ApiModel):
    """Where versions live: a filesystem path on a shared volume, or an S3-compatible bucket."""

    model_config = cel_rules(
        {"rule": STORE_RULE, "message": STORE_MESSAGE},
        {"rule": STORE_PATH_RULE, "message": STORE_PATH_MESSAGE, "fieldPath": ".path"},
        {"rule": SAMPLER_SECRET_RULE, "message": SAMPLER_SECRET_MESSAGE, "fieldPath": ".samplerSecretRef"},
        {"rule": SHARED_CREDENTIALS_RULE, "message": SHARED_CREDENTIALS_MESSAGE, "fieldPath": ".secretRef"},
        {
            "rule": SHARED_CREDENTIALS_SCOPE_RULE,
            "message": SHARED_CREDENTIALS_SCOPE_MESSAGE,
            "fieldPath": ".sharedCredentials",
        },
    )

    type: Literal["filesystem", "s3"] = "filesystem"
    """filesystem (a shared ReadWriteMany volume) or s3 (any S3-compatible object store)."""
    path: str | None = Field(default=None, min_length=1, max_length=1024)
    """filesystem: directory of the channel inside every pod (the volume's mount path)."""
    volume_claim_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN
    )
    """filesystem: PersistentVolumeClaim mounted at path in the trainer and sampler pods (none: the path must already exist on the nodes, tests only)."""
    bucket: str | None = Field(default=None, min_length=3, max_length=63, pattern=BUCKET_PATTERN)
    """s3: bucket name."""
    prefix: str = Field(default="", max_length=1024)
    """s3: key prefix of the channel inside the bucket."""
    endpoint: str | None = Field(default=None, max_length=1024, pattern=HTTP_URL_PATTERN)
    """s3: endpoint URL of an S3-compatible server (none: AWS)."""
    region: str | None = Field(default=None, max_length=64)
    """s3: region."""
    secret_ref: LocalObjectReference | None = None
    """s3: Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (injected by reference, never copied)."""
    sampler_secret_ref: LocalObjectReference | None = None
    """s3: the sampler pods' Secret (same keys), for credentials per role: read the channel, write only `subscribers/` (docs/install.md "Store credentials"). Required with secretRef unless sharedCredentials is true."""
    shared_credentials: bool = False
    """s3: let the sampler pods use secretRef (the trainer's write credentials) when there is no samplerSecretRef: one identity for every role, so any sampler pod could write versions, the pointer and checkpoints. false: secretRef without samplerSecretRef is refused."""

    @model_validator(mode="after")
    def _check_store(self) -> StoreSpec:
        if (self.type == "filesystem" and not self.path) or (self.type == "s3" and not self.bucket):
            raise ValueError(STORE_MESSAGE)
        if self.path is not None and not self.path.startswith("/"):
            raise ValueError(f"{STORE_PATH_MESSAGE}: got {self.path!r}")
        if self.sampler_secret_ref is not None and self.type != "s3":
            raise ValueError(SAMPLER_SECRET_MESSAGE)
        per_role = self.secret_ref is None or self.sampler_secret_ref is not None
        if self.type == "s3" and not per_role and not self.shared_credentials:
            raise ValueError(SHARED_CREDENTIALS_MESSAGE)
        if self.shared_credentials and (self.type != "s3" or per_role):
            raise ValueError(SHARED_CREDENTIALS_SCOPE_MESSAGE)
        return self


class RetentionSpec(ApiModel):
    """How many versions to keep."""

    keep_versions: int = Field(default=3, ge=1, le=1000)
    """Versions kept besides any version a subscriber still reports using."""


DEFAULT_ANCHOR_EVERY = 16
"""Why 16 (docs/weights.md, "Anchors every K versions"): a delta of d of the full view makes a version cost
1/K + d of it on average (stored, and read by each replica that follows every version) and a replica that
joins reads at most 1 + (K-1)d; at the measured bf16 d ~ 1.2% (0.4% of elements, 6 bytes each, at lr 1e-6)
K=16 gives 7.4% per version (13x less than full versions) and at most 1.18 views to join."""
DEFAULT_MAX_DELTA_SHARE = 0.5


class DeltaSpec(ApiModel):
    """How versions are stored: anchors (complete checkpoints) and deltas against the previous version (docs/weights.md, "Deltas between versions")."""

    anchor_every: int = Field(default=DEFAULT_ANCHOR_EVERY, ge=1, le=1000)
    """A view is stored whole (an anchor) at least every this many versions and as a delta against its previous version otherwise; 1: every version whole (no deltas)."""
    max_delta_share: float = Field(default=DEFAULT_MAX_DELTA_SHARE, gt=0.0, le=1.0)
    """A view is stored whole instead when the delta of one of its files would exceed this share of the file's size."""


class WeightChannelSpec(ApiModel):
    """Desired state of a WeightChannel (written by the operator from the RLJob's weightChannel)."""

    job_name: str | None = Field(default=None, max_length=63, pattern=DNS_SUBDOMAIN_PATTERN)
    """Name of the RLJob publishing into this channel."""
    store: StoreSpec
    """Where versions live."""
    retention: RetentionSpec = Field(default_factory=RetentionSpec, json_schema_extra={"default": {}})
    """Retention of old versions."""
    deltas: DeltaSpec = Field(default_factory=DeltaSpec, json_schema_extra={"default": {}})
    """Anchors and deltas between versions."""


class ViewArtifact(ApiModel):
    """One published precision view of a version."""

    view: Literal[WeightFormat, "lora"]
    """Precision view, or `lora`: a LoRA job's adapter, every version's only view but the bases' (docs/weights.md, "LoRA")."""
    version: int = Field(ge=0)
    """Weight version."""
    uri: str = Field(default="", max_length=2048)
    """Where the view's files are (path or s3:// URI)."""
    sha256: str = Field(default="", max_length=64)
    """sha256 of the view's manifest."""
    bytes: int = Field(default=0, ge=0)
    """Total size of the view's files (the complete checkpoint a sampler loads)."""
    time: datetime | None = None
    """When the view was published."""
    kind: Literal["anchor", "delta"] | None = None
    """anchor: every file stored whole; delta: its safetensors files rebuilt from version base's (docs/weights.md, "Deltas between versions")."""
    stored_bytes: int | None = Field(default=None, ge=0)
    """Bytes the channel holds for this view of this version: what each replica that follows every version reads (the delta payloads and the files stored whole)."""
    base: int | None = Field(default=None, ge=0)
    """The version a delta applies to."""


class GroupVersion(ApiModel):
    """Weight version a subscribed sampler group has applied."""

    group: str = Field(max_length=253)
    """SamplerGroup name."""
    view: WeightFormat | None = None
    """View the group follows."""
    applied_version: int | None = Field(default=None, ge=0)
    """Lowest version applied by the group's ready replicas (none: unknown)."""
    lag: int | None = Field(default=None, ge=0)
    """latestVersion - appliedVersion."""
    sync_failures: int | None = Field(default=None, ge=0)
    """Failed weight syncs the group's live replicas report since they started."""
    last_error: str | None = Field(default=None, max_length=512)
    """The newest failure a replica still reports (cleared when it applies a version)."""
    replicas: list[str] = Field(default_factory=list, max_length=256)
    """The replicas (pod names) with a fresh report: a ready pod missing here cannot write its report (the SamplerGroup says so)."""


class ModelShape(ApiModel):
    """What the operator read of the published model (config.json of a view of the latest version): the
    head counts every group's tensorParallel must divide."""

    architecture: str | None = Field(default=None, max_length=253)
    """The config's architectures, e.g. Qwen3ForCausalLM."""
    attention_heads: int = Field(ge=1)
    """num_attention_heads."""
    key_value_heads: int = Field(ge=1)
    """num_key_value_heads (the attention heads when the config has none)."""
    version: int = Field(ge=0)
    """The weight version the config was read from."""


class WeightChannelStatus(ApiModel):
    """Observed state of a WeightChannel."""

    phase: Literal["Pending", "Ready", "Degraded"] | None = None
    """Pending (no version published yet or store unreadable), Ready, Degraded."""
    observed_generation: int | None = Field(default=None, ge=0)
    """metadata.generation the status was computed from."""
    latest_version: int | None = Field(default=None, ge=0)
    """Version the channel pointer names (none: unknown or nothing published)."""
    artifacts: list[ViewArtifact] = Field(default_factory=list, max_length=16)
    """Per-view artifacts of the latest version."""
    lora_base: dict[str, Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=8)
    """A LoRA job's base views and the version holding each: stored once, every version is only the adapter (docs/weights.md, "LoRA")."""
    stored_percent: float | None = Field(default=None, ge=0.0)
    """Bytes stored for the latest version over the bytes of its complete views, in % (100: every view an anchor; a bf16 delta at lr 1e-6 about 1.2)."""
    groups: list[GroupVersion] = Field(default_factory=list, max_length=64)
    """Per-group applied version."""
    conditions: list[Condition] = conditions_field()
    """Ready condition."""
    message: str | None = Field(default=None, max_length=4096)
    """Human-readable summary (e.g. why the latest version is unknown)."""
    model: ModelShape | None = None
    """The published model's head counts (kept once read: every version is the same model)."""


class WeightChannel(KubeObject[WeightChannelSpec, WeightChannelStatus]):
    """A WeightChannel object (kind WeightChannel, short name wc)."""

    kind: Literal["WeightChannel"] = "WeightChannel"
    """Kind."""

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> WeightChannel:
        """Parse a WeightChannel manifest."""
        return cls.model_validate(kube_manifest_check(manifest, "WeightChannel"))
