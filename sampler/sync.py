"""Weight-sync sidecar: reconciles its pod's engine to the weight channel's pointer.

    rlfleet sampler sync --store /mnt/weights/job --view fp8 --engine-url http://127.0.0.1:30000 \\
        --group h100-fp8 --replica $POD_NAME --cache-dir /weights-cache --port 9400 [--fetch-only]

Launch (`--fetch-only`, the pod's init container): SGLang must START from a checkpoint already in the
group's format (`/update_weights_from_disk` reloads into the launch-time model with its launch-time
quantization method; docs/weights.md), so before SGLang starts the init container waits for the newest
version of this pod's view, downloads and verifies it (BLAKE3 per file) into the cache, checks its config.json
declares the view's quantization (what SGLang auto-detects), writes the cache's launch file ("<version>
<dir>", rlfleet.catalog.LAUNCH_FILE) and exits. The engine container execs SGLang with `--model-path
<dir> --weight-version <version>` from that file; the sidecar starts from the same version and rewrites
the file after every applied version, so a restarted engine container launches from what it served.

Loop: read the pointer; if it names a version newer than the applied one, report it as "in use"
(so retention keeps it), download this pod's view into the cache directory (an emptyDir shared with
the engine container), verify the manifest against the pointer's sha256 and every file against the
manifest's digest (BLAKE3 of the local copy, streamed; an entry naming an algorithm this
sidecar does not know is refused, reason "checksum") BEFORE the engine sees the directory, then apply:

- disk mode (default): `POST /update_weights_from_disk {model_path, weight_version, flush_cache,
  abort_all_requests}` with the next version of the SAME view (SGLang loads it into the launch-time
  model with its launch-time quantization method, never re-quantizing; it rolls back on failure);
- push mode: `/init_weights_update_group` once, then per version `/pause_generation {mode: retract}`
  -> `/begin_weight_update` -> n x `/update_weights_from_distributed {names, dtypes, shapes,
  group_name, weight_version, load_format}` -> `/end_weight_update` -> `/continue_generation`
  (`continue` is always sent once `pause` was, so a failed push leaves the engine serving). The
  tensor bytes travel over the NCCL group (rank 0 = this sidecar, `sender` hook); that data plane
  needs GPUs and is not exercised on CPU.

Any failure (store unreachable, checksum mismatch, engine error) is counted by reason, the engine
keeps serving the version it has, and the sidecar retries with exponential backoff (with jitter).
It serves `/metrics` (Prometheus), `/status` (JSON) and `/health`, and writes its report to the
store (`subscribers/<group>/<replica>.json`) for retention and the operator's status: when it changes,
and otherwise every `report_interval` (rlfleet.channel.SUBSCRIBER_HEARTBEAT_SECONDS), from a heartbeat
task that also runs during long downloads and applies. Readers age a report out after
SUBSCRIBER_STALE_AFTER_SECONDS. A failed write is retried at the next step, counted
(`report_failures`, `rlfleet_weight_sync_report_failures_total`) and logged as a WARNING once per
streak of failures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from rlfleet.catalog import LAUNCH_FILE
from rlfleet.channel import (
    SUBSCRIBER_HEARTBEAT_SECONDS,
    SUBSCRIBER_STALE_AFTER_SECONDS,
    VIEW_NAMES,
    ChannelError,
    ChecksumMismatchError,
    Manifest,
    SubscriberReport,
    WeightChannel,
    check_name,
    now_iso,
)
from rlfleet.store import Store, StoreError, open_store

log = logging.getLogger("rlfleet.sampler.sync")

# safetensors dtype -> torch dtype name (what SGLang's update_weights_from_distributed expects)
TORCH_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "BOOL": "bool",
}


class EngineError(Exception):
    """The engine refused or failed an update (it keeps serving its previous weights)."""


class NotLaunchableError(ValueError):
    """A downloaded view is not a checkpoint SGLang would load in the view's format."""


# ----------------------------------------------------------------------------------------------
# Which version to load, and whether SGLang would load it in the view's format


def newest_version_of_view(channel: WeightChannel, view: str) -> tuple[int, Manifest] | None:
    """The newest complete version that has `view`, with its manifest (None: none yet).

    The pointer's version first (its manifest checked against the pointer's sha256); if that version
    lacks the view, older complete versions, newest first."""
    pointer = channel.latest()
    if pointer is None:
        return None
    manifest = channel.manifest(pointer.version, expected_sha256=pointer.manifest_sha256)
    if view in manifest.views:
        return pointer.version, manifest
    for version in sorted((v for v in channel.versions() if v < pointer.version), reverse=True):
        older = channel.manifest(version)
        if view in older.views:
            return version, older
    return None


def _quant_method(directory: Path, require_config: bool = True) -> tuple[str | None, dict[str, Any] | None]:
    """(method, quantization config) the way SGLang 0.5.23's ModelConfig._parse_quant_hf_config reads
    a local checkpoint: config.json `quantization_config`, else hf_quant_config.json; a ModelOpt config
    (quant_method "modelopt" or absent) resolves through its quant_algo (NVFP4 -> modelopt_fp4)."""
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        if not require_config:
            return None, None
        raise NotLaunchableError(f"{directory}: no config.json (not a launchable checkpoint)") from None
    except ValueError as e:
        raise NotLaunchableError(f"{config_path}: not JSON: {e}") from None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if quant is None and (directory / "hf_quant_config.json").is_file():
        raw = json.loads((directory / "hf_quant_config.json").read_text())
        quant = raw.get("quantization", raw) if isinstance(raw, dict) else None
    if not isinstance(quant, dict):
        return None, None
    method = str(quant.get("quant_method", "modelopt")).lower()
    if method == "modelopt":
        algo = str(quant.get("quant_algo", "")).upper()
        method = "modelopt_fp4" if "FP4" in algo else ("modelopt_fp8" if algo == "FP8" else method)
    return method, quant


VIEW_QUANT_METHODS: dict[str, str | None] = {
    "bf16": None,
    "fp8": "fp8",
    "nvfp4": "modelopt_fp4",
    "mxfp4": "mxfp4",
}
"""The quantization method SGLang must detect in each view's checkpoint (the catalog's
`--quantization` value for the format; bf16: none)."""


def check_launchable(directory: Path, view: str, *, require_config: bool = True) -> str | None:
    """Raise NotLaunchableError unless `directory` is a checkpoint SGLang loads in `view`'s format;
    return the detected quantization method. Catches a BF16 checkpoint handed to an fp8 / nvfp4 group
    (SGLang would quantize it online and never take a later update). `require_config=False` (engines
    that read rlfleet's own view files, e.g. the reference sampler) accepts a view without config.json
    but still refuses one whose config.json declares another format."""
    if not require_config and not (directory / "config.json").is_file():
        return None
    method, quant = _quant_method(directory, require_config)
    expected = VIEW_QUANT_METHODS[view]
    if method != expected:
        raise NotLaunchableError(
            f"{directory}: view {view} needs a checkpoint with quantization method {expected or 'none'}, "
            f"its config declares {method or 'none'}"
        )
    if view == "fp8" and list((quant or {}).get("weight_block_size") or []) != [128, 128]:
        raise NotLaunchableError(f"{directory}: fp8 view needs weight_block_size [128, 128] (block FP8)")
    if not any(directory.glob("*.safetensors")):
        raise NotLaunchableError(f"{directory}: no *.safetensors weights")
    return method


def read_launch_file(cache_dir: Path) -> tuple[int, Path] | None:
    """(version, directory) from the cache's launch file, None if absent or malformed."""
    try:
        version, _, directory = (cache_dir / LAUNCH_FILE).read_text().strip().partition(" ")
    except FileNotFoundError:
        return None
    if not version.isdigit() or not directory:
        return None
    return int(version), Path(directory)


def write_launch_file(cache_dir: Path, version: int, directory: Path) -> None:
    """Atomically (temp file + rename) name the checkpoint SGLang launches from."""
    tmp = cache_dir / f".{LAUNCH_FILE}.{os.getpid()}.tmp"
    tmp.write_text(f"{version} {directory}\n")
    os.replace(tmp, cache_dir / LAUNCH_FILE)


# ----------------------------------------------------------------------------------------------
# Engine clients (SGLang HTTP API, 0.5.23)


def _check_response(response: httpx.Response, what: str) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = {"message": response.text[:200]}
    if not isinstance(body, dict):
        body = {"message": str(body)[:200]}
    if response.status_code != 200 or body.get("success") is False:
        raise EngineError(f"{what}: HTTP {response.status_code}: {body.get('message', '')}".strip())
    return body


class DiskEngine:
    """Applies a verified local directory with `/update_weights_from_disk`."""

    mode = "disk"

    def __init__(
        self, client: httpx.AsyncClient, *, flush_cache: bool = True, abort_all_requests: bool = False
    ) -> None:
        self.client = client
        self.flush_cache = flush_cache
        self.abort_all_requests = abort_all_requests

    async def apply(self, version: int, model_dir: Path, manifest: Manifest, view: str) -> None:
        body = {
            "model_path": str(model_dir),
            "weight_version": str(version),
            "flush_cache": self.flush_cache,
            "abort_all_requests": self.abort_all_requests,
        }
        _check_response(
            await self.client.post("/update_weights_from_disk", json=body), "update_weights_from_disk"
        )


Sender = Callable[[int, Path, list[str]], Awaitable[None]]
"""Push data plane: broadcast the named tensors of `model_dir` over the NCCL update group (GPU only)."""


@dataclass
class PushGroup:
    master_address: str
    master_port: int
    rank_offset: int = 1
    world_size: int = 2
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class PushEngine:
    """Applies a version with the pause / begin / update_weights_from_distributed / end / continue sequence."""

    mode = "push"

    def __init__(
        self,
        client: httpx.AsyncClient,
        group: PushGroup,
        *,
        sender: Sender | None = None,
        bucket_bytes: int = 512 * 1024 * 1024,
        load_format: str | None = None,
    ) -> None:
        self.client = client
        self.group = group
        self.sender = sender
        self.bucket_bytes = bucket_bytes
        self.load_format = load_format
        self._initialized = False

    @staticmethod
    def buckets(manifest: Manifest, view: str, bucket_bytes: int) -> list[list[tuple[str, str, list[int]]]]:
        """Tensors of the view as (name, torch dtype, shape), in buckets of at most ~bucket_bytes."""
        sizes = {
            "BF16": 2,
            "F16": 2,
            "F32": 4,
            "F64": 8,
            "F8_E4M3": 1,
            "F8_E5M2": 1,
            "U8": 1,
            "I8": 1,
            "I16": 2,
            "I32": 4,
            "I64": 8,
            "BOOL": 1,
        }
        out: list[list[tuple[str, str, list[int]]]] = [[]]
        used = 0
        for name, meta in sorted(manifest.views[view].tensors.items()):
            n = sizes.get(meta["dtype"], 4)
            for d in meta["shape"]:
                n *= d
            if out[-1] and used + n > bucket_bytes:
                out.append([])
                used = 0
            out[-1].append(
                (name, TORCH_DTYPES.get(meta["dtype"], meta["dtype"].lower()), list(meta["shape"]))
            )
            used += n
        return [b for b in out if b]

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return _check_response(await self.client.post(path, json=body), path.lstrip("/"))

    async def apply(self, version: int, model_dir: Path, manifest: Manifest, view: str) -> None:
        if not self._initialized:
            await self._post("/init_weights_update_group", asdict(self.group))
            self._initialized = True
        await self._post("/pause_generation", {"mode": "retract"})
        try:
            await self._post("/begin_weight_update", {})
            for bucket in self.buckets(manifest, view, self.bucket_bytes):
                names = [n for n, _, _ in bucket]
                request = self._post(
                    "/update_weights_from_distributed",
                    {
                        "names": names,
                        "dtypes": [d for _, d, _ in bucket],
                        "shapes": [s for _, _, s in bucket],
                        "group_name": self.group.group_name,
                        "weight_version": str(version),
                        "load_format": self.load_format,
                    },
                )
                if self.sender is None:
                    await request
                else:  # the engine's request blocks until it received the broadcast
                    await asyncio.gather(request, self.sender(version, model_dir, names))
            await self._post("/end_weight_update", {})
        finally:
            await self._post("/continue_generation", {})


# ----------------------------------------------------------------------------------------------
# The reconciler


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
    request_timeout: float = 600.0
    report_interval: float = SUBSCRIBER_HEARTBEAT_SECONDS
    """Heartbeat of the subscriber report when nothing changed (seconds). Readers age reports out
    after rlfleet.channel.SUBSCRIBER_STALE_AFTER_SECONDS (five default heartbeats): keep it well below."""
    require_checkpoint: bool = False
    """Refuse a view without config.json (SGLang: it launches and reloads only HF checkpoints)."""


@dataclass
class LastApply:
    version: int
    download_seconds: float
    apply_seconds: float
    total_seconds: float
    bytes: int
    at: str


@dataclass
class SyncState:
    applied_version: int | None = None
    latest_version: int | None = None
    phase: str = "starting"
    consecutive_failures: int = 0
    failures: dict[str, int] = field(
        default_factory=lambda: {"store": 0, "checksum": 0, "engine": 0, "internal": 0}
    )
    last_error: str | None = None
    last_apply: LastApply | None = None
    next_attempt_at: float = 0.0
    report_failures: int = 0
    """Failed writes of the subscriber report (total)."""
    report_failure_streak: int = 0
    """Failed writes since the last one that succeeded (0: the last write succeeded)."""


class Metrics:
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
        self.failures = {
            r: failures.labels(**labels, reason=r) for r in ("store", "checksum", "engine", "internal")
        }
        self.report_failures = Counter(
            "rlfleet_weight_sync_report_failures",
            "Failed writes of this replica's subscriber report to the store.",
            list(labels),
            registry=self.registry,
        ).labels(**labels)
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


class Syncer:
    """Reconciles one engine to the channel pointer."""

    def __init__(self, config: SyncConfig, store: Store, engine: DiskEngine | PushEngine) -> None:
        self.config = config
        self.channel = WeightChannel(store, publisher_id=f"sync-{config.group}-{config.replica}")
        self.engine = engine
        self.state = SyncState(applied_version=config.initial_version)
        self.metrics = Metrics(config.group, config.view)
        if config.initial_version is not None:
            self.metrics.applied.set(config.initial_version)
        self.config.cache_dir.mkdir(parents=True, exist_ok=True)
        self._last_report: tuple[Any, ...] | None = None
        self._last_report_at = 0.0
        self._report_target: int | None = None  # the version last reported as being downloaded
        self._report_lock = asyncio.Lock()  # one write at a time, in the order the reports were made

    # -- one reconciliation step
    async def reconcile_once(self) -> bool:
        """Bring the engine to the pointer. True if a version was applied; raises nothing."""
        state = self.state
        try:
            found = await asyncio.to_thread(newest_version_of_view, self.channel, self.config.view)
        except ChecksumMismatchError as e:
            self._failed("checksum", f"manifest: {e}")
            await self._report()
            return False
        except (StoreError, OSError, ValueError) as e:
            self._failed("store", f"read pointer: {e}")
            return False
        if found is None:
            state.phase = "waiting"
            await self._report()
            return False
        version, manifest = found
        state.latest_version = version
        self.metrics.latest.set(version)
        self._update_lag()
        if state.applied_version is not None and version <= state.applied_version:
            serving = await engine_weight_version(self.engine.client)
            if serving is None or serving == state.applied_version:
                state.phase = "in-sync"
                state.consecutive_failures = 0
                await self._report()
                return False
            # The engine restarted (or someone else loaded weights): it no longer serves what we
            # applied. Believe the engine and bring it back to the pointer.
            log.warning("engine serves v%d, not the applied v%d: re-applying", serving, state.applied_version)
            state.applied_version = serving
            self.metrics.applied.set(serving)
            if version <= serving:
                return False
        state.phase = "downloading"
        await self._report(target=version)
        t0 = time.perf_counter()
        try:
            target = await asyncio.to_thread(self._download_verified, version, manifest)
        except ChecksumMismatchError as e:
            self._failed("checksum", f"v{version}: {e}")
            await self._report()
            return False
        except NotLaunchableError as e:
            self._failed("checksum", f"v{version}: {e}")
            await self._report()
            return False
        except (StoreError, OSError, ValueError) as e:
            reason = "checksum" if isinstance(e, ChannelError) and "no view" not in str(e) else "store"
            self._failed(reason, f"v{version}: {e}")
            await self._report()
            return False
        t1 = time.perf_counter()
        state.phase = "applying"
        try:
            await self.engine.apply(version, target, manifest, self.config.view)
        except (EngineError, httpx.HTTPError) as e:
            self._failed("engine", f"v{version}: {e}")
            await self._report()
            return False
        t2 = time.perf_counter()
        state.applied_version = version
        state.consecutive_failures = 0
        state.last_error = None
        state.phase = "in-sync"
        state.last_apply = LastApply(
            version, t1 - t0, t2 - t1, t2 - t0, manifest.views[self.config.view].bytes, now_iso()
        )
        self.metrics.applied.set(version)
        self.metrics.applies.inc()
        self.metrics.download.observe(t1 - t0)
        self.metrics.apply.observe(t2 - t1)
        self._update_lag()
        write_launch_file(self.config.cache_dir, version, target)  # a restarted engine starts here
        self._prune_local()
        log.info(
            "applied weights v%d (%s) download %.2fs apply %.2fs", version, self.config.view, t1 - t0, t2 - t1
        )
        await self._report()
        return True

    def _download_verified(self, version: int, manifest: Manifest) -> Path:
        """Download this pod's view of `version`, verify every file (BLAKE3) and that SGLang would load
        it in the view's format; the directory is never used otherwise."""
        target = self.config.cache_dir / f"v{version}-{self.config.view}"
        self.channel.download_view(version, self.config.view, target, manifest=manifest)
        try:
            check_launchable(target, self.config.view, require_config=self.config.require_checkpoint)
        except NotLaunchableError:
            shutil.rmtree(target, ignore_errors=True)
            raise
        return target

    async def fetch_for_launch(self, stop: asyncio.Event) -> tuple[int, Path] | None:
        """Init-container mode: wait for the newest version of the view, download + verify it, write
        the launch file. Returns (version, dir), or None if stopped first. Retries every failure
        (nothing published yet, store down, checksum) with the sidecar's backoff."""
        state = self.state
        async with self._heartbeating(stop):  # the report stays fresh during a long download
            while not stop.is_set():
                try:
                    found = await asyncio.to_thread(newest_version_of_view, self.channel, self.config.view)
                    if found is None:
                        state.phase = "waiting"
                        state.consecutive_failures = 0
                        log.info(
                            "waiting for version 0 of view %s in %s", self.config.view, self.channel.store.uri
                        )
                        await self._report()
                    else:
                        version, manifest = found
                        state.latest_version = version
                        state.phase = "downloading"
                        await self._report(target=version)
                        target = await asyncio.to_thread(self._download_verified, version, manifest)
                        write_launch_file(self.config.cache_dir, version, target)
                        state.phase = "fetched"
                        log.info("launch checkpoint: v%d (%s) at %s", version, self.config.view, target)
                        # applied_version stays None (SGLang is not up yet); in_use keeps v from retention
                        await self._report(target=version)
                        return version, target
                except ChecksumMismatchError as e:
                    self._failed("checksum", str(e))
                except NotLaunchableError as e:
                    self._failed("checksum", str(e))
                except (StoreError, OSError, ValueError) as e:
                    self._failed("store", str(e))
                await self._report()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.backoff_seconds())
            return None

    def _failed(self, reason: str, message: str) -> None:
        state = self.state
        state.failures[reason] += 1
        state.consecutive_failures += 1
        state.last_error = f"{reason}: {message}"[:1000]
        state.phase = "backoff"
        self.metrics.failures[reason].inc()
        log.warning("weight sync failed (%s), keeping v%s: %s", reason, state.applied_version, message)

    def _update_lag(self) -> None:
        s = self.state
        if s.latest_version is not None and s.applied_version is not None:
            self.metrics.lag.set(max(0, s.latest_version - s.applied_version))

    def _prune_local(self) -> None:
        dirs = sorted(
            (p for p in self.config.cache_dir.glob(f"v*-{self.config.view}") if p.is_dir()),
            key=lambda p: int(p.name[1:].split("-", 1)[0]) if p.name[1:].split("-", 1)[0].isdigit() else -1,
        )
        launched = read_launch_file(self.config.cache_dir)
        for stale in dirs[: -self.config.keep_local]:
            if launched is None or stale != launched[1]:  # never what a restarted engine would launch
                shutil.rmtree(stale, ignore_errors=True)

    async def _report(self, target: int | None = None) -> None:
        """Write this replica's report when it changed or `report_interval` passed since the last write.
        `target`: the version being downloaded (reported in use, so retention keeps it); the heartbeat
        repeats the last one given."""
        async with self._report_lock:
            self._report_target = target
            in_use = sorted({v for v in (self.state.applied_version, target) if v is not None})
            report = SubscriberReport(
                group=self.config.group,
                replica=self.config.replica,
                view=self.config.view,
                applied_version=self.state.applied_version,
                in_use=in_use,
                updated_at=now_iso(),
                failures=sum(self.state.failures.values()),
                last_error=self.state.last_error,
            )
            # Write when something changed, else only as a heartbeat (every replica polls every few
            # seconds: rewriting an unchanged report each time would be most of the store's traffic).
            content = (
                report.view,
                report.applied_version,
                tuple(report.in_use),
                report.failures,
                report.last_error,
            )
            now = time.monotonic()
            if content == self._last_report and now - self._last_report_at < self.config.report_interval:
                return
            try:
                await asyncio.to_thread(self.channel.report, report)
            except (StoreError, OSError) as e:
                self._report_failed(e)
                return
            self._last_report, self._last_report_at = content, now
            if self.state.report_failure_streak:
                log.info(
                    "subscriber report written again after %d failed attempts",
                    self.state.report_failure_streak,
                )
                self.state.report_failure_streak = 0

    def _report_failed(self, error: Exception) -> None:
        """Count a failed report write; a WARNING on the first failure of a streak, DEBUG after."""
        state = self.state
        state.report_failures += 1
        state.report_failure_streak += 1
        self.metrics.report_failures.inc()
        key = f"subscribers/{self.config.group}/{self.config.replica}.json"
        if state.report_failure_streak == 1:
            log.warning(
                "could not write the subscriber report %s to %s: %s. Until it is written, retention may "
                "delete a version this replica downloads and the operator shows no version for it once "
                "the last report ages out; retrying at every step (logged again once it succeeds)",
                key, self.channel.store.uri, error,
            )  # fmt: skip
        else:
            log.debug("could not write the subscriber report %s (%d in a row): %s", key,
                      state.report_failure_streak, error)  # fmt: skip

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        """Rewrite the report every `report_interval` even while a step runs for longer (a download of a
        large view, a slow apply): readers age reports out after SUBSCRIBER_STALE_AFTER_SECONDS."""
        tick = max(0.05, self.config.report_interval / 2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=tick)
            if stop.is_set():
                return
            try:
                await self._report(self._report_target)
            except Exception:  # the heartbeat must never die: the next tick retries
                log.exception("subscriber report heartbeat failed")

    @contextlib.asynccontextmanager
    async def _heartbeating(self, stop: asyncio.Event) -> AsyncIterator[None]:
        task = asyncio.create_task(self._heartbeat(stop))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def backoff_seconds(self) -> float:
        n = self.state.consecutive_failures
        if n == 0:
            return self.config.poll_interval
        delay = min(self.config.backoff_max, self.config.backoff_base * 2 ** (n - 1))
        return delay * random.uniform(0.5, 1.0)  # jitter: replicas do not retry in lockstep

    async def run(self, stop: asyncio.Event) -> None:
        async with self._heartbeating(stop):
            while not stop.is_set():
                try:
                    await self.reconcile_once()
                except Exception as e:  # a bug must not stop the sidecar: count it, keep serving, retry
                    log.exception("weight sync step crashed")
                    self._failed("internal", repr(e))
                delay = self.backoff_seconds()
                self.state.next_attempt_at = time.time() + delay
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)
        await self._withdraw_report()

    async def _withdraw_report(self) -> None:
        """A replica that stops cleanly (its pod deleted or replaced: SIGTERM) deletes its own report at
        once, so it pins no version and counts in no status; a replica that dies without this is aged
        out by readers after SUBSCRIBER_STALE_AFTER_SECONDS and removed by the operator (docs/weights.md,
        "Subscriber reports")."""
        async with self._report_lock:  # no report write of this replica runs after this
            try:
                await asyncio.to_thread(self.channel.remove_subscriber, self.config.group, self.config.replica)
            except (StoreError, OSError) as e:
                log.warning("could not remove this replica's subscriber report on shutdown (%s); it ages "
                            "out after %d s", e, SUBSCRIBER_STALE_AFTER_SECONDS)  # fmt: skip

    # -- HTTP
    def status(self) -> dict[str, Any]:
        s = self.state
        lag = (
            None
            if s.latest_version is None or s.applied_version is None
            else max(0, s.latest_version - s.applied_version)
        )
        return {
            "group": self.config.group,
            "replica": self.config.replica,
            "view": self.config.view,
            "mode": self.engine.mode,
            "store": self.channel.store.uri,
            "engine_url": self.config.engine_url,
            "applied_version": s.applied_version,
            "latest_version": s.latest_version,
            "lag": lag,
            "phase": s.phase,
            "consecutive_failures": s.consecutive_failures,
            "failures": dict(s.failures),
            "last_error": s.last_error,
            "report_failures": s.report_failures,
            "last_apply": asdict(s.last_apply) if s.last_apply else None,
            "next_attempt_in_seconds": max(0.0, round(s.next_attempt_at - time.time(), 3))
            if s.next_attempt_at
            else None,
        }

    def app(self) -> web.Application:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(
                body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
            )

        async def status(_: web.Request) -> web.Response:
            return web.json_response(self.status())

        async def health(_: web.Request) -> web.Response:
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/status", status)
        app.router.add_get("/health", health)
        return app


async def engine_weight_version(client: httpx.AsyncClient) -> int | None:
    """The version the engine reports serving, if it says (best effort: /model_info weight_version)."""
    with contextlib.suppress(httpx.HTTPError, ValueError, TypeError, AttributeError):
        response = await client.get("/model_info", timeout=5.0)
        if response.status_code == 200:
            value = response.json().get("weight_version")
            if value is not None and str(value).isdigit():
                return int(value)
    return None


async def serve(
    config: SyncConfig,
    *,
    push_group: PushGroup | None = None,
    stop: asyncio.Event | None = None,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Run the sidecar until `stop` is set (or forever)."""
    stop = stop or asyncio.Event()
    store = open_store(config.store)
    async with httpx.AsyncClient(
        base_url=config.engine_url.rstrip("/"), timeout=config.request_timeout
    ) as client:
        if config.initial_version is None:  # the version SGLang launched from (engine may still load)
            launched = read_launch_file(config.cache_dir)
            config.initial_version = launched[0] if launched else await engine_weight_version(client)
        engine: DiskEngine | PushEngine = (
            DiskEngine(client) if push_group is None else PushEngine(client, push_group)
        )
        syncer = Syncer(config, store, engine)
        runner = web.AppRunner(syncer.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        port = (
            site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else config.port
        )  # type: ignore[union-attr]
        log.info("weight sync sidecar for %s/%s (%s) on :%d", config.group, config.replica, config.view, port)
        if ready is not None:
            ready(port)
        try:
            await syncer.run(stop)
        finally:
            await runner.cleanup()
            store.close()


async def fetch(config: SyncConfig, *, stop: asyncio.Event | None = None) -> tuple[int, Path] | None:
    """Init-container mode (`--fetch-only`): the launch checkpoint, or None if stopped first."""
    store = open_store(config.store)
    try:
        async with httpx.AsyncClient(base_url=config.engine_url.rstrip("/")) as client:
            syncer = Syncer(config, store, DiskEngine(client))
            return await syncer.fetch_for_launch(stop or asyncio.Event())
    finally:
        store.close()


class _OneLineErrorParser(argparse.ArgumentParser):
    """Bad input: one clear line on stderr and exit 2 (no usage dump, no stack trace)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _OneLineErrorParser(
        prog="rlfleet sampler sync",
        description="Weight-sync sidecar: reconcile an engine to the weight channel.",
    )
    p.add_argument(
        "--store",
        required=True,
        help="channel store: a path, file://path or s3://bucket/prefix[?endpoint=URL]",
    )
    p.add_argument("--view", required=True, choices=VIEW_NAMES, help="precision view this engine loads")
    p.add_argument("--engine-url", required=True, help="engine base URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--group", required=True, help="SamplerGroup name")
    p.add_argument("--replica", required=True, help="replica (pod) name")
    p.add_argument(
        "--cache-dir", default="/tmp/rlfleet-weights", help="local directory shared with the engine"
    )
    p.add_argument("--host", default="0.0.0.0", help="bind address of /metrics /status /health")
    p.add_argument(
        "--port", type=int, default=9400, help="port of /metrics /status /health (0: any free port)"
    )
    p.add_argument("--port-file", default=None, help="write the bound port here once listening")
    p.add_argument(
        "--poll-interval", type=float, default=2.0, help="seconds between pointer reads when in sync"
    )
    p.add_argument(
        "--backoff-max", type=float, default=60.0, help="cap of the exponential retry backoff (seconds)"
    )
    p.add_argument(
        "--initial-version",
        type=int,
        default=None,
        help="version the engine starts with (default: ask /model_info)",
    )
    p.add_argument(
        "--mode",
        choices=("disk", "push"),
        default="disk",
        help="disk: /update_weights_from_disk; push: NCCL update group",
    )
    p.add_argument(
        "--push-master", default=None, help="push mode: master_address:master_port of the update group"
    )
    p.add_argument(
        "--fetch-only",
        action="store_true",
        help="init container: wait for the newest version of the view, download + verify it into "
        "--cache-dir, write the launch file SGLang starts from, exit (implies --require-checkpoint)",
    )
    p.add_argument(
        "--require-checkpoint",
        action="store_true",
        help="load only views that are HF checkpoints (config.json whose quantization matches the view)",
    )
    return p


def cli(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        check_name("group", args.group)
        check_name("replica", args.replica)
        open_store(args.store)
    except ValueError as e:
        parser.error(str(e))
    if not args.engine_url.startswith(("http://", "https://")):
        parser.error(f"--engine-url must be an http(s) URL, got {args.engine_url!r}")
    if not 0 <= args.port <= 65535:
        parser.error("--port must be in 0..65535")
    push_group = None
    if args.mode == "push":
        if not args.push_master or ":" not in args.push_master:
            parser.error("--mode push needs --push-master host:port")
        host, _, port = args.push_master.rpartition(":")
        if not port.isdigit():
            parser.error("--push-master port must be a number")
        push_group = PushGroup(master_address=host, master_port=int(port))
    config = SyncConfig(
        store=args.store,
        view=args.view,
        engine_url=args.engine_url,
        group=args.group,
        replica=args.replica,
        cache_dir=Path(args.cache_dir),
        host=args.host,
        port=args.port,
        poll_interval=args.poll_interval,
        backoff_max=args.backoff_max,
        initial_version=args.initial_version,
        require_checkpoint=args.require_checkpoint or args.fetch_only,
    )
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )

    async def main() -> int:
        import signal

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)  # finish the current step, then exit cleanly

        if args.fetch_only:
            return 0 if await fetch(config, stop=stop) is not None else 1

        def ready(port: int) -> None:
            if args.port_file:
                Path(args.port_file).write_text(str(port))

        await serve(config, push_group=push_group, stop=stop, ready=ready)
        return 0

    return asyncio.run(main())
