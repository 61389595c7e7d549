"""What the weight-sync sidecar is configured with (`SyncConfig`), what it knows (`SyncState`) and what it
exports to Prometheus (`SyncMetrics`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rlfleet.channel import READ_KINDS, SUBSCRIBER_HEARTBEAT_SECONDS

FAILURE_REASONS = ("store", "checksum", "delta", "engine", "internal")
"""Why a sync attempt failed (the `reason` label of rlfleet_weight_sync_failures_total); "delta": a delta
version could not be rebuilt (its chain broken, a payload that does not fit its base)."""


@dataclass
class SyncConfig:
    store: str
    view: str
    engine_url: str
    group: str
    replica: str
    cache_dir: Path = Path("/tmp/rlfleet-weights")
    host: str = "0.0.0.0"
    port: int = 9400
    poll_interval: float = 2.0
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    keep_local: int = 2
    initial_version: int | None = None
    api_key: str | None = None
    """Bearer key of the engine's API (SGLang's `--api-key`): presented on every call but /health."""
    request_timeout: float = 600.0
    report_interval: float = SUBSCRIBER_HEARTBEAT_SECONDS
    """Heartbeat of the subscriber report when nothing changed (seconds). Readers age reports out
    after rlfleet.channel.SUBSCRIBER_STALE_AFTER_SECONDS (five default heartbeats): keep it well below."""
    require_checkpoint: bool = False
    """Refuse a view without config.json (SGLang: it launches and reloads only HF checkpoints)."""
    lora: bool = False
    """The engine serves LoRA adapters (a job with trainer.lora): `view` is the base it launched from, and
    each version's `lora` view is loaded as an adapter (sampler/engine_clients.py LoraEngine)."""
    in_place: bool = False
    """Filesystem store only: verify the view's files where the channel holds them and hand the engine
    that directory (no copy into `cache_dir`); the engine must see the store at the same path
    (docs/weights.md, "Loading in place")."""


@dataclass
class LastApply:
    version: int
    download_seconds: float
    apply_seconds: float
    total_seconds: float
    bytes: int
    """Size of the complete view applied."""
    at: str
    read_bytes: int = 0
    """Bytes read from the store to obtain it (a delta version: its payloads and whole files, and its
    chain's when it was rebuilt from further back)."""
    source: str = ""
    """How it was obtained, e.g. "anchor v4 + deltas v5, v6", "local v6 + delta v7", "anchor v8 in place"."""


@dataclass
class SyncState:
    applied_version: int | None = None
    latest_version: int | None = None
    phase: str = "starting"
    consecutive_failures: int = 0
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))
    last_error: str | None = None
    last_apply: LastApply | None = None
    read_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(READ_KINDS, 0))
    """Bytes read from the store since start, by kind (rlfleet.channel.READ_KINDS)."""
    next_attempt_at: float = 0.0
    report_failures: int = 0
    """Failed writes of the subscriber report (total)."""
    report_failure_streak: int = 0
    """Failed writes since the last one that succeeded (0: the last write succeeded)."""
    foreign_versions: int = 0
    """Times the engine served a version this sidecar had not applied (each time re-applied)."""
    foreign_message: str | None = None
    """The last of those, said in the subscriber report (hence the SamplerGroup's status) until a newer
    version is applied."""


class SyncMetrics:
    def __init__(self, group: str, view: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"group": group, "view": view}
        self.applied = Gauge(
            "rlfleet_weight_sync_applied_version",
            "Weight version the engine serves (-1: unknown).",
            list(labels),
            registry=self.registry,
        ).labels(**labels)
        self.latest = Gauge(
            "rlfleet_weight_sync_latest_version",
            "Version the channel pointer names (-1: none).",
            list(labels),
            registry=self.registry,
        ).labels(**labels)
        self.lag = Gauge(
            "rlfleet_weight_sync_lag_versions", "latest - applied.", list(labels), registry=self.registry
        ).labels(**labels)
        self.applies = Counter(
            "rlfleet_weight_sync_applies", "Versions applied.", list(labels), registry=self.registry
        ).labels(**labels)
        failures = Counter(
            "rlfleet_weight_sync_failures",
            "Failed sync attempts by reason.",
            [*labels, "reason"],
            registry=self.registry,
        )
        self.failures = {r: failures.labels(**labels, reason=r) for r in FAILURE_REASONS}
        self.report_failures = Counter(
            "rlfleet_weight_sync_report_failures",
            "Failed writes of this replica's subscriber report to the store.",
            list(labels),
            registry=self.registry,
        ).labels(**labels)
        self.foreign_versions = Counter(
            "rlfleet_weight_sync_foreign_versions",
            "Times the engine served weights this sidecar had not applied (another client of the engine's "
            "weight-update API, or a restart from other weights): each time the channel's version was "
            "applied again.",
            list(labels),
            registry=self.registry,
        ).labels(**labels)
        read_bytes = Counter(
            "rlfleet_weight_sync_read_bytes",
            "Bytes read from the weight channel's store, by kind: anchor (files of a version stored whole), "
            "delta (delta payloads), whole-file (files a delta version stores whole).",
            [*labels, "kind"],
            registry=self.registry,
        )
        self.read_bytes = {kind: read_bytes.labels(**labels, kind=kind) for kind in READ_KINDS}
        buckets = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.download = Histogram(
            "rlfleet_weight_sync_download_seconds",
            "Download + verification time.",
            list(labels),
            buckets=buckets,
            registry=self.registry,
        ).labels(**labels)
        self.apply = Histogram(
            "rlfleet_weight_sync_apply_seconds",
            "Engine apply time.",
            list(labels),
            buckets=buckets,
            registry=self.registry,
        ).labels(**labels)
        self.applied.set(-1)
        self.latest.set(-1)
