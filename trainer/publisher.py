"""Trainer side of the weight channel: state dict -> the views subscribed groups need -> store -> pointer.

    publisher = WeightPublisher(open_store("/mnt/weights/job"), views=["bf16", "fp8"])
    result = publisher.publish(model.state_dict(), version=step)   # PublishResult(version, advanced, ...)

Views are written with `rlfleet.numerics.views.save_view` into a local staging directory, then
uploaded by `rlfleet.channel.WeightChannel.publish` (bytes durable -> manifest -> pointer). The set of
views is the configured one plus any view a subscribed sidecar reports following, so a group added
later gets its precision from the next version on.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlfleet.channel import PublishResult, WeightChannel
from rlfleet.numerics.views import VIEWS, check_view, save_view
from rlfleet.store import Store, StoreError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishTimings:
    convert_seconds: float
    upload_seconds: float
    retain_seconds: float


class WeightPublisher:
    """Publishes versions of a model's weights into a weight channel."""

    def __init__(
        self,
        store: Store,
        views: Iterable[str] = ("bf16",),
        *,
        follow_subscribers: bool = True,
        keep_versions: int | None = 3,
        staging_dir: str | Path | None = None,
        model_config: Mapping[str, Any] | None = None,
        publisher_id: str | None = None,
        upload_workers: int = 2,
    ) -> None:
        self.views = [check_view(v) for v in dict.fromkeys(views)]
        self.channel = WeightChannel(store, publisher_id=publisher_id, upload_workers=upload_workers)
        self.follow_subscribers = follow_subscribers
        self.keep_versions = keep_versions
        self.staging_dir = Path(staging_dir) if staging_dir else None
        self.model_config = dict(model_config) if model_config is not None else None
        self.last_timings: PublishTimings | None = None

    def views_needed(self) -> list[str]:
        """Configured views plus the views subscribed sidecars report (unknown names are ignored)."""
        needed = list(self.views)
        if self.follow_subscribers:
            try:
                reported = self.channel.subscribed_views()
            except StoreError as e:  # publishing must not depend on reading reports
                log.warning("could not read subscriber reports: %s", e)
                reported = set()
            needed += sorted(v for v in reported if v in VIEWS and v not in needed)
        return needed

    def publish(
        self,
        state_dict: Mapping[str, torch.Tensor],
        *,
        version: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> PublishResult:
        """Convert, upload and advance the pointer. `version`: e.g. the trainer step (must increase)."""
        views = self.views_needed()
        if not views:
            raise ValueError("no view to publish")
        cpu_state = {name: t.detach().to("cpu") for name, t in state_dict.items()}
        # Stage on the store's own filesystem when it has one: the view files are then written once
        # and renamed into place (no second copy of the bytes).
        staging = self.staging_dir or self.channel.store.staging_dir()
        if staging is not None:
            staging.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="rlfleet-publish-", dir=staging) as tmp:
            t0 = time.perf_counter()
            dirs = {}
            for view in views:
                save_view(cpu_state, view, Path(tmp) / view, model_config=self.model_config)
                dirs[view] = Path(tmp) / view
            t1 = time.perf_counter()
            result = self.channel.publish(
                dirs, version=version, metadata={"views": views, **(metadata or {})}, move=True
            )
            t2 = time.perf_counter()
        if self.keep_versions is not None:
            try:
                self.channel.retain(self.keep_versions)
            except StoreError as e:  # retention is best effort; the next publish retries it
                log.warning("retention failed: %s", e)
        t3 = time.perf_counter()
        self.last_timings = PublishTimings(t1 - t0, t2 - t1, t3 - t2)
        log.info(
            "published weights v%d (%s, %.1f MB, advanced=%s) convert %.2fs upload %.2fs",
            result.version,
            ",".join(views),
            result.bytes / 1e6,
            result.advanced,
            t1 - t0,
            t2 - t1,
        )
        return result
