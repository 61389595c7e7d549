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

Each view of a version is an anchor (every file stored whole) or a delta against the version this
publisher published just before (docs/weights.md, "Deltas between versions"). The publisher keeps the
complete safetensors files of the last version it published of each view (`<staging>/rlfleet-last-<id>/
<view>/`: hardlinks of the staged files, so an anchor renamed into a filesystem store costs no copy) and
the scale tensors it was written with (the next fp8 / nvfp4 view keeps them where the rule allows, so
unchanged blocks keep their codes), and encodes each view against those files
(`rlfleet.deltas.encode_delta`), in the pool that converts the views. A view
is an anchor when there is no such copy (the first publish, a restart, a view the previous version did
not have), every `anchor_every` versions, when a file's layout changed, or when a file's delta would
exceed `max_delta_share` of the file. The kept copy moves on only once the pointer names the new version:
after a publish that raised, the next delta is against the version the channel still serves.

With `writer_lease_ttl_seconds` (`channel_writer`: the cluster trainer, the slime bridge, a local run) the
publisher is the channel's one writer: it takes the channel's writer lease when it is made (a second
trainer with another id is refused then, `LeaseHeldError` naming the first) and a thread renews it every
fifth of the TTL; a publish after the lease was taken over raises LeaseLostError (docs/weights.md, "One
writer per channel").
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from rlfleet.api.weightchannel import DEFAULT_ANCHOR_EVERY, DEFAULT_MAX_DELTA_SHARE, DeltaSpec
from rlfleet.channel import (
    LORA_BASE_KEY,
    WRITER_LEASE_TTL_SECONDS,
    DeltaSource,
    LeaseLostError,
    PublishResult,
    WeightChannel,
    newest_version_of_view,
)
from rlfleet.deltas import DELTA_SUFFIX, DeltaError, encode_delta, read_header
from rlfleet.lora import LORA_VIEW
from rlfleet.numerics.views import (
    VIEWS,
    calibrate_weights,
    check_view,
    check_view_for_model,
    load_checkpoint_weights,
    read_base_config,
    save_adapter,
    save_view,
)
from rlfleet.store import FileDigest, Store, StoreError

log = logging.getLogger(__name__)


SNAPSHOT_PREFIX = "rlfleet-last-"
"""`<staging>/rlfleet-last-<id>/<view>/`: the complete safetensors files of the last version a publisher
published of each view (the bases of its next deltas); <id> from the store and the publisher id, so a restarted trainer
(same id: the cluster's and local mode's are stable) removes its predecessor's copy before it keeps its
own (the trainer pod's /tmp emptyDir outlives a container restart). In a filesystem store's `.staging/`
any other publisher's leftover goes with the store's staging leftovers (`FilesystemStore.clean_staging`)."""


@dataclass(frozen=True)
class PublishTimings:
    calibrate_seconds: float  # 0 when no view needs the activation amax
    convert_seconds: float
    encode_seconds: float  # the deltas of every view against the previous version (wall time; 0: all anchors)
    upload_seconds: float
    retain_seconds: float


@dataclass(frozen=True)
class ViewPublished:
    """How one view of a published version is stored (the publish log and the trainer's metrics)."""

    view: str
    kind: Literal["anchor", "delta"]
    base: int | None
    """The version a delta applies to (None: an anchor)."""
    stored_bytes: int
    """Bytes the channel holds for this view of this version (what a following replica reads)."""
    full_bytes: int
    """Size of the complete view."""
    reason: str
    """Why the view is an anchor ("" for a delta)."""
    encode_seconds: float
    """Time spent comparing this view with its previous version (also when that ended in an anchor)."""

    def describe(self) -> str:
        share = self.stored_bytes / self.full_bytes if self.full_bytes else 0.0
        stored = f"{self.stored_bytes / 1e6:.2f} MB of {self.full_bytes / 1e6:.2f} MB ({share:.1%})"
        if self.kind == "delta":
            return f"delta against v{self.base}: {stored}, encoded in {self.encode_seconds:.2f}s"
        tried = f", compared in {self.encode_seconds:.2f}s" if self.encode_seconds else ""
        return f"anchor ({self.reason}): {stored}{tried}"


@dataclass(frozen=True)
class _ViewSnapshot:
    """The complete safetensors files of the last published version of one view."""

    version: int
    directory: Path
    deltas_since_anchor: int
    """Deltas published of this view after its last anchor (0: `version` is the anchor)."""
    scales: dict[str, torch.Tensor]
    """The scale tensors the view was written with (`save_view(scales_used=)`): the next version's
    `previous_scales`, so a block whose values did not change keeps its codes (docs/weights.md, "Kept
    scales"); empty for bf16."""


@dataclass(frozen=True)
class _ViewPlan:
    """A view of the version being published: an anchor (`base` None, with why) or a delta."""

    base: int | None
    payloads: dict[str, Path]
    reason: str
    encode_seconds: float


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
        anchor_every: int = DEFAULT_ANCHOR_EVERY,
        max_delta_share: float = DEFAULT_MAX_DELTA_SHARE,
        lora: Mapping[str, Any] | None = None,
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
        view.
        `anchor_every`, `max_delta_share`: the RLJob's weightChannel.deltas (rlfleet.api.weightchannel
        DeltaSpec): a view is stored whole at least every `anchor_every` versions (1: always, no deltas)
        and whenever the delta of one of its files would exceed `max_delta_share` of the file.
        `lora`: the adapter_config.json of a LoRA job (rlfleet.lora.adapter_config; docs/weights.md "LoRA"):
        `publish` then takes the adapter's tensors only (PEFT's names) and every version holds the `lora`
        view (the adapter, stored whole: it is a few MB and every element moves each step); each base view
        is stored once, converted from `base_checkpoint` (the frozen base), at the first version that needs
        it, and every version's manifest names the versions holding its base views (`lora_base`)."""
        if lora is not None and base_checkpoint is None:
            raise ValueError("a LoRA publisher needs base_checkpoint: the base views are converted from it")
        self.lora = None if lora is None else dict(lora)
        self._lora_base: dict[str, int] = {}  # base view -> the version holding it (LoRA)
        if anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1 (1: every version whole), got {anchor_every}")
        if not 0.0 < max_delta_share <= 1.0:
            raise ValueError(f"max_delta_share must be in (0, 1], got {max_delta_share}")
        self.anchor_every = anchor_every
        self.max_delta_share = max_delta_share
        self._snapshots: dict[str, _ViewSnapshot] = {}
        self._snapshot_root: Path | None = None  # made at the first publish, on the staging filesystem
        self.last_published: dict[str, ViewPublished] = {}
        """How each view of the last version this publisher published is stored."""
        self.stored_bytes_total: dict[str, int] = {}
        """Bytes the channel stored for each view, summed over every version this publisher published
        (what a replica following the view reads: anchors whole, deltas as payloads; the trainer's
        `rlfleet_trainer_weights_stored_bytes_total`, which the operator charges a group's egress from)."""
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
            threading.Thread(
                target=self._renew_lease,
                args=(writer_lease_ttl_seconds / 5,),
                name="writer-lease",
                daemon=True,
            ).start()

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
        another after its TTL) and remove the copies of the last published views."""
        self._stop_renewing.set()
        if self._snapshot_root is not None:
            shutil.rmtree(self._snapshot_root, ignore_errors=True)
        self._snapshots = {}

    def check_lease(self) -> None:
        """Raise LeaseLostError if the writer lease was taken over (renewing it when held): a checkpoint
        is fenced like a publish (trainer/publish/checkpoint.py `WriterFence`)."""
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
                        log.warning(
                            "a subscriber report names view %r, which this job does not publish "
                            "(its views: %s): ignored",
                            view,
                            ", ".join(sorted(self.allowed_views)),
                        )
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
        if (
            self.lora is None
            and activation_amax is None
            and "nvfp4" in views
            and self.base_checkpoint is not None
        ):
            t_cal = time.perf_counter()
            activation_amax = calibrate_weights(cpu_state, self.base_checkpoint)
            calibrate_seconds = time.perf_counter() - t_cal
        if self.lora is not None:
            result, plans, (convert_seconds, encode_seconds, upload_seconds) = self._write_and_upload_adapter(
                cpu_state, views, version=version, metadata=metadata or {}
            )
        else:
            result, plans, (convert_seconds, encode_seconds, upload_seconds) = self._write_and_upload(
                cpu_state,
                views,
                activation_amax,
                version=version,
                metadata={"views": views, **(metadata or {})},
            )
        t0 = time.perf_counter()
        if self.keep_versions is not None:
            try:
                self.channel.retain(self.keep_versions)
            except StoreError as e:  # retention is best effort; the next publish retries it
                log.warning("retention failed: %s", e)
        retain_seconds = time.perf_counter() - t0
        self.last_timings = PublishTimings(
            calibrate_seconds, convert_seconds, encode_seconds, upload_seconds, retain_seconds
        )
        self.last_published = {
            view: ViewPublished(
                view,
                "anchor" if vm.delta is None else "delta",
                None if vm.delta is None else vm.delta.base,
                vm.stored_bytes,
                vm.bytes,
                plans[view].reason,
                plans[view].encode_seconds,
            )
            for view, vm in sorted(result.manifest.views.items())
        }
        for view, published in self.last_published.items():
            self.stored_bytes_total[view] = self.stored_bytes_total.get(view, 0) + published.stored_bytes
        self._log_published(result)
        return result

    def _staging(self) -> Path | None:
        """Where views are staged (None: the system's temporary directory), and the snapshot root beside it.
        On the store's own filesystem when it has one: the view files are then written once and renamed
        into place (no second copy of the bytes), and the kept copies are hardlinks of them."""
        staging = self.staging_dir or self.channel.store.staging_dir()
        if staging is not None:
            staging.mkdir(parents=True, exist_ok=True)
        if self._snapshot_root is None:
            # one directory per (channel, publisher id): another channel's publisher on this machine never shares it
            key = f"{self.channel.store.uri}\n{self.channel.publisher_id}"
            name = hashlib.sha256(key.encode()).hexdigest()[:16]
            self._snapshot_root = (staging or Path(tempfile.gettempdir())) / f"{SNAPSHOT_PREFIX}{name}"
            shutil.rmtree(self._snapshot_root, ignore_errors=True)  # a predecessor's: it is no base of ours
        return staging

    def _write_and_upload(
        self,
        cpu_state: Mapping[str, torch.Tensor],
        views: list[str],
        activation_amax: Mapping[str, float] | None,
        *,
        version: int | None,
        metadata: Mapping[str, Any],
    ) -> tuple[PublishResult, dict[str, _ViewPlan], tuple[float, float, float]]:
        """Write every view, plan each as an anchor or a delta, publish; (result, plans, (convert, encode,
        upload seconds))."""
        with tempfile.TemporaryDirectory(prefix="rlfleet-publish-", dir=self._staging()) as tmp:
            t0 = time.perf_counter()
            dirs = {view: Path(tmp) / view for view in views}
            shard = {} if self.max_shard_bytes is None else {"max_shard_bytes": self.max_shard_bytes}
            scales: dict[str, dict[str, torch.Tensor]] = {view: {} for view in views}

            def write(view: str) -> dict[Path, FileDigest]:
                kept = self._snapshots.get(view)
                return save_view(
                    cpu_state,
                    view,
                    dirs[view],
                    base_checkpoint=self.base_checkpoint,
                    activation_amax=activation_amax,
                    previous_scales=None if kept is None else kept.scales,
                    scales_used=scales[view],
                    **shard,
                )

            def plan(view: str) -> _ViewPlan:
                return self._plan(view, dirs[view], Path(tmp) / ".deltas" / view)

            # Views convert, hash and encode in parallel: torch kernels, BLAKE3, numpy compares and
            # write(2) release the GIL, and one file's write + hash is about one core's work
            # (docs/benchmarks.md, "Weights").
            digests: dict[Path, FileDigest] = {}
            with ThreadPoolExecutor(max_workers=max(1, min(len(views), os.cpu_count() or 1))) as pool:
                for written in pool.map(write, views):
                    digests.update(written)
                t1 = time.perf_counter()
                plans = dict(zip(views, pool.map(plan, views), strict=True))
            t2 = time.perf_counter()
            deltas = {v: DeltaSource(p.base, p.payloads) for v, p in plans.items() if p.base is not None}
            pending = self._keep_complete_files(dirs)  # before `move` renames the files into the store
            try:
                result = self.channel.publish(
                    dirs, version=version, metadata=metadata, move=True, digests=digests, deltas=deltas
                )
            except BaseException:
                shutil.rmtree(pending, ignore_errors=True)  # the bases stay those of the version still served
                raise
            t3 = time.perf_counter()
            self._advance_snapshots(result, pending, scales)
        return result, plans, (t1 - t0, t2 - t1, t3 - t2)

    def _write_and_upload_adapter(
        self,
        adapter: Mapping[str, torch.Tensor],
        views: list[str],
        *,
        version: int | None,
        metadata: Mapping[str, Any],
    ) -> tuple[PublishResult, dict[str, _ViewPlan], tuple[float, float, float]]:
        """A LoRA version: the adapter as the `lora` view, plus each base view the channel does not hold yet
        (converted from the base checkpoint: the trainer never changes the base); (result, plans, (convert,
        encode, upload seconds))."""
        if version is None:
            raise ValueError(
                "a LoRA version needs its number: its manifest names the versions of its base views"
            )
        assert self.lora is not None and self.base_checkpoint is not None
        missing = [view for view in views if view not in self._lora_base and not self._find_base(view)]
        with tempfile.TemporaryDirectory(prefix="rlfleet-publish-", dir=self._staging()) as tmp:
            t0 = time.perf_counter()
            dirs = {LORA_VIEW: Path(tmp) / LORA_VIEW}
            digests = save_adapter(adapter, self.lora, dirs[LORA_VIEW])
            if missing:
                _, base_state = load_checkpoint_weights(self.base_checkpoint)
                amax = calibrate_weights(base_state, self.base_checkpoint) if "nvfp4" in missing else None
                for view in missing:
                    dirs[view] = Path(tmp) / view
                    digests.update(
                        save_view(
                            base_state,
                            view,
                            dirs[view],
                            base_checkpoint=self.base_checkpoint,
                            activation_amax=amax,
                        )
                    )
                del base_state
            t1 = time.perf_counter()
            bases = {view: self._lora_base.get(view, version) for view in views}
            result = self.channel.publish(
                dirs,
                version=version,
                metadata={"views": sorted(dirs), LORA_BASE_KEY: bases, **metadata},
                move=True,
                digests=digests,
            )
            t2 = time.perf_counter()
        if result.advanced:
            for view in missing:
                self._lora_base[view] = result.version
        plans = {LORA_VIEW: _ViewPlan(None, {}, "LoRA adapter, stored whole", 0.0)}
        plans.update({view: _ViewPlan(None, {}, "LoRA base, stored once", 0.0) for view in missing})
        return result, plans, (t1 - t0, 0.0, t2 - t1)

    def _find_base(self, view: str) -> bool:
        """Whether the channel holds `view` (a LoRA base view a predecessor of this trainer published):
        remembered as the version holding it."""
        found = newest_version_of_view(self.channel, view)
        if found is not None:
            self._lora_base[view] = found[0]
        return found is not None

    def _log_published(self, result: PublishResult) -> None:
        timings = self.last_timings
        assert timings is not None
        for stats in self.last_published.values():
            log.info("weights v%d %s: %s", result.version, stats.view, stats.describe())
        log.info(
            "published weights v%d (%s, %.1f MB stored of %.1f MB, advanced=%s) calibrate %.2fs convert %.2fs "
            "encode %.2fs upload %.2fs",
            result.version,
            ",".join(self.last_published),
            result.bytes / 1e6,
            sum(vm.bytes for vm in result.manifest.views.values()) / 1e6,
            result.advanced,
            timings.calibrate_seconds,
            timings.convert_seconds,
            timings.encode_seconds,
            timings.upload_seconds,
        )

    def snapshot_dir(self, view: str) -> Path | None:
        """The complete files of the last version this publisher published of `view` (None: none kept)."""
        kept = self._snapshots.get(view)
        return None if kept is None else kept.directory

    def _plan(self, view: str, directory: Path, out: Path) -> _ViewPlan:
        """Anchor or delta for the freshly written view in `directory` (delta payloads go under `out`)."""
        kept = self._snapshots.get(view)
        if self.anchor_every == 1:
            return _ViewPlan(None, {}, "anchorEvery 1: deltas off", 0.0)
        if kept is None:
            return _ViewPlan(None, {}, "no earlier version of the view kept", 0.0)
        if kept.deltas_since_anchor + 1 >= self.anchor_every:
            return _ViewPlan(None, {}, f"every {self.anchor_every} versions", 0.0)
        files = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*.safetensors"))
        if not files:
            return _ViewPlan(None, {}, "no safetensors file", 0.0)
        t0 = time.perf_counter()
        payloads: dict[str, Path] = {}
        for rel in files:
            payload = out / f"{rel}{DELTA_SUFFIX}"
            try:
                why_whole = self._encode_file(kept, rel, directory / rel, payload)
            except (
                OSError,
                DeltaError,
            ) as e:  # e.g. the kept copy was removed: storing whole is always right
                log.warning("view %s: cannot compare with v%d (%s): stored whole", view, kept.version, e)
                why_whole = f"v{kept.version}'s copy unreadable"
            if why_whole is not None:
                return _ViewPlan(None, {}, why_whole, time.perf_counter() - t0)
            payloads[rel] = payload
        return _ViewPlan(kept.version, payloads, "", time.perf_counter() - t0)

    def _encode_file(self, kept: _ViewSnapshot, rel: str, target: Path, payload: Path) -> str | None:
        """Write the delta of `target` against the kept file `rel` to `payload`; or why the view must be
        stored whole instead."""
        base = kept.directory / rel
        if not base.is_file():
            return f"v{kept.version} has no {rel}"
        size = target.stat().st_size
        if read_header(base).raw != read_header(target).raw or base.stat().st_size != size:
            return f"the layout of {rel} changed"
        payload.parent.mkdir(parents=True, exist_ok=True)
        if encode_delta(base, target, payload, max_delta_bytes=int(self.max_delta_share * size)) is None:
            return f"the delta of {rel} exceeds {self.max_delta_share:g} of the file"
        return None

    def _keep_complete_files(self, dirs: Mapping[str, Path]) -> Path:
        """Hardlink (or copy, where links fail) each view's safetensors files under a pending directory of
        the snapshot root: they become the bases of the next deltas once this publish succeeded."""
        assert self._snapshot_root is not None
        pending = self._snapshot_root / f".pending-{uuid.uuid4().hex[:8]}"
        if self.anchor_every == 1:  # deltas off: nothing is compared, so nothing kept (and scales fresh)
            return pending
        for view, directory in dirs.items():
            for path in directory.rglob("*.safetensors"):
                kept = pending / view / path.relative_to(directory)
                kept.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(path, kept)
                except OSError:
                    shutil.copyfile(path, kept)
        return pending

    def _advance_snapshots(
        self, result: PublishResult, pending: Path, scales: Mapping[str, dict[str, torch.Tensor]]
    ) -> None:
        """The published version's complete files become the bases of the next deltas, if the pointer
        names it (not advanced: a higher version was published by another writer, and this one's files
        may go at its next retention: the next publish anchors)."""
        assert self._snapshot_root is not None
        previous = self._snapshots
        self._snapshots = {}
        for kept in previous.values():
            shutil.rmtree(kept.directory, ignore_errors=True)
        if result.advanced:
            for view, vm in result.manifest.views.items():
                before = previous.get(view)
                since = 0 if vm.delta is None or before is None else before.deltas_since_anchor + 1
                directory = self._snapshot_root / view
                if (pending / view).is_dir():
                    shutil.rmtree(directory, ignore_errors=True)  # a copy a failed earlier move left
                    os.replace(pending / view, directory)
                    self._snapshots[view] = _ViewSnapshot(result.version, directory, since, scales[view])
        shutil.rmtree(pending, ignore_errors=True)


def channel_writer(
    store: Store,
    views: Iterable[str],
    *,
    publisher_id: str,
    keep_versions: int,
    deltas: DeltaSpec,
    base_checkpoint: Path | None,
    lora: Mapping[str, Any] | None = None,
    follow_subscribers: bool = True,
) -> WeightPublisher:
    """The publisher of a channel's one writer (the cluster trainer, the slime bridge, a local run): the
    writer lease (LeaseHeldError: another writer with another id holds it; one id per job, the same across
    restarts, so a restarted writer takes over its own claims), the given views only (a sampler's report
    cannot add one), the job's weightChannel.deltas and retention, and with `lora` (the adapter config) each
    version the adapter and each base view stored once (docs/weights.md, "One writer per channel")."""
    views = list(views)
    return WeightPublisher(
        store,
        views=views,
        lora=lora,
        keep_versions=keep_versions,
        follow_subscribers=follow_subscribers,
        anchor_every=deltas.anchor_every,
        max_delta_share=deltas.max_delta_share,
        base_checkpoint=base_checkpoint,
        writer_lease_ttl_seconds=WRITER_LEASE_TTL_SECONDS,
        allowed_views=views,
        publisher_id=publisher_id,
    )
