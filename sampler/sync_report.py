"""What one sidecar replica tells the store: its subscriber report (`subscribers/<group>/<replica>.json`),
which retention reads to keep the versions the replica uses and the operator reads for its status.

Written when its content changes, and otherwise every `report_interval`
(rlfleet.channel.SUBSCRIBER_HEARTBEAT_SECONDS) from a heartbeat task that also runs during long
downloads and applies; readers age a report out after SUBSCRIBER_STALE_AFTER_SECONDS. A failed write
is retried at the next step, counted (`report_failures`, `rlfleet_weight_sync_report_failures_total`)
and logged as a WARNING once per streak of failures. A replica that stops cleanly deletes its report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from rlfleet.api.common import SUBSCRIBERS_DIR
from rlfleet.channel import SUBSCRIBER_STALE_AFTER_SECONDS, SubscriberReport, WeightChannel, now_iso
from rlfleet.sampler.sync_state import SyncConfig, SyncMetrics, SyncState
from rlfleet.store import StoreError

log = logging.getLogger("rlfleet.sampler.sync")


class SubscriberReporter:
    """Writes one replica's report from the sidecar's `SyncState` (one write at a time, in order)."""

    def __init__(
        self, channel: WeightChannel, config: SyncConfig, state: SyncState, metrics: SyncMetrics
    ) -> None:
        self.channel = channel
        self.config = config
        self.state = state
        self.metrics = metrics
        self._last: tuple[Any, ...] | None = None
        self._last_at = 0.0
        self._target: int | None = None  # the version last reported as being obtained
        self._lock = asyncio.Lock()  # one write at a time, in the order the reports were made

    async def report(self, target: int | None = None) -> None:
        """Write the report when it changed or `report_interval` passed since the last write.
        `target`: the version being downloaded or verified (reported in use, so retention keeps it);
        the heartbeat repeats the last one given."""
        async with self._lock:
            self._target = target
            state = self.state
            in_use = sorted({v for v in (state.applied_version, target) if v is not None})
            report = SubscriberReport(
                group=self.config.group,
                replica=self.config.replica,
                view=self.config.view,
                applied_version=state.applied_version,
                in_use=in_use,
                updated_at=now_iso(),
                failures=sum(state.failures.values()),
                # a failing step says why; else a foreign load restored (until a newer version is applied)
                last_error=state.last_error or state.foreign_message,
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
            if content == self._last and now - self._last_at < self.config.report_interval:
                return
            try:
                await asyncio.to_thread(self.channel.report, report)
            except (StoreError, OSError) as e:
                self._failed(e)
                return
            self._last, self._last_at = content, now
            if state.report_failure_streak:
                log.info(
                    "subscriber report written again after %d failed attempts", state.report_failure_streak
                )
                state.report_failure_streak = 0

    def _failed(self, error: Exception) -> None:
        """Count a failed report write; a WARNING on the first failure of a streak, DEBUG after."""
        state = self.state
        state.report_failures += 1
        state.report_failure_streak += 1
        self.metrics.report_failures.inc()
        key = f"{SUBSCRIBERS_DIR}/{self.config.group}/{self.config.replica}.json"
        if state.report_failure_streak == 1:
            log.warning(
                "could not write the subscriber report %s to %s: %s. Until it is written, retention may "
                "delete a version this replica downloads and the operator shows no version for it once "
                "the last report ages out; retrying at every step (logged again once it succeeds)",
                key,
                self.channel.store.uri,
                error,
            )
        else:
            log.debug(
                "could not write the subscriber report %s (%d in a row): %s",
                key,
                state.report_failure_streak,
                error,
            )

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
                await self.report(self._target)
            except Exception:  # the heartbeat must never die: the next tick retries
                log.exception("subscriber report heartbeat failed")

    @contextlib.asynccontextmanager
    async def heartbeating(self, stop: asyncio.Event) -> AsyncIterator[None]:
        task = asyncio.create_task(self._heartbeat(stop))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def withdraw(self) -> None:
        """A replica that stops cleanly (its pod deleted or replaced: SIGTERM) deletes its own report at
        once, so it pins no version and counts in no status; a replica that dies without this is aged
        out by readers after SUBSCRIBER_STALE_AFTER_SECONDS and removed by the operator (docs/weights.md,
        "Subscriber reports")."""
        async with self._lock:  # no report write of this replica runs after this
            try:
                await asyncio.to_thread(
                    self.channel.remove_subscriber, self.config.group, self.config.replica
                )
            except (StoreError, OSError) as e:
                log.warning(
                    "could not remove this replica's subscriber report on shutdown (%s); it ages "
                    "out after %d s",
                    e,
                    SUBSCRIBER_STALE_AFTER_SECONDS,
                )
