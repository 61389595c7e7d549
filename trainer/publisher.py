"""Trainer side of the weight channel: state dict -> the views subscribed groups need -> store -> pointer.

    publisher = WeightPublisher(open_store("/mnt/weights/job"), views=["bf16", "fp8"],
                                base_checkpoint="/models/Qwen3-8B")
    result = publisher.publish(model.state_dict(), version=step)   # PublishResult(version, advanced, ...)

Views are written with `rlfleet.numerics.views.save_view` into a local staging directory (each file
hashed in the same pass that writes it), then uploaded by `rlfleet.channel.WeightChannel.publish`
(bytes durable -> manifest -> pointer). `base_checkpoint` is the HF checkpoint directory the model
came from: every view is then a complete checkpoint (config + quantization config, tokenizer,
generation config) a sampler group launches from. An nvfp4 view of such a checkpoint carries each
linear's `input_scale`, from the activation amax the publisher calibrates on the weights it publishes
(`rlfleet.numerics.views.calibrate_weights`), whichever backend produced them.
The set of views is the configured one plus any view a subscribed sidecar reports following, so a
group added later gets its precision from the next version on.

With `writer_lease_ttl_seconds` (the cluster trainer and local mode pass WRITER_LEASE_TTL_SECONDS) the
publisher is the channel's one writer: it takes the channel's writer lease when it is made (a second
trainer with another id is refused then, `LeaseHeldError` naming the first) and a thread renews it every
fifth of the TTL; a publish after the lease was taken over raises LeaseLostError (docs/weights.md, "One
writer per channel").
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlfleet.channel import LeaseLostError, PublishResult, WeightChannel
from rlfleet.numerics.views import (
    VIEWS,
    calibrate_weights,
    check_view,
    check_view_for_model,
    read_base_config,
    save_view,
)
from rlfleet.store import FileDigest, Store, StoreError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishTimings:
    calibrate_seconds: float  # 0 when no view needs the activation amax
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
        base_checkpoint: str | Path | None = None,
        publisher_id: str | None = None,
        upload_workers: int = 2,
        max_shard_bytes: int | None = None,
        writer_lease_ttl_seconds: float | None = None,
        allowed_views: Iterable[str] | None = None,
    ) -> None:
        """`base_checkpoint`: HF checkpoint directory of the model (config.json, tokenizer files,
        generation_config.json); local mode and the cluster entrypoint always pass it (None writes
        tensor-only views nothing launches from: the format tests only).
        `writer_lease_ttl_seconds`: take the channel's writer lease with this TTL now (LeaseHeldError if
        another publisher id holds it) and renew it until `close()`; None: publish unfenced (tools, tests
        of racing publishers).
        `allowed_views`: the only views a subscriber's report may add (the cluster trainer passes its
        RLJob's views: a report is written by a sampler pod, and a view it names that the job does not
        publish is ignored with a log line, never converted and uploaded every step); None: any known
        view."""
        self.base_checkpoint = Path(base_checkpoint) if base_checkpoint is not None else None
        self.model_config = read_base_config(self.base_checkpoint) if self.base_checkpoint else None
        self.views = [check_view(v) for v in dict.fromkeys(views)]
        for view in self.views:  # e.g. mxfp4 of a dense model: refused before any training step
            check_view_for_model(view, self.model_config)
        self.max_shard_bytes = max_shard_bytes
        self.channel = WeightChannel(store, publisher_id=publisher_id, upload_workers=upload_workers)
        self.follow_subscribers = follow_subscribers
        self.allowed_views = None if allowed_views is None else frozenset(allowed_views)
        self._refused_views: set[str] = set()  # logged once each
        self.keep_versions = keep_versions
        self.staging_dir = Path(staging_dir) if staging_dir else None
        self.last_timings: PublishTimings | None = None
        self._stop_renewing = threading.Event()
        self._lease_lost: LeaseLostError | None = None
        if writer_lease_ttl_seconds is not None:
            lease = self.channel.acquire_lease(writer_lease_ttl_seconds)
            log.info("writer lease of %s taken: %s, generation %d", store.uri, lease.holder, lease.generation)
            threading.Thread(target=self._renew_lease, args=(writer_lease_ttl_seconds / 5,),
                             name="writer-lease", daemon=True).start()  # fmt: skip

    def _renew_lease(self, interval: float) -> None:
        """Renew the writer lease every `interval` s until close(); stop for good once it was taken over
        (the next publish raises why). A store error is retried at the next tick (the TTL is 5 ticks)."""
        while not self._stop_renewing.wait(interval):
            try:
                self.channel.renew_lease()
            except LeaseLostError as e:
                self._lease_lost = e
                log.error("%s", e)
                return
            except StoreError as e:
                log.warning("could not renew the writer lease (retrying in %.0fs): %s", interval, e)

    def close(self) -> None:
        """Stop renewing the writer lease (it stays in the store: the same id takes it over at once,
        another after its TTL)."""
        self._stop_renewing.set()

    def check_lease(self) -> None:
        """Raise LeaseLostError if the writer lease was taken over (renewing it when held): a checkpoint
        is fenced like a publish (trainer/checkpoint.py `WriterFence`)."""
        if self._lease_lost is not None:
            raise self._lease_lost
        if self.channel.lease is not None:
            self.channel.renew_lease()

    def views_needed(self) -> list[str]:
        """Configured views plus the views subscribed sidecars report (unknown names are ignored)."""
        needed = list(self.views)
        if self.follow_subscribers:
            try:
                reported = self.channel.subscribed_views()
            except StoreError as e:  # publishing must not depend on reading reports
                log.warning("could not read subscriber reports: %s", e)
                reported = set()
            for view in sorted(v for v in reported if v in VIEWS and v not in needed):
                if self.allowed_views is not None and view not in self.allowed_views:
                    if view not in self._refused_views:
                        self._refused_views.add(view)
                        log.warning("a subscriber report names view %r, which this job does not publish "
                                    "(its views: %s): ignored", view, ", ".join(sorted(self.allowed_views)))  # fmt: skip
                    continue
                try:
                    check_view_for_model(view, self.model_config)
                except ValueError as e:  # a misconfigured group must not stop training
                    log.error("not publishing the view a subscriber follows: %s", e)
                    continue
                needed.append(view)
        return needed

    def publish(
        self,
        state_dict: Mapping[str, torch.Tensor],
        *,
        version: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        activation_amax: Mapping[str, float] | None = None,
    ) -> PublishResult:
        """Convert, upload and advance the pointer. `version`: e.g. the trainer step (must increase).
        An nvfp4 view of an HF base needs each linear's input amax (its `input_scale`): by default it is
        calibrated on these weights (`calibrate_weights`: transformers' model of the base checkpoint
        around them, on a fixed token sweep); `activation_amax` (module name -> amax, e.g. from
        `calibrate_activation_amax` on data of your own) replaces that calibration."""
        if self._lease_lost is not None:
            raise self._lease_lost
        views = self.views_needed()
        if not views:
            raise ValueError("no view to publish")
        cpu_state = {name: t.detach().to("cpu") for name, t in state_dict.items()}
        calibrate_seconds = 0.0
        if activation_amax is None and "nvfp4" in views and self.base_checkpoint is not None:
            t_cal = time.perf_counter()
            activation_amax = calibrate_weights(cpu_state, self.base_checkpoint)
            calibrate_seconds = time.perf_counter() - t_cal
        # Stage on the store's own filesystem when it has one: the view files are then written once
        # and renamed into place (no second copy of the bytes).
        staging = self.staging_dir or self.channel.store.staging_dir()
        if staging is not None:
            staging.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="rlfleet-publish-", dir=staging) as tmp:
            t0 = time.perf_counter()
            dirs = {view: Path(tmp) / view for view in views}
            shard = {} if self.max_shard_bytes is None else {"max_shard_bytes": self.max_shard_bytes}

            def write(view: str) -> dict[Path, FileDigest]:
                return save_view(
                    cpu_state,
                    view,
                    dirs[view],
                    base_checkpoint=self.base_checkpoint,
                    activation_amax=activation_amax,
                    **shard,
                )

            # Views convert and hash in parallel: torch kernels, BLAKE3 and write(2) release the GIL,
            # and one file's write + hash is about one core's work (docs/benchmarks.md, "Weights").
            digests: dict[Path, FileDigest] = {}
            with ThreadPoolExecutor(max_workers=max(1, min(len(views), os.cpu_count() or 1))) as pool:
                for written in pool.map(write, views):
                    digests.update(written)
            t1 = time.perf_counter()
            result = self.channel.publish(
                dirs,
                version=version,
                metadata={"views": views, **(metadata or {})},
                move=True,
                digests=digests,
            )
            t2 = time.perf_counter()
        if self.keep_versions is not None:
            try:
                self.channel.retain(self.keep_versions)
            except StoreError as e:  # retention is best effort; the next publish retries it
                log.warning("retention failed: %s", e)
        t3 = time.perf_counter()
        self.last_timings = PublishTimings(calibrate_seconds, t1 - t0, t2 - t1, t3 - t2)
        log.info(
            "published weights v%d (%s, %.1f MB, advanced=%s) calibrate %.2fs convert %.2fs upload %.2fs",
            result.version,
            ",".join(views),
            result.bytes / 1e6,
            result.advanced,
            calibrate_seconds,
            t1 - t0,
            t2 - t1,
        )
        return result
