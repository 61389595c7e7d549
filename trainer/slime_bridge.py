"""`rlfleet slime bridge`: an rlfleet fleet as the rollout endpoint of slime (THUDM/slime), issue 43.

    rlfleet slime bridge --publish-dir /shared/slime-weights --store /mnt/weights/job \\
        --base-checkpoint /models/Qwen3-8B --views bf16,fp8,nvfp4 [--poll-interval 2] [--metrics-port 9500]

slime's trainer runs with `--update-weight-transport disk --update-weight-disk-dir DIR` (mode `full` or
`delta`) and writes `DIR/weight_v{N:06d}/` per weight version on its own schedule (rlfleet/slime_publish.py
says exactly what it writes and what is checked). The bridge takes the trainer's place in the weight
channel: it watches DIR, reconstructs each version's complete weights (a full checkpoint read; a delta
applied to its own copy of version N-1, the first one to the base checkpoint's bytes, as slime seeds its
snapshot), verifies them with slime's own per-tensor checksums, and publishes them as rlfleet version N
(slime's number) of every view the job's groups need through `WeightPublisher`: conversion and nvfp4
calibration once per version for the whole fleet, and the sampler sidecars, channel status, deltas and
retention unchanged. Version 0 is published from the base checkpoint when the channel is empty.

Each poll publishes, in order, every version above the channel's pointer it can (never one twice: the
pointer says what is published, across restarts). A version it refuses (incomplete, a checksum, a broken
chain, a malformed index, slime's newer layout: one line, logged once per distinct reason) is retried at
the next poll, since a partial directory may complete; it does not block a later FULL version (which
needs no history, as SGLang's /pull_weights seeds from the newest full version), while a later delta
waits for it (it applies to it).

A restarted bridge rebuilds its copy of the pointer's version the way SGLang's /pull_weights does: from
the newest full version at or below it in DIR (or the base checkpoint), then slime's deltas up to it,
each checksum-verified; not from the channel's bf16 view (the job may not publish one, and a view is
not bound to hold slime's exact bytes of a non-bf16 tensor). Only needed when the next version is a
delta; if DIR no longer holds that chain, that delta is refused (one line) and a later full version
still publishes.

Metrics (trainer/metrics.py PrometheusExporter, as the trainer pod's): `rlfleet_trainer_step` and
`rlfleet_trainer_weight_version` = the version published (what the operator's trainer report reads into
the RLJob's status.step and status.weightVersion), the per-view bytes of `update_published`, and
`rlfleet_trainer_slime_refused_versions` (the versions above the pointer refused at the last poll) and
`rlfleet_trainer_external_version` (slime's newest `weight_v<N>` directory: the RLJob's status.externalVersion).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rlfleet.cli import OneLineErrorParser
from rlfleet.slime_publish import (
    SlimePublishError,
    SlimeVersion,
    Weights,
    is_delta,
    read_base,
    read_version,
    version_dir_name,
    version_dirs,
)

if TYPE_CHECKING:
    import torch

    from rlfleet.api.weightchannel import DeltaSpec
    from rlfleet.channel import WeightChannel
    from rlfleet.trainer.metrics import PrometheusExporter
    from rlfleet.trainer.publish.publisher import WeightPublisher

log = logging.getLogger("rlfleet.trainer.slime_bridge")
METRICS_PORT = 9500  # the trainer pod's (operator naming.TRAINER_METRICS_PORT)
DEFAULT_PUBLISHER_ID = "slime-bridge"


@dataclass
class PollResult:
    published: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)
    """Version -> the one line it was refused with at this poll."""


class SlimeBridge:
    """slime's publish directory -> the weight channel, one poll at a time (`poll`), or until stopped (`run`)."""

    def __init__(
        self,
        publish_dir: str | Path,
        publisher: WeightPublisher,
        base_checkpoint: str | Path,
        *,
        exporter: PrometheusExporter | None = None,
    ) -> None:
        self.publish_dir = Path(publish_dir)
        self.publisher = publisher
        self.channel: WeightChannel = publisher.channel
        self.base_checkpoint = Path(base_checkpoint)
        self.base: Weights = read_base(self.base_checkpoint)  # SlimePublishError: not an HF checkpoint
        self.exporter = exporter
        self.held: tuple[int, Weights] | None = None
        """The bridge's copy of the last version it published or rebuilt: what the next delta applies to."""
        self._logged: dict[int, str] = {}

    def poll(self) -> PollResult:
        """Publish what can be published now (version 0 first if the channel is empty). A store error
        (LeaseLostError included) propagates: `run` retries the others at the next poll."""
        result = PollResult()
        pointer = self.channel.latest()
        if pointer is None:
            self._publish(
                SlimeVersion(0, "full", dict(self.base), tuple(sorted(self.base))), "the base checkpoint"
            )
            result.published.append(0)
            current = 0
        else:
            current = pointer.version
        dirs = version_dirs(self.publish_dir)
        for version in [v for v in dirs if v > current]:
            try:
                got = read_version(
                    self.publish_dir, version, self.base, self._previous(version, set(result.refused))
                )
            except SlimePublishError as e:
                result.refused[version] = str(e)
                self._log_refused(version, str(e))
                continue
            kind = f"slime's {got.kind}" + (
                f" ({got.encoding}, {got.checksum_format})" if got.encoding else ""
            )
            self._publish(got, kind)
            result.published.append(version)
            current = version
        if self.exporter is not None:
            self.exporter.update(
                current,
                {
                    "weight_version": float(current),
                    "slime_refused_versions": float(len(result.refused)),
                    # slime's newest weight_v<N> directory, written or being written (the RLJob's
                    # status.externalVersion; weight_version is the newest the channel serves)
                    "external_version": float(max(dirs, default=0)),
                },
            )
        return result

    def run(self, stop: threading.Event, poll_interval: float = 2.0) -> None:
        """Poll until `stop` is set. A store error is logged (one line) and retried at the next poll; a
        lost writer lease ends the loop (LeaseLostError: another writer publishes now)."""
        from rlfleet.channel import LeaseLostError
        from rlfleet.store import StoreError

        while True:
            try:
                self.poll()
            except LeaseLostError:
                raise
            except StoreError as e:
                log.warning("store error (retrying in %.0fs): %s", poll_interval, " ".join(str(e).split()))
            if stop.wait(poll_interval):
                return

    # ------------------------------------------------------------------------------------- helpers
    def _previous(self, version: int, refused: set[int]) -> tuple[int, Weights] | None:
        """(version - 1, its weights) when `version` is a delta that can be applied; None for a full one
        or an unreadable index (read_version then refuses it with one line). A delta on a version refused
        at this poll is refused; after a restart the copy of the pointer's version is rebuilt."""
        try:
            delta = is_delta(self.publish_dir / version_dir_name(version))
        except SlimePublishError:
            return None
        if not delta:
            return None
        if self.held is not None and self.held[0] == version - 1:
            return self.held
        if version - 1 in refused:
            raise SlimePublishError(
                f"{version_dir_name(version)}: delta on v{version - 1}, which is not published (refused above); "
                "retried at the next poll"
            )
        self.held = self._rebuild(version - 1)
        return self.held

    def _rebuild(self, target: int) -> tuple[int, Weights]:
        """Version `target` of slime's stream, as SGLang's /pull_weights reaches it on a fresh host: the
        newest full version at or below it (or the base checkpoint, version 0), then every delta up to it,
        each verified. SlimePublishError (one line) if the directory does not hold that chain."""
        start = target
        while start > 0 and is_delta(self._dir_of(start)):
            start -= 1
        state: tuple[int, Weights]
        if start == 0:
            state = (0, dict(self.base))
        else:
            state = (start, read_version(self.publish_dir, start, self.base, None).weights)
        for version in range(start + 1, target + 1):
            state = (version, read_version(self.publish_dir, version, self.base, state).weights)
        log.info(
            "rebuilt v%d from %s%s",
            target,
            "the base checkpoint" if start == 0 else version_dir_name(start),
            f" + {target - start} delta(s)" if target > start else "",
        )
        return state

    def _dir_of(self, version: int) -> Path:
        vdir = self.publish_dir / version_dir_name(version)
        if not vdir.is_dir():
            raise SlimePublishError(
                f"{vdir.name}: needed to rebuild the bridge's copy after a restart, but it is not in "
                f"{self.publish_dir} (a later full version publishes without it)"
            )
        return vdir

    def _publish(self, got: SlimeVersion, source: str) -> None:
        result = self.publisher.publish(
            to_torch(got.weights),
            version=got.version,
            metadata={"source": "slime", "slime_version": got.version, "slime_kind": got.kind},
        )
        self.held = (got.version, got.weights)
        self._logged.pop(got.version, None)
        log.info(
            "published v%d from %s: %s%s",
            got.version,
            source,
            f"{len(got.changed)} tensor(s) changed" if got.kind == "delta" else f"{len(got.weights)} tensors",
            "" if result.advanced else " (the pointer was already past it)",
        )
        if self.exporter is not None:
            self.exporter.update(got.version, {"weight_version": float(got.version)})
            self.exporter.update_published(
                self.publisher.last_published.values(), self.publisher.stored_bytes_total
            )

    def _log_refused(self, version: int, line: str) -> None:
        if self._logged.get(version) != line:  # once per distinct reason, not every poll
            log.warning("v%d not published: %s", version, line)
            self._logged[version] = line


# the safetensors dtype names slime's HF checkpoints use -> torch's
_TORCH_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def to_torch(weights: Weights) -> dict[str, torch.Tensor]:
    """HF-named torch tensors viewing the same bytes (no copy)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        dtype_name = _TORCH_DTYPES.get(t.dtype)
        if dtype_name is None:
            raise SlimePublishError(f"{name}: dtype {t.dtype} has no torch equivalent here")
        dtype = getattr(torch, dtype_name)
        if t.data.size == 0:
            out[name] = torch.empty(t.shape, dtype=dtype)
            continue
        flat = torch.from_numpy(t.data)  # shares the (never mutated) bytes
        out[name] = flat.view(dtype).reshape(t.shape)
    return out


# ---------------------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="rlfleet slime bridge",
        description="Publish slime's disk weight versions (weight_v{N:06d}/, full or delta) into a weight channel.",
    )
    p.add_argument(
        "--config",
        default=None,
        help="the job's resolved RLJob (its trainer.external): the publish dir, the store, the model (any "
        "model source), the groups' views and the retention come from it (the bridge pod's way)",
    )
    p.add_argument("--publish-dir", default=None, help="slime's --update-weight-disk-dir")
    p.add_argument(
        "--store",
        default=None,
        help="channel store: a path, file://path or s3://bucket/prefix[?endpoint=URL]",
    )
    p.add_argument(
        "--base-checkpoint",
        default=None,
        help="the HF checkpoint directory slime started from (--hf-checkpoint)",
    )
    p.add_argument(
        "--views", default="bf16", help="comma list of the views the job's groups serve (bf16,fp8,nvfp4)"
    )
    p.add_argument("--poll-interval", type=float, default=2.0, help="seconds between scans of --publish-dir")
    p.add_argument(
        "--metrics-port", type=int, default=METRICS_PORT, help="Prometheus port (0: any free port)"
    )
    p.add_argument("--keep-versions", type=int, default=3, help="versions the channel keeps (retention)")
    p.add_argument(
        "--publisher-id",
        default=DEFAULT_PUBLISHER_ID,
        help="the channel writer's id: keep it across restarts (the same id takes its writer lease over at once)",
    )
    p.add_argument(
        "--once", action="store_true", help="one poll, then exit (0: nothing refused, 1: some refused)"
    )
    return p


def _checked_views(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """--views as a list, each a view of the channel that this model has (else one line, exit 2)."""
    from rlfleet.channel import VIEW_NAMES
    from rlfleet.numerics.views import check_view_for_model, read_base_config

    views = list(dict.fromkeys(v.strip() for v in args.views.split(",") if v.strip()))
    if not views:
        parser.error("--views names no view")
    for view in views:
        if view not in VIEW_NAMES:
            parser.error(f"--views: unknown view {view!r} (one of {', '.join(VIEW_NAMES)})")
    base = Path(args.base_checkpoint)
    if not (base / "config.json").is_file():
        parser.error(f"--base-checkpoint {base} is not an HF checkpoint directory (no config.json)")
    try:
        config = read_base_config(base)
        for view in views:
            check_view_for_model(view, config)
    except ValueError as e:
        parser.error(" ".join(str(e).split()))
    return views


def _from_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the bridge's arguments from the job's RLJob (`--config`, as the operator runs it): its
    trainer.external.publishDir, weight channel store, model (resolved as the trainer resolves it: a
    directory, s3:// or a Hugging Face id, into the model cache), the views of its groups, its retention
    and the trainer's publisher id (the same across restarts). A bad file or model: one line, exit 2."""
    from rlfleet.api import load_rljob
    from rlfleet.api.common import views_to_publish
    from rlfleet.api.rljob import RLJobLoadError
    from rlfleet.model_source import ModelSourceError, resolve_model_source
    from rlfleet.store.factory import spec_uri

    try:
        job = load_rljob(args.config)
    except RLJobLoadError as e:
        parser.error(" ".join(str(e).split()))
    external = job.spec.trainer.external
    if external is None:
        parser.error(
            f"{args.config}: the RLJob has no trainer.external (rlfleet trains it: rlfleet trainer run)"
        )
    store = job.spec.weight_channel.store
    try:
        base = resolve_model_source(job.spec.model.path, revision=job.spec.model.revision)
    except ModelSourceError as e:
        parser.error(" ".join(str(e).split()))
    args.publish_dir = args.publish_dir or external.publish_dir
    args.store = args.store or spec_uri(store)
    args.base_checkpoint = args.base_checkpoint or str(base)
    args.views = ",".join(views_to_publish(g.weight_format for g in job.spec.sampler_groups))
    args.keep_versions = job.spec.weight_channel.retention.keep_versions
    args.deltas = job.spec.weight_channel.deltas
    args.publisher_id = f"trainer/{job.metadata.namespace or 'default'}/{job.name}"


def _checked_args(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Parsed arguments and the views; anything wrong is one line on stderr and exit 2 (parser.error)."""
    args = parser.parse_args(argv)
    if args.config:
        _from_config(parser, args)
    missing = [flag for flag in ("publish_dir", "store", "base_checkpoint") if not getattr(args, flag)]
    if missing:
        parser.error("needs --config or " + ", ".join("--" + m.replace("_", "-") for m in missing))
    views = _checked_views(parser, args)
    if Path(args.publish_dir).exists() and not Path(args.publish_dir).is_dir():
        parser.error(f"--publish-dir {args.publish_dir} is not a directory")
    if args.poll_interval <= 0:
        parser.error("--poll-interval must be > 0")
    if not 0 <= args.metrics_port <= 65535:
        parser.error("--metrics-port must be in 0..65535")
    if args.keep_versions < 1:
        parser.error("--keep-versions must be >= 1")
    return args, views


def make_publisher(
    store_uri: str,
    views: Iterable[str],
    base_checkpoint: Path,
    *,
    keep_versions: int,
    publisher_id: str,
    deltas: DeltaSpec | None = None,
) -> WeightPublisher:
    """The channel's one writer on `store_uri` (publisher.channel_writer, as the trainer's): the bridge's
    views, the job's weightChannel.deltas (None: their defaults)."""
    from rlfleet.api.weightchannel import DeltaSpec
    from rlfleet.store import FilesystemStore, open_store
    from rlfleet.trainer.publish.publisher import channel_writer

    store = open_store(store_uri)
    if isinstance(store, FilesystemStore):
        store.root.mkdir(parents=True, exist_ok=True)  # publishers may create the channel directory
    return channel_writer(
        store,
        views,
        publisher_id=publisher_id,
        keep_versions=keep_versions,
        deltas=deltas or DeltaSpec(),
        base_checkpoint=base_checkpoint,
    )


def cli(argv: list[str]) -> int:
    from rlfleet.channel import ChannelError
    from rlfleet.store import StoreError
    from rlfleet.trainer.metrics import PrometheusExporter

    parser = _parser()
    args, views = _checked_args(parser, argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    prog = parser.prog
    try:
        store_publisher = make_publisher(
            args.store,
            views,
            Path(args.base_checkpoint),
            keep_versions=args.keep_versions,
            publisher_id=args.publisher_id,
            deltas=getattr(args, "deltas", None),  # the job's (--config); else the defaults
        )
    except (ValueError, StoreError) as e:  # a bad URI, LeaseHeldError (a ChannelError), an unreachable store
        print(f"{prog}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) and not isinstance(e, ChannelError) else 1
    exporter = PrometheusExporter(port=args.metrics_port, addr="0.0.0.0")
    try:
        bridge = SlimeBridge(args.publish_dir, store_publisher, args.base_checkpoint, exporter=exporter)
        if args.once:
            result = bridge.poll()
            return 1 if result.refused else 0
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        log.info(
            "watching %s for slime's weight versions; publishing %s to %s",
            args.publish_dir,
            views,
            args.store,
        )
        bridge.run(stop, args.poll_interval)
        return 0
    except (SlimePublishError, StoreError) as e:
        print(f"{prog}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    finally:
        exporter.close()
        store_publisher.close()
        store_publisher.channel.store.close()
