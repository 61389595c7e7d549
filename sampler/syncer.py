"""The weight-sync reconcile loop: brings one engine to the weight channel's pointer.

Loop: read the pointer; if it names a version newer than the applied one, report it as "in use" (so
retention keeps it), obtain this pod's view verified (below), check that SGLang would load it in the
view's format, then apply it through the engine client (engine_clients.py). Any failure (store
unreachable, checksum mismatch, engine error) is counted by reason, the engine keeps serving the
version it has, and the loop retries with exponential backoff (with jitter).

Obtaining a version, verified BEFORE the engine sees the directory (the manifest against the
pointer's sha256, every file against the manifest's digest of the complete file; an entry naming an
algorithm this sidecar does not know is refused, reason "checksum"):
- by default: into `cache_dir` (the pod's local volume, an emptyDir shared with the engine container):
  an anchor downloaded, a delta version rebuilt from this sidecar's newest local copy on its chain (or,
  for a new replica or one that was down across an anchor, from the anchor at or below it) plus the
  deltas after it, every step verified (`WeightChannel.obtain_view`; docs/weights.md, "Rebuilding a
  view"); the newest `keep_local` copies are kept, the bases of the next versions;
- `in_place` (a filesystem store the engine also sees): an anchor's files hashed where the channel holds
  them, and the engine loads that directory; no copy (a delta version is rebuilt into `cache_dir` as
  above). Retention keeps it while it is served: the version stays in this replica's report
  (`applied_version`, `in_use`) (docs/weights.md, "Loading in place").
A hidden partial directory an earlier run left in `cache_dir` (killed while it rebuilt) is removed at start.

`fetch_for_launch` is the init container's mode (`--fetch-only`): wait for the newest version of the
view, obtain it verified, write the cache's launch file and return.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from rlfleet.api.common import FOREIGN_WEIGHTS_PREFIX
from rlfleet.channel import (
    READ_KINDS,
    ChannelError,
    ChecksumMismatchError,
    Manifest,
    ObtainedView,
    RebuildError,
    WeightChannel,
    newest_version_of_view,
    now_iso,
)
from rlfleet.lora import LORA_VIEW
from rlfleet.sampler.engine_clients import DiskEngine, EngineError, LoraEngine, engine_weight_version
from rlfleet.sampler.launch_checkpoint import (
    NotLaunchableError,
    check_adapter,
    check_launchable,
    read_launch_file,
    write_launch_file,
)
from rlfleet.sampler.sync_report import SubscriberReporter
from rlfleet.sampler.sync_state import LastApply, SyncConfig, SyncMetrics, SyncState
from rlfleet.store import Store, StoreError

log = logging.getLogger("rlfleet.sampler.sync")


class Syncer:
    """Reconciles one engine to the channel pointer."""

    def __init__(self, config: SyncConfig, store: Store, engine: DiskEngine | LoraEngine) -> None:
        self.config = config
        # The view each version is applied from: the pod's own view, or with LoRA every version's adapter
        # (the pod's view is then its base, obtained once for the engine's launch: fetch_for_launch).
        self.followed_view = LORA_VIEW if config.lora else config.view
        self.channel = WeightChannel(store, publisher_id=f"sync-{config.group}-{config.replica}")
        self.engine = engine
        self.state = SyncState(applied_version=config.initial_version)
        self.metrics = SyncMetrics(config.group, config.view)
        if config.initial_version is not None:
            self.metrics.applied.set(config.initial_version)
        self.config.cache_dir.mkdir(parents=True, exist_ok=True)
        self._remove_partial_copies()
        self.reporter = SubscriberReporter(self.channel, config, self.state, self.metrics)

    # -- one reconciliation step
    async def reconcile_once(self) -> bool:
        """Bring the engine to the pointer. True if a version was applied; raises nothing."""
        state = self.state
        try:
            found = await asyncio.to_thread(newest_version_of_view, self.channel, self.followed_view)
        except ChecksumMismatchError as e:
            self._failed("checksum", f"manifest: {e}")
            await self.reporter.report()
            return False
        except (StoreError, OSError, ValueError) as e:
            self._failed("store", f"read pointer: {e}")
            return False
        if found is None:
            state.phase = "waiting"
            await self.reporter.report()
            return False
        version, manifest = found
        state.latest_version = version
        self.metrics.latest.set(version)
        self._update_lag()
        if not await self._behind(version):
            return False
        state.phase = "downloading"
        await self.reporter.report(target=version)
        t0 = time.perf_counter()
        try:
            obtained = await asyncio.to_thread(self._obtain_verified, version, manifest)
        except (StoreError, OSError, ValueError) as e:
            self._failed(_obtain_failure_reason(e), f"v{version}: {e}")
            await self.reporter.report()
            return False
        t1 = time.perf_counter()
        state.phase = "applying"
        try:
            await self.engine.apply(version, obtained.directory, manifest, self.followed_view)
        except (EngineError, httpx.HTTPError) as e:
            self._failed("engine", f"v{version}: {e}")
            await self.reporter.report()
            return False
        self._applied(obtained, manifest, t0, t1, time.perf_counter())
        await self.reporter.report()
        return True

    async def _behind(self, version: int) -> bool:
        """Whether the engine needs `version`: it is newer than the applied one, or the engine serves
        something other than what this sidecar applied (it restarted from other weights, or another
        client called its weight-update API). The engine's word is never taken as the applied version:
        a foreign load (any path, any version, even one the channel never published) is replaced by the
        channel's verified `version` and counted (docs/sampler.md, "The engine API")."""
        state = self.state
        if state.applied_version is None or version > state.applied_version:
            return True
        if isinstance(self.engine, LoraEngine):
            serving = await self.engine.serving()
            if serving is None:  # a restarted engine holds no adapter: load the channel's again
                log.info("the engine holds no adapter (restarted?): loading v%d again", version)
                return True
        else:
            serving = await engine_weight_version(self.engine.client)
        if serving is None or serving == state.applied_version:
            state.phase = "in-sync"
            state.consecutive_failures = 0
            await self.reporter.report()
            return False
        self._foreign(serving, version)
        return True

    def _foreign(self, serving: int, version: int) -> None:
        """Count an engine that serves `serving`, which this sidecar did not apply; `version` (the
        channel's) is applied next."""
        state = self.state
        state.foreign_versions += 1
        state.foreign_message = foreign_version_message(
            serving, state.applied_version, version, state.foreign_versions, now_iso()
        )
        self.metrics.foreign_versions.inc()
        log.warning("%s", state.foreign_message)

    def _applied(self, obtained: ObtainedView, manifest: Manifest, t0: float, t1: float, t2: float) -> None:
        version, target = obtained.version, obtained.directory
        state = self.state
        if version != state.applied_version:
            state.foreign_message = None  # a newer version applied: a restored foreign load is history
        state.applied_version = version
        state.consecutive_failures = 0
        state.last_error = None
        state.phase = "in-sync"
        state.last_apply = LastApply(
            version,
            t1 - t0,
            t2 - t1,
            t2 - t0,
            manifest.views[self.followed_view].bytes,
            now_iso(),
            sum(obtained.read_bytes.values()),
            obtained.describe(),
        )
        self.metrics.applied.set(version)
        self.metrics.applies.inc()
        self.metrics.download.observe(t1 - t0)
        self.metrics.apply.observe(t2 - t1)
        self._update_lag()
        if not self.config.lora:  # with LoRA the engine restarts from its base, then loads the adapter
            write_launch_file(self.config.cache_dir, version, target)  # a restarted engine starts here
        self._prune_local()
        log.info(
            "applied weights v%d (%s) from %s, %s: obtain %.2fs apply %.2fs",
            version,
            self.followed_view,
            obtained.describe(),
            _bytes_read(obtained),
            t1 - t0,
            t2 - t1,
        )

    def _obtain_verified(self, version: int, manifest: Manifest, view: str | None = None) -> ObtainedView:
        """This pod's view of `version` (default: the followed one) with every file verified (BLAKE3) and
        checked to be what the engine loads (a checkpoint SGLang would load in the view's format, or a
        LoRA adapter): the channel's own directory (`in_place`, an anchor) or a
        verified copy in the cache (downloaded, or rebuilt from a local copy or an anchor plus deltas); a
        directory that fails is never handed to the engine. A rebuild that had to reseed from the anchor
        is counted as a failure of its reason (the view is still obtained)."""
        view = view or self.followed_view
        if self.config.in_place and view != LORA_VIEW and manifest.views[view].delta is None:
            read = dict.fromkeys(READ_KINDS, 0)

            def count(kind: str, nbytes: int) -> None:
                read[kind] += nbytes
                self._count_read(kind, nbytes)

            target = self.channel.verify_view_in_place(version, view, manifest=manifest, on_read=count)
            check_launchable(target, view, require_config=self.config.require_checkpoint)
            return ObtainedView(target, version, f"anchor v{version} in place", (), read)
        target = self.config.cache_dir / f"v{version}-{view}"
        obtained = self.channel.obtain_view(
            version, view, target, manifest=manifest, local=self._local_copies(view), on_read=self._count_read
        )
        if obtained.fallback is not None:
            self._recovered(_obtain_failure_reason(obtained.fallback), f"v{version}: {obtained.fallback}")
        try:
            if view == LORA_VIEW:
                check_adapter(target)
            else:
                check_launchable(target, view, require_config=self.config.require_checkpoint)
        except NotLaunchableError:
            shutil.rmtree(target, ignore_errors=True)
            raise
        return obtained

    def _count_read(self, kind: str, nbytes: int) -> None:
        """Bytes read from the store, by kind (rlfleet.channel.READ_KINDS): /status and /metrics."""
        self.state.read_bytes[kind] += nbytes
        self.metrics.read_bytes[kind].inc(nbytes)

    def _local_copies(self, view: str) -> dict[int, Path]:
        """Version -> this sidecar's verified copy of `view` in the cache (`v<N>-<view>`, renamed into place
        only once verified): the bases a delta version is rebuilt from."""
        copies = {}
        for directory in self.config.cache_dir.glob(f"v*-{view}"):
            number = directory.name[1:].removesuffix(f"-{view}")
            if number.isdigit() and directory.is_dir():
                copies[int(number)] = directory
        return copies

    def _remove_partial_copies(self) -> None:
        """Remove the hidden partial directories (`.v<N>-<view>.partial-<id>`, WeightChannel.obtain_view) an
        earlier run of this sidecar left in the cache when it was killed while it downloaded or rebuilt:
        never a view (only a verified directory is renamed to `v<N>-<view>`), only its disk space."""
        for view in dict.fromkeys((self.config.view, self.followed_view)):
            for partial in self.config.cache_dir.glob(f".v*-{view}.partial-*"):
                log.info(
                    "removing %s, a partial copy left by an earlier run (killed while obtaining it)", partial
                )
                shutil.rmtree(partial, ignore_errors=True)

    async def fetch_for_launch(self, stop: asyncio.Event) -> tuple[int, Path] | None:
        """Init-container mode: wait for the newest version of the view, obtain it verified, write the
        launch file. Returns (version, dir), or None if stopped first. Retries every failure (nothing
        published yet, store down, checksum) with the sidecar's backoff."""
        state = self.state
        async with self.reporter.heartbeating(stop):  # the report stays fresh during a long download
            while not stop.is_set():
                try:
                    found = await asyncio.to_thread(newest_version_of_view, self.channel, self.config.view)
                    if found is not None:
                        return await self._fetch(*found)
                    state.phase = "waiting"
                    state.consecutive_failures = 0
                    log.info(
                        "waiting for version 0 of view %s in %s", self.config.view, self.channel.store.uri
                    )
                except (StoreError, OSError, ValueError) as e:
                    self._failed(_obtain_failure_reason(e), str(e))
                await self.reporter.report()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.backoff_seconds())
            return None

    async def _fetch(self, version: int, manifest: Manifest) -> tuple[int, Path]:
        state = self.state
        state.latest_version = version
        state.phase = "downloading"
        await self.reporter.report(target=version)
        obtained = await asyncio.to_thread(self._obtain_verified, version, manifest, self.config.view)
        target = obtained.directory
        write_launch_file(self.config.cache_dir, version, target)
        state.phase = "fetched"
        log.info(
            "launch checkpoint: v%d (%s) at %s, from %s, %s",
            version,
            self.config.view,
            target,
            obtained.describe(),
            _bytes_read(obtained),
        )
        # applied_version stays None (the engine is not up yet); in_use keeps v from retention
        await self.reporter.report(target=version)
        return version, target

    def _failed(self, reason: str, message: str) -> None:
        state = self.state
        state.failures[reason] += 1
        state.consecutive_failures += 1
        state.last_error = f"{reason}: {message}"[:1000]
        state.phase = "backoff"
        self.metrics.failures[reason].inc()
        log.warning("weight sync failed (%s), keeping v%s: %s", reason, state.applied_version, message)

    def _recovered(self, reason: str, message: str) -> None:
        """Count a failure the step recovered from by itself (a local copy that no longer verified: the view
        was reseeded from the anchor): counted and logged like a failure, no backoff."""
        self.state.failures[reason] += 1
        self.metrics.failures[reason].inc()
        log.warning("weight sync recovered (%s): %s", reason, message)

    def _update_lag(self) -> None:
        s = self.state
        if s.latest_version is not None and s.applied_version is not None:
            self.metrics.lag.set(max(0, s.latest_version - s.applied_version))

    def _prune_local(self) -> None:
        """Delete all but the newest `keep_local` cache copies (in place: there are none)."""
        dirs = sorted(
            (p for p in self.config.cache_dir.glob(f"v*-{self.followed_view}") if p.is_dir()),
            key=lambda p: int(p.name[1:].split("-", 1)[0]) if p.name[1:].split("-", 1)[0].isdigit() else -1,
        )
        launched = read_launch_file(self.config.cache_dir)
        for stale in dirs[: -self.config.keep_local]:
            if launched is None or stale != launched[1]:  # never what a restarted engine would launch
                shutil.rmtree(stale, ignore_errors=True)

    def backoff_seconds(self) -> float:
        n = self.state.consecutive_failures
        if n == 0:
            return self.config.poll_interval
        delay = min(self.config.backoff_max, self.config.backoff_base * 2 ** (n - 1))
        return delay * random.uniform(0.5, 1.0)  # jitter: replicas do not retry in lockstep

    async def run(self, stop: asyncio.Event) -> None:
        async with self.reporter.heartbeating(stop):
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
        await self.reporter.withdraw()

    def status(self) -> dict[str, Any]:
        """The sidecar's `/status` JSON."""
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
            "in_place": self.config.in_place,
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
            "foreign_versions": s.foreign_versions,
            "foreign": s.foreign_message,
            "last_apply": asdict(s.last_apply) if s.last_apply else None,
            "read_bytes": dict(s.read_bytes),
            "next_attempt_in_seconds": max(0.0, round(s.next_attempt_at - time.time(), 3))
            if s.next_attempt_at
            else None,
        }


def foreign_version_message(serving: int, applied: int | None, version: int, count: int, at: str) -> str:
    """What the sidecar reports after its engine served `serving` instead of the `applied` version and
    `version` (the channel's) was applied again: the subscriber report's last_error, read by the operator
    (reason ForeignWeightVersion) until a newer version is applied."""
    return (
        f"{FOREIGN_WEIGHTS_PREFIX} the engine served v{serving}, not v{applied} that this sidecar applied "
        f"(another client called its weight-update API, or it restarted from other weights); re-applied the "
        f"channel's v{version} ({count} since start, last at {at})"
    )


def _bytes_read(obtained: ObtainedView) -> str:
    """What obtaining a version read from the store, for its log line: "1234 bytes read (anchor 0, delta 1200,
    whole-file 34)" (the kinds of rlfleet.channel.READ_KINDS)."""
    kinds = ", ".join(f"{kind} {obtained.read_bytes.get(kind, 0)}" for kind in READ_KINDS)
    return f"{sum(obtained.read_bytes.values())} bytes read ({kinds})"


def _obtain_failure_reason(error: Exception) -> str:
    """A bad byte, an unknown digest algorithm, a refused checkpoint or a bad manifest is "checksum"; a
    delta version that cannot be rebuilt (its chain broken, a payload that does not fit its base) is
    "delta"; the store being unreachable, a missing file or a version without the view is "store"."""
    if isinstance(error, RebuildError):
        return "delta"
    if isinstance(error, ChecksumMismatchError | NotLaunchableError):
        return "checksum"
    if isinstance(error, ChannelError) and "no view" not in str(error):
        return "checksum"
    return "store"
