"""The weight channel: versioned precision views of the trainer's weights in a `Store`.

Layout under the store root (keys are relative to it):

    pointer.json                     {"version": N, "manifest": "v{N}/manifest.json", "manifest_sha256": ..., ...}
    lease.json                       the writer lease: {"holder", "generation", "renewed_at", "ttl_seconds"}
    claims/v{N}                      exclusive claim of version number N (one publisher per number)
    v{N}/{view}/<files>              the view's files (safetensors + a small view config json)
    v{N}/manifest.json               digest ("blake3:<hex>") + size of every file, dtype + shape of every tensor
    subscribers/{group}/{replica}.json   what a sidecar reports: view, applied version, versions in use
                                     (rewritten every SUBSCRIBER_HEARTBEAT_SECONDS; aged out after
                                     SUBSCRIBER_STALE_AFTER_SECONDS; removed by the operator once the
                                     replica's pod is gone)

Guarantees (see docs/weights.md for the argument):
- A version's bytes are durable before its manifest is written, and the manifest before the pointer
  names it: the pointer never names partial bytes. A publisher killed at any point leaves the pointer
  unchanged; its half-written `v{N}/` is garbage that `retain` removes.
- One publisher per version number (`claims/v{N}` is created exclusively, holding the publisher's id), so
  a version is never a mix of two publishers' bytes. A publisher with a stable id (the cluster trainer:
  its job's namespace/name) that finds its OWN claim on a version above the pointer (an earlier
  incarnation was killed between claim and pointer: SIGKILL, OOM, a full store) clears that version's
  partial bytes and publishes it again instead of failing for good.
- The pointer only moves forward (compare-and-swap that refuses a lower or equal version), so two
  racing publishers never make readers see a lower version.
- One writer per channel, when publishers take the writer lease (`acquire_lease`: the cluster trainer
  and local mode do): a publisher with another id is refused while the lease is renewed
  (`LeaseHeldError` naming the holder and when it last renewed); the same id (a restart) takes it over at
  once; an unrenewed lease may be taken over after its TTL (WRITER_LEASE_TTL_SECONDS). Every acquire
  bumps the lease's generation, and a publish checks its generation is still the stored one before it
  claims and before it moves the pointer (`LeaseLostError` otherwise), so an older incarnation that
  still runs stops publishing. The pointer records the generation that moved it and its
  compare-and-swap never lowers it: once the new holder published, an older generation cannot move
  the pointer even if it passed its lease check just before the takeover. A lease holder takes over claims of other ids above the pointer: their
  publisher lost the lease, so their publish is dead (stale claims; claims below the pointer go with
  `retain`).
- `retain` deletes old versions but never the latest, an in-flight (higher) one, or any version a
  subscriber reports as in use (in a report not older than SUBSCRIBER_STALE_AFTER_SECONDS, aged from
  the store's own time of its write when its date is later; at most its MAX_PINNED_PER_REPORT newest
  versions at or below the pointer), nor a version any of those is rebuilt from (a view stored as a
  delta: its base, down to an anchor).

Pure of torch (safetensors headers are parsed as JSON), so the operator can read channel status.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import struct
import threading
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlfleet.api.common import SUBSCRIBERS_DIR
from rlfleet.deltas import DELTA_SUFFIX, DeltaError, apply_delta
from rlfleet.store import (
    DIGEST_ALGORITHMS,
    FileDigest,
    FilesystemStore,
    KeyNotFoundError,
    ObjectTooLargeError,
    Store,
    StoreError,
    hash_file,
    new_hasher,
)

log = logging.getLogger(__name__)

MANIFEST_FORMAT = "rlfleet.weights/v3"
"""v3: a view may be stored as a delta against an earlier version of the same view (`ViewManifest.delta`);
v2: file entries are {"digest": "<algorithm>:<hex>", "bytes": N} (v1 had a bare "sha256")."""
VIEW_NAMES = ("bf16", "fp8", "nvfp4", "mxfp4")
"""Precision views (rlfleet.numerics.views implements them; listed here so torch-free code can validate)."""
POINTER_KEY = "pointer.json"
SUBSCRIBER_HEARTBEAT_SECONDS = 30.0
"""A sync sidecar rewrites its subscriber report at least this often while it runs, even when nothing
changed (sampler/sync.py: `SyncConfig.report_interval` defaults to it, and a heartbeat task writes
during long downloads and applies too)."""
SUBSCRIBER_STALE_AFTER_SECONDS = 5 * SUBSCRIBER_HEARTBEAT_SECONDS
"""THE age-out bound of subscriber reports (150 s: five heartbeats, so four missed writes in a row are
tolerated). A report older than this belongs to a replica that is gone or cannot reach the store: it
pins no version in `retain`, counts in no group's version or lag (`group_versions` /
`read_channel_status`, as the operator calls them), and the operator removes it once its replica is no
live pod of its group (`subscribers_to_remove`). docs/weights.md, "Subscriber reports"."""
MAX_PINNED_PER_REPORT = 2
"""The most versions one subscriber report pins in `retain`: its newest listed ones at or below the
pointer (a sidecar reports the version it serves and the one it obtains, `in_use`)."""
LEASE_KEY = "lease.json"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
"""The largest manifest a reader takes (64 MiB): a larger one is refused as damaged before it is read
into memory. A manifest holds one entry per file and per tensor of each view (about 100 bytes each):
64 MiB is room for ~600k entries, far above a 671B MoE with fused expert tensors in four views."""
MAX_REPORT_BYTES = 64 * 1024
"""The largest subscriber report a reader takes (64 KiB; a sidecar's is ~300 bytes): a larger one, like a
malformed one, pins nothing and shows nothing. Reports are written by sampler pods."""
_RECORD_ERRORS = (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError)
"""What parsing a JSON record someone else wrote can raise: not JSON or not UTF-8 (ValueError), a field
missing or of the wrong type, a number too large for an int (1e400), nesting too deep."""
WRITER_LEASE_TTL_SECONDS = 300.0
"""How long a writer lease holds without renewal before a publisher with another id may take it over
(a publisher renews it every WRITER_LEASE_TTL_SECONDS / 5 from a thread, and at each publish; the same
id takes it over at once). 300 s: well above what a live trainer can miss (a store outage that outlasts
boto's retries, a slow checkpoint to a busy volume, GC pauses, NTP clock skew between nodes: lease ages
compare the renewer's wall clock with the reader's), and short enough that a replacement job on the
channel (the old one deleted without a clean stop) waits minutes, not forever. docs/weights.md,
"One writer per channel"."""
DOWNLOAD_WORKERS = min(8, os.cpu_count() or 1)
"""Files of a view a subscriber builds at once by default (WeightChannel.download_workers)."""
READ_KINDS = ("anchor", "delta", "whole-file")
"""What a reader reads from the store, by kind (the `kind` label of the sidecar's
rlfleet_weight_sync_read_bytes_total): the files of an anchor (a version stored whole), delta payloads,
and the files a delta version stores whole (config, tokenizer, a safetensors file whose header changed)."""
ReadCallback = Callable[[str, int], None]
"""Called with (kind, bytes) after each file read from the store (`READ_KINDS`), whether or not it verifies."""
_VERSION_KEY = re.compile(r"^v(\d+)/")
_CLAIM_KEY = re.compile(r"^claims/v(\d+)$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,252}$")
_HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")  # blake3 and sha256: 32 bytes


class ChannelError(StoreError):
    """A channel-level error (bad version, bad manifest)."""


class VersionConflictError(ChannelError):
    """The requested version number is taken or not above the pointer."""


class LeaseHeldError(ChannelError):
    """Another publisher holds the channel's writer lease and renewed it within its TTL."""


class LeaseLostError(ChannelError):
    """This publisher's writer lease was taken over (by another id after its TTL, or by a newer
    incarnation of the same id): it must not publish any more."""


class ChecksumMismatchError(ChannelError):
    """Downloaded bytes do not match the manifest (corrupted or tampered). Never use them."""


class RebuildError(ChannelError):
    """A view stored as a delta cannot be rebuilt: its chain back to an anchor (or to a copy the reader holds)
    is broken (a version or a payload of it gone from the channel), or a payload does not fit its base
    (`rlfleet.deltas.DeltaError`). A byte that differs is a ChecksumMismatchError instead."""


class UnknownDigestError(ChecksumMismatchError):
    """A manifest entry names a digest algorithm this reader does not know: its file cannot be
    verified, so it is refused like a mismatch (a newer publisher than this reader?)."""


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def check_name(kind: str, name: str) -> str:
    """Views, groups and replicas become key components: keep them to a safe alphabet."""
    if not _NAME.match(name):
        raise ValueError(
            f"invalid {kind} name {name!r} (letters, digits, '_', '.', '-'; starts alphanumeric)"
        )
    return name


def check_relative_path(path: str) -> str:
    """A path a manifest names, which readers create under their own directory: a plain relative name only
    (components separated by '/', none empty, '.' or '..'; not absolute; no backslash or NUL), so a name
    planted in a manifest never becomes a path outside the view's directory. ChannelError otherwise."""
    if (
        not path
        or path.startswith("/")
        or "\\" in path
        or "\0" in path
        or any(part in ("", ".", "..") for part in path.split("/"))
    ):
        raise ChannelError(
            f"{path!r} is not a plain relative path (no absolute path, '..', '.' or empty part)"
        )
    return path


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> {dtype, shape} from a safetensors file header (8-byte length + JSON)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ChannelError(f"{path} is not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", prefix)
        if length > 100 * 1024 * 1024:
            raise ChannelError(f"{path}: safetensors header of {length} bytes is implausible")
        header = json.loads(f.read(length))
    return {
        name: {"dtype": entry["dtype"], "shape": list(entry["shape"])}
        for name, entry in header.items()
        if name != "__metadata__"
    }


# ----------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class Pointer:
    """What `pointer.json` says."""

    version: int
    manifest: str
    manifest_sha256: str
    published_at: str
    publisher: str = ""
    lease_generation: int = 0
    """The writer lease generation of the publisher that moved it (0: published without a lease). The
    pointer's compare-and-swap never lowers it: a writer whose lease was taken over cannot move the
    pointer once the new holder has (the generation token the store enforces)."""

    @classmethod
    def from_bytes(cls, data: bytes) -> Pointer:
        """ChannelError (one line, naming what is wrong) for anything but a pointer record."""
        try:
            raw = json.loads(data)
            return cls(
                version=int(raw["version"]),
                manifest=str(raw["manifest"]),
                manifest_sha256=str(raw["manifest_sha256"]),
                published_at=str(raw.get("published_at", "")),
                publisher=str(raw.get("publisher", "")),
                lease_generation=int(raw.get("lease_generation", 0)),
            )
        except _RECORD_ERRORS as e:
            reason = f"no field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            raise ChannelError(f"unreadable pointer ({reason[:200]})") from None

    def to_bytes(self) -> bytes:
        return canonical_json(asdict(self))


def file_entry_to_dict(entry: FileDigest) -> dict[str, Any]:
    """A manifest file entry: {"digest": "<algorithm>:<hex>", "bytes": N} (docs/weights.md)."""
    return {"digest": f"{entry.algorithm}:{entry.hexdigest}", "bytes": entry.bytes}


def file_entry_from_dict(path: str, raw: Mapping[str, Any]) -> FileDigest:
    """Parse a manifest file entry; UnknownDigestError for an algorithm not in DIGEST_ALGORITHMS."""
    if "digest" not in raw:
        raise ChannelError(f"manifest entry of {path} has no digest (keys: {sorted(raw)})")
    algorithm, _, hexdigest = str(raw["digest"]).partition(":")
    if algorithm not in DIGEST_ALGORITHMS:
        raise UnknownDigestError(
            f"manifest entry of {path}: unknown digest algorithm {algorithm!r} "
            f"(this reader verifies {', '.join(DIGEST_ALGORITHMS)}); refusing the file"
        )
    if not _HEX_DIGEST.match(hexdigest):
        raise ChannelError(f"manifest entry of {path}: {raw['digest']!r} is not {algorithm}:<64 hex digits>")
    return FileDigest(algorithm, hexdigest, int(raw["bytes"]))


@dataclass(frozen=True)
class ViewDelta:
    """How a view stored as a delta is rebuilt (docs/weights.md, "Deltas"): each file `<rel>` with a payload
    `<rel>.delta` here is `rlfleet.deltas.apply_delta` of the SAME file of version `base`'s view (itself an
    anchor or rebuilt the same way); every other file of the view is stored whole, as in an anchor."""

    base: int
    """The version whose view this one's payloads apply to (the previous version of the same view)."""
    files: dict[str, FileDigest]
    """Payload path relative to the view directory (`<rel>.delta`) -> digest and size of the stored bytes."""

    @property
    def bytes(self) -> int:
        return sum(entry.bytes for entry in self.files.values())

    def rebuilt(self) -> list[str]:
        """The view files this delta rebuilds (`<rel>` of every `<rel>.delta`)."""
        return sorted(p.removesuffix(DELTA_SUFFIX) for p in self.files)

    def to_dict(self) -> dict[str, Any]:
        return {
            "base": self.base,
            "files": {path: file_entry_to_dict(entry) for path, entry in sorted(self.files.items())},
            "bytes": self.bytes,
        }


@dataclass(frozen=True)
class DeltaSource:
    """What a publisher hands `WeightChannel.publish` for a view stored as a delta."""

    base: int
    """The version the payloads were encoded against (the previous published version of the view)."""
    payloads: dict[str, Path]
    """Relative path of a safetensors file of the view -> its local delta payload."""


@dataclass(frozen=True)
class ViewManifest:
    """One view of one version."""

    view: str
    files: dict[str, FileDigest]
    """Path relative to the view directory -> digest (BLAKE3 as published) and size of the COMPLETE
    checkpoint's file: what the engine loads, whether the file is stored whole or rebuilt from a delta."""
    tensors: dict[str, dict[str, Any]]
    """Tensor name -> {"dtype": safetensors dtype string, "shape": [...]} over all safetensors files."""
    delta: ViewDelta | None = None
    """None: an anchor (every file stored whole). Else the files it rebuilds from version `delta.base`."""

    @property
    def bytes(self) -> int:
        """Size of the complete view (what a sampler loads)."""
        return sum(entry.bytes for entry in self.files.values())

    def stored_files(self) -> dict[str, FileDigest]:
        """What the channel holds under `v{N}/{view}/`: path -> digest and size (payloads of a delta,
        every other file whole)."""
        if self.delta is None:
            return dict(self.files)
        rebuilt = set(self.delta.rebuilt())
        stored = {rel: entry for rel, entry in self.files.items() if rel not in rebuilt}
        stored.update(self.delta.files)
        return stored

    @property
    def stored_bytes(self) -> int:
        """Bytes the channel holds (and a sampler reads) for this view of this version."""
        return sum(entry.bytes for entry in self.stored_files().values())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "files": {path: file_entry_to_dict(entry) for path, entry in sorted(self.files.items())},
            "tensors": self.tensors,
            "bytes": self.bytes,
        }
        if self.delta is not None:
            out["delta"] = self.delta.to_dict()
        return out

    @property
    def sha256(self) -> str:
        """Digest of this view's manifest entry (what status reports as the view's sha256)."""
        return hashlib.sha256(canonical_json(self.to_dict())).hexdigest()


@dataclass(frozen=True)
class Manifest:
    version: int
    published_at: str
    publisher: str
    views: dict[str, ViewManifest]
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": MANIFEST_FORMAT,
                "version": self.version,
                "published_at": self.published_at,
                "publisher": self.publisher,
                "views": {name: view.to_dict() for name, view in sorted(self.views.items())},
                "metadata": self.metadata,
            },
            sort_keys=True,
            indent=1,
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            raw = json.loads(data)
            if raw.get("format") != MANIFEST_FORMAT:
                raise ChannelError(f"unknown manifest format {raw.get('format')!r}")
            version = int(raw["version"])
            views = {}
            for name, v in raw["views"].items():
                try:
                    paths = [check_relative_path(p) for p in v["files"]]
                except ChannelError as e:
                    raise ChannelError(f"manifest of v{version}: view {name}: {e}") from None
                files = {p: file_entry_from_dict(p, v["files"][p]) for p in paths}
                delta = (
                    None
                    if v.get("delta") is None
                    else _view_delta_from_dict(name, version, v["delta"], files)
                )
                views[name] = ViewManifest(name, files, dict(v.get("tensors", {})), delta)
            return cls(
                version,
                str(raw["published_at"]),
                str(raw.get("publisher", "")),
                views,
                dict(raw.get("metadata", {})),
            )
        except _RECORD_ERRORS as e:
            raise ChannelError(f"malformed manifest: {type(e).__name__}: {str(e)[:200]}") from None


LORA_BASE_KEY = "lora_base"
"""Manifest metadata of a LoRA version (rlfleet/lora.py): base view -> the version that holds it, stored
whole once (docs/weights.md, "LoRA"). Retention keeps those versions while a version naming them is kept."""


def lora_bases(manifest: Manifest) -> dict[str, int]:
    """The base views a LoRA version's adapter applies to, and the versions holding them ({}: not LoRA).
    ChannelError (one line) for an entry that names an unknown view or no earlier-or-same version."""
    raw = manifest.metadata.get(LORA_BASE_KEY)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ChannelError(f"manifest of v{manifest.version}: {LORA_BASE_KEY} is not a mapping")
    bases: dict[str, int] = {}
    for view, version in raw.items():
        if view not in VIEW_NAMES or isinstance(version, bool) or not isinstance(version, int):
            raise ChannelError(
                f"manifest of v{manifest.version}: {LORA_BASE_KEY} entry {view!r}: {version!r}"
            )
        if not 0 <= version <= manifest.version:
            raise ChannelError(
                f"manifest of v{manifest.version}: base view {view} at v{version} is not an earlier version"
            )
        bases[view] = version
    return bases


def newest_version_of_view(channel: WeightChannel, view: str) -> tuple[int, Manifest] | None:
    """The newest complete version that has `view`, with its manifest (None: none yet).

    The pointer's version first (its manifest checked against the pointer's sha256); if that version
    lacks the view, older complete versions, newest first (a LoRA job's base views are stored once, at
    the version that first needed them)."""
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


def _view_delta_from_dict(
    view: str, version: int, raw: Mapping[str, Any], view_files: Mapping[str, FileDigest]
) -> ViewDelta:
    """A manifest's `delta` entry, checked: its base is an earlier version, every payload is `<rel>.delta` of a
    safetensors file the view lists (a name planted in a manifest never becomes another path)."""
    base = int(raw["base"])
    if not 0 <= base < version:
        raise ChannelError(
            f"manifest of v{version}: view {view}'s delta base v{base} is not an earlier version"
        )
    files = {p: file_entry_from_dict(p, e) for p, e in raw["files"].items()}
    if not files:
        raise ChannelError(f"manifest of v{version}: view {view}'s delta has no payload")
    for path in files:
        rebuilt = path.removesuffix(DELTA_SUFFIX)
        if not path.endswith(".safetensors" + DELTA_SUFFIX) or rebuilt not in view_files:
            raise ChannelError(
                f"manifest of v{version}: view {view}'s delta payload {path!r} is not <file>{DELTA_SUFFIX} "
                "of a safetensors file the view lists"
            )
    return ViewDelta(base, files)


@dataclass(frozen=True)
class SubscriberReport:
    """What one sidecar reports about its replica (stored at subscribers/{group}/{replica}.json)."""

    group: str
    replica: str
    view: str
    applied_version: int | None
    in_use: list[int]
    """Versions the replica serves or is downloading: retention keeps them."""
    updated_at: str = ""
    failures: int = 0
    last_error: str | None = None
    stored_at: str = ""
    """When the store last wrote the report, by the STORE's clock (`Store.modified_times`: S3
    Last-Modified, a filesystem's ctime); filled by `WeightChannel.subscribers`, never read from the
    report's bytes: what a report's writer claims (`updated_at`) cannot make it fresher than this."""

    def to_bytes(self) -> bytes:
        return canonical_json({k: v for k, v in asdict(self).items() if k != "stored_at"})

    @classmethod
    def from_bytes(cls, data: bytes) -> SubscriberReport:
        raw = json.loads(data)
        return cls(
            group=str(raw["group"]),
            replica=str(raw["replica"]),
            view=str(raw["view"]),
            applied_version=None if raw.get("applied_version") is None else int(raw["applied_version"]),
            in_use=[int(v) for v in raw.get("in_use", [])],
            updated_at=str(raw.get("updated_at", "")),
            failures=int(raw.get("failures", 0)),
            last_error=raw.get("last_error"),
        )


@dataclass(frozen=True)
class WriterLease:
    """What `lease.json` says: who writes this channel, which acquisition (generation) and when it was
    last renewed (the renewer's UTC wall clock)."""

    holder: str
    generation: int
    renewed_at: str
    ttl_seconds: float
    stored_age_seconds: float | None = field(default=None, compare=False)
    """Its age when read, by the STORE's clock (`PointerValue.age_seconds`): what `age_seconds` returns
    when known, so no writer's clock (ahead: a dead holder kept forever; behind: a live one taken over)
    decides when a lease expires. Never written into the lease."""

    def to_bytes(self) -> bytes:
        return canonical_json({k: v for k, v in asdict(self).items() if k != "stored_age_seconds"})

    @classmethod
    def from_bytes(cls, data: bytes) -> WriterLease:
        raw = json.loads(data)
        return cls(
            str(raw["holder"]), int(raw["generation"]), str(raw["renewed_at"]), float(raw["ttl_seconds"])
        )

    def age_seconds(self, now: datetime) -> float:
        """Seconds since the last renewal: by the store's clock when read from it (`stored_age_seconds`),
        else `now` minus `renewed_at` (an unparseable time is infinitely old)."""
        if self.stored_age_seconds is not None:
            return self.stored_age_seconds
        try:
            at = datetime.fromisoformat(self.renewed_at)
        except ValueError:
            return math.inf
        return (now - (at if at.tzinfo else at.replace(tzinfo=UTC))).total_seconds()

    def describe(self, now: datetime) -> str:
        return (
            f"{self.holder!r} (generation {self.generation}, last renewed {self.renewed_at}, "
            f"{self.age_seconds(now):.0f}s ago; the lease expires {self.ttl_seconds:.0f}s after a renewal)"
        )


class _BaseRefused(Exception):
    """A file made from a rebuild step's base (applied to or copied from it) was refused: the base copy's
    fault when it is the reader's local copy (it may be torn), the channel's when it was just built and
    verified here."""

    def __init__(self, error: ChecksumMismatchError | RebuildError) -> None:
        super().__init__(str(error))
        self.error = error


class _LocalCopyRefused(_BaseRefused):
    """_BaseRefused where the base was the reader's local copy: `obtain_view` reseeds from the anchor."""


@dataclass(frozen=True)
class _Step:
    """One version of a view being rebuilt (`WeightChannel._build`): into `out` from `base` (its version,
    manifest and directory; None: nothing at hand, every file is read), payloads landing under `work`."""

    version: int
    view: str
    vm: ViewManifest
    base: tuple[int, ViewManifest, Path] | None
    out: Path
    work: Path

    @property
    def prefix(self) -> str:
        """Its files' keys in the channel: `v<version>/<view>`."""
        return f"{_version_key(self.version)}/{self.view}"


@dataclass(frozen=True)
class ObtainedView:
    """One view of one version in a local directory, every file verified against its manifest
    (`WeightChannel.obtain_view`)."""

    directory: Path
    version: int
    seed: str
    """Where it was rebuilt from: "anchor vA" (downloaded from the channel) or "local vL" (a verified copy the
    reader held)."""
    deltas: tuple[int, ...]
    """The delta versions applied after the seed, in order (empty: the version is its seed)."""
    read_bytes: dict[str, int]
    """Bytes read from the store, by kind (READ_KINDS)."""
    fallback: StoreError | None = field(default=None, compare=False)
    """Why rebuilding from the reader's local copy failed, so the view was reseeded from the anchor (a
    ChecksumMismatchError, RebuildError or KeyNotFoundError of one line); None when the first way worked."""

    def describe(self) -> str:
        """E.g. "anchor v4 + deltas v5, v6, v7" or "local v6 + delta v7"."""
        if not self.deltas:
            return self.seed
        named = ", ".join(f"v{v}" for v in self.deltas)
        return f"{self.seed} + delta{'s' if len(self.deltas) > 1 else ''} {named}"


@dataclass(frozen=True)
class PublishResult:
    version: int
    advanced: bool
    """True if this publish moved the pointer; False if a higher version was already published."""
    manifest: Manifest
    bytes: int
    """Bytes this version stored (and a sampler of each view reads): payloads of deltas, other files whole."""


# ----------------------------------------------------------------------------------------------
# The channel


def _version_key(version: int) -> str:
    return f"v{version}"


def manifest_key(version: int) -> str:
    return f"{_version_key(version)}/manifest.json"


def _local_view_files(view_dirs: Mapping[str, Path]) -> list[tuple[str, str, Path]]:
    """(view, relative path, local path) of every file of the views to publish; ValueError for a bad name,
    a missing or empty directory."""
    if not view_dirs:
        raise ValueError("publish needs at least one view")
    files: list[tuple[str, str, Path]] = []
    for view, directory in sorted(view_dirs.items()):
        check_name("view", view)
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"view {view}: {directory} is not a directory")
        found = [
            (view, p.relative_to(directory).as_posix(), p)
            for p in sorted(directory.rglob("*"))
            if p.is_file()
        ]
        if not found:
            raise ValueError(f"view {view}: {directory} has no files")
        files.extend(found)
    return files


def _check_delta_sources(
    deltas: Mapping[str, DeltaSource], files: list[tuple[str, str, Path]], version: int | None
) -> None:
    """ValueError unless every payload stands for a safetensors file of a published view, against an
    earlier version."""
    for view, source in deltas.items():
        listed = {rel for v, rel, _ in files if v == view and rel.endswith(".safetensors")}
        unknown = sorted(set(source.payloads) - listed)
        if not any(v == view for v, _, _ in files) or unknown:
            raise ValueError(
                f"view {view}: delta payloads for files the view does not have: {unknown or '(no such view)'}"
            )
        if version is not None and not 0 <= source.base < version:
            raise ValueError(f"view {view}: delta base v{source.base} is not below v{version}")


class WeightChannel:
    """Publish and read versions of precision views in a Store."""

    def __init__(
        self,
        store: Store,
        *,
        publisher_id: str | None = None,
        upload_workers: int = 2,
        download_workers: int = DOWNLOAD_WORKERS,
    ) -> None:
        self.store = store
        self.publisher_id = publisher_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.upload_workers = max(1, upload_workers)
        self.download_workers = max(1, download_workers)
        """Files of a view a subscriber builds at once (obtain_view: downloads, copies, applied deltas)."""
        self.lease: WriterLease | None = None
        """The writer lease this channel object holds (`acquire_lease`); None: it publishes unfenced."""

    # -- the writer lease (one writer per channel)
    def _read_lease(self) -> tuple[WriterLease | None, str | None]:
        value = self.store.read_pointer(LEASE_KEY)
        if value is None:
            return None, None
        try:
            return replace(
                WriterLease.from_bytes(value.data), stored_age_seconds=value.age_seconds
            ), value.token
        except _RECORD_ERRORS as e:  # unreadable: nobody can prove they hold it
            log.warning(
                "writer lease %s is unreadable (%s): treating it as expired", self.store.uri_of(LEASE_KEY), e
            )
            return None, value.token

    def acquire_lease(self, ttl_seconds: float = WRITER_LEASE_TTL_SECONDS) -> WriterLease:
        """Become the channel's one writer: take the lease if it is free, ours (a restart of the same id)
        or expired (not renewed for its TTL); LeaseHeldError naming the holder otherwise. Each acquire is a
        new generation, which fences any older incarnation of this id still running."""
        for _ in range(100):
            held, token = self._read_lease()
            now = datetime.now(UTC)
            pointer = self.latest()  # its generation too: an unreadable lease must not restart the count
            newest = max(
                0 if held is None else held.generation, 0 if pointer is None else pointer.lease_generation
            )
            if (
                held is not None
                and held.holder != self.publisher_id
                and held.age_seconds(now) <= held.ttl_seconds
            ):
                raise LeaseHeldError(
                    f"the weight channel {self.store.uri} is written by {held.describe(now)}; this is "
                    f"{self.publisher_id!r}. One trainer per channel: stop the other one, or give this job "
                    "its own store path / prefix"
                )
            lease = WriterLease(self.publisher_id, newest + 1, now_iso(), ttl_seconds)
            if self.store.compare_and_swap(LEASE_KEY, token, lease.to_bytes()):
                if held is not None and held.holder != self.publisher_id:
                    log.warning("took over the writer lease of %s: it expired", held.describe(now))
                self.lease = lease
                return lease
        raise ChannelError(f"writer lease {self.store.uri_of(LEASE_KEY)}: compare-and-swap kept failing")

    def renew_lease(self) -> WriterLease:
        """Renew the lease this channel holds (LeaseLostError if it was taken over meanwhile)."""
        if self.lease is None:
            raise ChannelError("renew_lease before acquire_lease")
        for _ in range(100):
            token = self._check_lease()
            renewed = WriterLease(self.lease.holder, self.lease.generation, now_iso(), self.lease.ttl_seconds)
            if self.store.compare_and_swap(LEASE_KEY, token, renewed.to_bytes()):
                self.lease = renewed
                return renewed
        raise ChannelError(f"writer lease {self.store.uri_of(LEASE_KEY)}: compare-and-swap kept failing")

    def _fence(self) -> None:
        """A publish under a lease stops (LeaseLostError) once another writer took the lease over."""
        if self.lease is not None:
            self._check_lease()

    def _check_lease(self) -> str | None:
        """The fence: the stored lease is still this channel's (holder and generation); returns its swap
        token. LeaseLostError otherwise."""
        assert self.lease is not None
        held, token = self._read_lease()
        if held is None or (held.holder, held.generation) != (self.lease.holder, self.lease.generation):
            now = datetime.now(UTC)
            raise LeaseLostError(
                f"the writer lease of {self.store.uri} (generation {self.lease.generation} of "
                f"{self.lease.holder!r}) was taken over"
                + ("" if held is None else f" by {held.describe(now)}")
                + ": another trainer writes this channel now; this one stops publishing"
            )
        return token

    # -- reading
    def latest(self) -> Pointer | None:
        """The pointer (None: nothing published yet). ChannelError, one line, if it is unreadable."""
        value = self.store.read_pointer(POINTER_KEY)
        return None if value is None else self._pointer(value.data)

    def _pointer(self, data: bytes) -> Pointer:
        try:
            return Pointer.from_bytes(data)
        except ChannelError as e:
            raise ChannelError(f"{self.store.uri_of(POINTER_KEY)}: {e}") from None

    def manifest(self, version: int, *, expected_sha256: str | None = None) -> Manifest:
        """The manifest of `version`, read with the MAX_MANIFEST_BYTES bound. ChecksumMismatchError if it is
        not the one the pointer names, ChannelError (one line) if it is too large or malformed: the
        version is damaged."""
        try:
            data = self.store.get(manifest_key(version), max_bytes=MAX_MANIFEST_BYTES)
        except ObjectTooLargeError as e:
            raise ChannelError(
                f"manifest of v{version} refused as damaged: {e} (the bound is "
                f"MAX_MANIFEST_BYTES, {MAX_MANIFEST_BYTES} bytes)"
            ) from None
        if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256:
            raise ChecksumMismatchError(f"manifest of v{version} does not match the pointer's sha256")
        manifest = Manifest.from_bytes(data)
        if manifest.version != version:
            raise ChecksumMismatchError(f"manifest at v{version} claims version {manifest.version}")
        return manifest

    def versions(self) -> list[int]:
        """Versions with a complete manifest, ascending."""
        found = set()
        for key in self.store.list("v"):
            m = _VERSION_KEY.match(key)
            if m and key == manifest_key(int(m.group(1))):
                found.add(int(m.group(1)))
        return sorted(found)

    # -- publishing
    def _claim(self, version: int | None) -> int:
        pointer = self.latest()
        current = -1 if pointer is None else pointer.version
        if version is not None:
            if version <= current:
                raise VersionConflictError(f"version {version} is not above the published version {current}")
            claim = f"claims/{_version_key(version)}"
            if not self.store.create(claim, self.publisher_id.encode()):
                self._reclaim(claim, version)
            return version
        claimed = [int(m.group(1)) for k in self.store.list("claims/") if (m := _CLAIM_KEY.match(k))]
        candidate = max([current, *claimed]) + 1
        for _ in range(1000):
            if self.store.create(f"claims/{_version_key(candidate)}", self.publisher_id.encode()):
                return candidate
            candidate += 1
        raise ChannelError("could not claim a version number after 1000 attempts")

    def _reclaim(self, claim: str, version: int) -> None:
        """`version` is claimed and above the pointer: ours from an interrupted publish (its bytes were
        never named by the pointer) -> clear them and publish again; anyone else's -> VersionConflictError,
        unless we hold the writer lease (fenced just before): then that publisher lost the lease and its
        claim is stale -> take it over the same way."""
        try:
            holder = self.store.get(claim).decode(errors="replace")
        except StoreError:
            holder = "?"
        if holder != self.publisher_id and self.lease is None:
            raise VersionConflictError(
                f"version {version} is already claimed by publisher {holder!r} (this is {self.publisher_id!r}): "
                "another trainer publishes to this channel"
            )
        partial = self.store.list(f"{_version_key(version)}/")
        for key in partial:
            self.store.delete(key)
        if holder != self.publisher_id:  # we hold the lease (checked): the claim's publisher lost it
            self.store.put(claim, self.publisher_id.encode())
        log.warning(
            "version %d: taking over the claim of %s of an interrupted publish (%d partial files removed)",
            version,
            "this publisher" if holder == self.publisher_id else f"{holder!r}, a former lease holder",
            len(partial),
        )

    def publish(
        self,
        view_dirs: Mapping[str, Path],
        *,
        version: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        move: bool = False,
        digests: Mapping[Path, FileDigest] | None = None,
        deltas: Mapping[str, DeltaSource] | None = None,
    ) -> PublishResult:
        """Upload local view directories as one new version and advance the pointer to it.

        `view_dirs`: view name -> local directory (as written by `rlfleet.numerics.views.save_view`).
        `version`: an explicit number (e.g. the trainer step); default: the next free number.
        `move`: the directories are private staging copies the store may take over (rename).
        `digests`: local file path -> digest (BLAKE3) and size computed while the file was written
        (`rlfleet.numerics.views.save_view` returns them): those files are not read again to hash.
        The manifest records each file's digest with its algorithm.
        `deltas`: view -> the payloads that stand for some of its files (`DeltaSource`, written by
        `rlfleet.deltas.encode_delta` against version `base`'s same file): such a file is hashed for the
        manifest (the complete checkpoint's digest) but only its payload `<rel>.delta` is uploaded; the file
        stays where it is (with `move`, the caller still owns it)."""
        files = _local_view_files(view_dirs)
        deltas = dict(deltas or {})
        _check_delta_sources(deltas, files, version)

        # dtype + shape of every tensor, read before any file may be moved into the store
        headers = {(v, rel): safetensors_header(p) for v, rel, p in files if rel.endswith(".safetensors")}
        self._fence()
        number = self._claim(version)
        prefix = _version_key(number)

        def upload(item: tuple[str, str, Path]) -> tuple[FileDigest, FileDigest | None]:
            """(the complete file's digest, its stored payload's digest when a delta stands for it)."""
            view, rel, path = item
            known = None if digests is None else digests.get(path)
            payload = deltas[view].payloads.get(rel) if view in deltas else None
            if payload is None:
                return self.store.put_file(f"{prefix}/{view}/{rel}", path, move=move, digest=known), None
            stored = self.store.put_file(f"{prefix}/{view}/{rel}{DELTA_SUFFIX}", payload, move=move)
            return (known if known is not None else hash_file(path)), stored

        # Uploads are I/O + hashing (both release the GIL): a couple of threads overlap them.
        with ThreadPoolExecutor(max_workers=self.upload_workers) as pool:
            uploaded = list(pool.map(upload, files))

        entries: dict[str, tuple[dict[str, FileDigest], dict[str, Any], dict[str, FileDigest]]] = {}
        for (view, rel, _), (digest, payload) in zip(files, uploaded, strict=True):
            complete, tensors, payloads = entries.setdefault(view, ({}, {}, {}))
            complete[rel] = digest
            if payload is not None:
                payloads[rel + DELTA_SUFFIX] = payload
            if rel.endswith(".safetensors"):
                tensors.update(headers[(view, rel)])
        views = {
            view: ViewManifest(
                view, complete, tensors, ViewDelta(deltas[view].base, payloads) if payloads else None
            )
            for view, (complete, tensors, payloads) in entries.items()
        }
        manifest = Manifest(number, now_iso(), self.publisher_id, views, dict(metadata or {}))
        manifest_bytes = manifest.to_bytes()
        # Every byte above is durable (put_file returns after fsync / S3 200); only now the manifest.
        self.store.put(manifest_key(number), manifest_bytes)
        self._fence()  # again, right before the pointer moves
        pointer = Pointer(
            number,
            manifest_key(number),
            hashlib.sha256(manifest_bytes).hexdigest(),
            manifest.published_at,
            self.publisher_id,
            0 if self.lease is None else self.lease.generation,
        )
        advanced = self._advance(pointer)
        return PublishResult(number, advanced, manifest, sum(v.stored_bytes for v in views.values()))

    def _advance(self, pointer: Pointer) -> bool:
        """Compare-and-swap the pointer forward; False if it already names an equal or higher version.
        LeaseLostError if a newer lease generation moved it (this writer was fenced off)."""
        for _ in range(1000):
            current = self.store.read_pointer(POINTER_KEY)
            named = None if current is None else self._pointer(current.data)
            if named is not None and named.lease_generation > pointer.lease_generation:
                raise LeaseLostError(
                    f"the pointer of {self.store.uri} was moved by writer lease generation {named.lease_generation} "
                    f"({named.publisher!r}); this is generation {pointer.lease_generation} of "
                    f"{self.publisher_id!r}: another trainer writes this channel now; this one stops publishing"
                )
            if named is not None and named.version >= pointer.version:
                return False
            if self.store.compare_and_swap(
                POINTER_KEY, None if current is None else current.token, pointer.to_bytes()
            ):
                return True
        raise ChannelError("pointer compare-and-swap kept failing")

    # -- downloading and rebuilding (sidecar side)
    def obtain_view(
        self,
        version: int,
        view: str,
        dest: Path,
        *,
        manifest: Manifest | None = None,
        local: Mapping[int, Path] | None = None,
        on_read: ReadCallback | None = None,
    ) -> ObtainedView:
        """The complete view of `version` in `dest`, every file verified against the manifest's digest of the
        COMPLETE file (streaming, with the algorithm its entry names) (docs/weights.md, "Rebuilding a view").

        An anchor is downloaded. A delta version is rebuilt: walking back through `delta.base` to the first
        version the caller holds in `local` (version -> a directory it verified earlier, e.g. the sidecar's
        previous copy) or to an anchor, then, in order, each later version is built from the one before
        (its payloads applied with `rlfleet.deltas.apply_delta`, its other files downloaded, or copied from
        the one before when their manifest entries are equal) and verified file by file before it becomes
        the base of the next. If the way from a local copy fails (a copy that no longer verifies, a payload
        refused), the view is reseeded once from the anchor of the chain, with a one-line WARNING.

        Everything happens in a hidden temporary sibling of `dest` (`.<name>.partial-<id>`), renamed to
        `dest` only once the version verified; nothing is left on failure (a process killed meanwhile leaves
        the hidden directory, which no reader takes for a view). Raises ChecksumMismatchError (a byte
        differs), RebuildError (the chain is broken or a payload does not fit its base), KeyNotFoundError (a
        file of an anchor is missing) or StoreUnavailableError; when both ways failed, the message says both."""
        manifest = manifest or self.manifest(version)
        if view not in manifest.views:
            raise ChannelError(f"version {version} has no view {view!r} (has {sorted(manifest.views)})")
        dest = Path(dest)
        local = dict(local or {})
        read_bytes = dict.fromkeys(READ_KINDS, 0)

        def counted(kind: str, nbytes: int) -> None:
            read_bytes[kind] += nbytes
            if on_read is not None:
                on_read(kind, nbytes)

        manifests: dict[int, Manifest] = {version: manifest}  # each base manifest read once per call
        work = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
        try:
            fallback: StoreError | None = None
            seed, steps = self._rebuild_plan(version, view, manifests, local)
            try:
                built = self._build(view, seed, steps, work, counted)
            except _LocalCopyRefused as refused:
                assert seed is not None  # only a local seed is refused this way
                failed = f"rebuilding from the local copy of v{seed[0]} failed ({refused.error})"
                fallback = type(refused.error)(failed)
                try:
                    seed, steps = self._rebuild_plan(version, view, manifests, {})
                    log.warning(
                        "v%d/%s: %s; reseeding from the anchor v%d", version, view, failed, steps[0][0]
                    )
                    shutil.rmtree(work, ignore_errors=True)
                    built = self._build(view, None, steps, work, counted)
                except (ChecksumMismatchError, RebuildError, KeyNotFoundError) as again:
                    raise type(again)(f"{again}; before that, {failed}") from None
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(built, dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        seed_name = f"local v{seed[0]}" if seed is not None else f"anchor v{steps[0][0]}"
        deltas = tuple(v for v, vm in steps if vm.delta is not None)
        return ObtainedView(dest, version, seed_name, deltas, read_bytes, fallback)

    def _rebuild_plan(
        self, version: int, view: str, manifests: dict[int, Manifest], local: Mapping[int, Path]
    ) -> tuple[tuple[int, ViewManifest, Path] | None, list[tuple[int, ViewManifest]]]:
        """(the local copy to start from or None, the versions to build in order): walking back from
        `version` through `delta.base` to the first version in `local` or an anchor (then the first step).
        RebuildError if a version of the chain is gone or lacks the view."""
        steps: list[tuple[int, ViewManifest]] = []
        at, vm = version, manifests[version].views[view]
        while True:
            if at in local:
                return (at, vm, Path(local[at])), steps[::-1]
            steps.append((at, vm))
            if vm.delta is None:
                return None, steps[::-1]
            base = vm.delta.base
            if base not in manifests:
                try:
                    manifests[base] = self.manifest(base)
                except (KeyNotFoundError, ChannelError) as e:
                    gone = isinstance(e, KeyNotFoundError)
                    raise RebuildError(
                        f"v{version}/{view}: v{base}, the base of v{at}, is "
                        + ("gone from the channel (no manifest)" if gone else f"unreadable ({e})")
                    ) from None
            if view not in manifests[base].views:
                raise RebuildError(f"v{version}/{view}: v{base}, the base of v{at}, has no view {view}")
            at, vm = base, manifests[base].views[view]

    def _build(
        self,
        view: str,
        seed: tuple[int, ViewManifest, Path] | None,
        steps: list[tuple[int, ViewManifest]],
        work: Path,
        on_read: ReadCallback,
    ) -> Path:
        """Build `steps` in order under `work`, each from the one before (the first from `seed`, or an anchor),
        each verified before the next; returns the last one's directory. With a seed and no steps, the seed
        is the version itself: copied, verified."""
        base = seed
        todo = steps or ([] if seed is None else [(seed[0], seed[1])])
        built = work
        for at, vm in todo:
            built = work / f"v{at}"
            try:
                self._build_step(_Step(at, view, vm, base, built, work), on_read)
            except _BaseRefused as refused:
                if base is not None and base is seed:
                    raise _LocalCopyRefused(refused.error) from None  # the local copy may be torn: reseed
                raise refused.error from None  # built from verified bytes: the channel's fault
            if base is not None and base[2].parent == work:
                shutil.rmtree(base[2])  # an intermediate version, done with
            base = (at, vm, built)
        return built

    def _build_step(self, step: _Step, on_read: ReadCallback) -> None:
        """The step's version of its view into `step.out`, every file verified: a file whose manifest entry
        equals the base's copied from it (all of them when the base is this version), a payload applied to the
        base's file, any other file downloaded. A file made from the base's bytes that is refused raises
        _BaseRefused (whose fault it is depends on where the base came from, `_build`).

        The files are built by `download_workers` threads at once (copies, applies, downloads and their
        hashing release the GIL; a real view is many shards, one thread builds one at about the speed of a
        copy); after a failure no further file is started, and the first failure in file order is raised
        once the files started are done (the same one a build file by file raises)."""
        read_lock = threading.Lock()

        def counted(kind: str, nbytes: int) -> None:  # on_read adds to shared totals
            with read_lock:
                on_read(kind, nbytes)

        failed = threading.Event()

        def build(item: tuple[str, FileDigest]) -> BaseException | None:
            if failed.is_set():  # the step fails anyway: start no more reads (files are taken in order)
                return None
            try:
                self._build_file(step, counted, *item)
            except (StoreError, _BaseRefused, OSError) as e:
                failed.set()
                return e
            return None

        files = sorted(step.vm.files.items())
        with ThreadPoolExecutor(max_workers=max(1, min(self.download_workers, len(files)))) as pool:
            failures = [e for e in pool.map(build, files) if e is not None]
        if failures:
            raise failures[0]

    def _build_file(self, step: _Step, on_read: ReadCallback, rel: str, entry: FileDigest) -> None:
        """One file of `_build_step`."""
        vm, base, prefix = step.vm, step.base, step.prefix
        target = step.out / rel
        if base is not None and base[1].files.get(rel) == entry and (base[2] / rel).is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(base[2] / rel, target)  # unchanged since the base: no read from the store
            digest = hash_file(target, entry.algorithm)
            if digest != entry:
                raise _BaseRefused(
                    ChecksumMismatchError(
                        f"{prefix}/{rel} copied from v{base[0]}: {digest} != manifest {entry} (a torn base?)"
                    )
                )
        elif vm.delta is not None and rel in vm.delta.rebuilt():
            if base is None or base[0] != vm.delta.base:
                raise RebuildError(f"{prefix}/{rel}: its base v{vm.delta.base} is not at hand")
            base_file = base[2] / rel
            if not base_file.is_file():
                raise _BaseRefused(
                    ChecksumMismatchError(f"{prefix}/{rel}: the copy of its base v{base[0]} lacks the file")
                )
            payload_rel = rel + DELTA_SUFFIX
            payload = step.work / "payloads" / payload_rel
            self._get_verified(
                f"{prefix}/{payload_rel}",
                payload,
                vm.delta.files[payload_rel],
                "delta",
                on_read,
                missing=RebuildError,
            )
            target.parent.mkdir(parents=True, exist_ok=True)
            hasher = new_hasher(entry.algorithm)  # fed in the apply's own pass: no second read
            try:
                size = apply_delta(base_file, payload, target, hasher=hasher)
            except DeltaError as e:
                raise _BaseRefused(
                    RebuildError(f"{prefix}/{payload_rel} does not fit v{base[0]}: {e}")
                ) from None
            payload.unlink()
            digest = FileDigest(entry.algorithm, hasher.hexdigest(), size)
            if digest != entry:
                raise _BaseRefused(
                    ChecksumMismatchError(
                        f"{prefix}/{rel} rebuilt from v{base[0]}: {digest} != manifest {entry} (a torn base?)"
                    )
                )
        else:
            missing = KeyNotFoundError if vm.delta is None else RebuildError
            whole = "anchor" if vm.delta is None else "whole-file"
            self._get_verified(f"{prefix}/{rel}", target, entry, whole, on_read, missing=missing)

    def _get_verified(
        self,
        key: str,
        path: Path,
        entry: FileDigest,
        kind: str,
        on_read: ReadCallback,
        *,
        missing: type[StoreError],
    ) -> None:
        """Download `key` to `path` hashing it as it lands; ChecksumMismatchError unless it is `entry`. A key
        that is gone raises `missing` (KeyNotFoundError for an anchor's file, RebuildError in a delta's)."""
        try:
            digest = self.store.get_file(key, path, algorithm=entry.algorithm)
        except KeyNotFoundError as e:
            if missing is KeyNotFoundError:
                raise
            raise missing(f"{key} is gone from the channel ({e})") from None
        on_read(kind, digest.bytes)
        if digest != entry:
            raise ChecksumMismatchError(f"{key}: {digest} != manifest {entry}")

    def verify_view_in_place(
        self,
        version: int,
        view: str,
        *,
        manifest: Manifest | None = None,
        on_read: ReadCallback | None = None,
    ) -> Path:
        """The directory where a filesystem store holds one view of a version, after hashing every file
        there (streaming, with the algorithm its manifest entry names) against the manifest: what an
        engine that sees the store loads instead of a downloaded copy (docs/weights.md, "Loading in
        place"). Only an anchor is held whole: a view stored as a delta is rebuilt (`obtain_view`). Raises
        ChecksumMismatchError if any byte differs or the directory holds a file the manifest does not list,
        KeyNotFoundError if a listed file is missing, ChannelError if the store is not a filesystem store or
        the view is stored as a delta. `on_read("anchor", bytes)` after each file hashed (read from the store)."""
        manifest = manifest or self.manifest(version)
        if view not in manifest.views:
            raise ChannelError(f"version {version} has no view {view!r} (has {sorted(manifest.views)})")
        if not isinstance(self.store, FilesystemStore):
            raise ChannelError(f"{self.store.uri} is not a filesystem store: a view can only be downloaded")
        delta = manifest.views[view].delta
        if delta is not None:
            raise ChannelError(
                f"v{version}/{view} is stored as a delta against v{delta.base}: it is rebuilt, "
                "not loaded in place"
            )
        prefix = f"{_version_key(version)}/{view}"
        directory = Path(self.store.uri_of(prefix))
        files = manifest.views[view].files
        for rel, entry in sorted(files.items()):
            try:
                digest = hash_file(directory / rel, entry.algorithm)
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
                raise KeyNotFoundError(f"{prefix}/{rel} not found in {self.store.uri}") from e
            if on_read is not None:
                on_read("anchor", digest.bytes)
            if digest != entry:
                raise ChecksumMismatchError(f"v{version}/{view}/{rel}: {digest} != manifest {entry}")
        # the engine loads the whole directory: a file the manifest does not vouch for must not be there
        present = (p.relative_to(directory).as_posix() for p in directory.rglob("*") if not p.is_dir())
        unlisted = sorted(rel for rel in present if rel not in files)
        if unlisted:
            raise ChecksumMismatchError(
                f"v{version}/{view} holds files its manifest does not list: {unlisted}"
            )
        return directory

    # -- subscribers
    def report(self, report: SubscriberReport) -> None:
        check_name("group", report.group)
        check_name("replica", report.replica)
        if not report.updated_at:
            report = SubscriberReport(**{**asdict(report), "updated_at": now_iso()})
        self.store.put(f"{SUBSCRIBERS_DIR}/{report.group}/{report.replica}.json", report.to_bytes())

    def subscribers(self) -> list[SubscriberReport]:
        """Every readable report, each with `stored_at` (the store's own time of its last write)."""
        reports = []
        for key, stored in self.store.modified_times(f"{SUBSCRIBERS_DIR}/").items():
            if not key.endswith(".json"):
                continue
            try:
                report = SubscriberReport.from_bytes(self.store.get(key, max_bytes=MAX_REPORT_BYTES))
            except KeyNotFoundError:
                continue  # removed meanwhile
            except (ObjectTooLargeError, *_RECORD_ERRORS):
                continue  # a malformed (or oversized) report pins nothing and shows nothing
            reports.append(replace(report, stored_at=stored.isoformat(timespec="milliseconds")))
        return reports

    def remove_subscriber(self, group: str, replica: str, *, if_updated_at: str | None = None) -> bool:
        """Delete a replica's report: THE one deletion path of reports (the operator calls it for gone
        pods, `subscribers_to_remove`). `if_updated_at`: delete only if the stored report still carries
        this `updated_at` (a report rewritten since it was judged is kept). True if a report was deleted
        (or, unguarded, may have been)."""
        key = f"{SUBSCRIBERS_DIR}/{check_name('group', group)}/{check_name('replica', replica)}.json"
        if if_updated_at is not None:
            try:
                current = SubscriberReport.from_bytes(self.store.get(key, max_bytes=MAX_REPORT_BYTES))
            except KeyNotFoundError:
                return False
            except (ObjectTooLargeError, *_RECORD_ERRORS):
                current = None  # malformed: it pins nothing; delete it as judged
            if current is not None and current.updated_at != if_updated_at:
                return False
        self.store.delete(key)
        return True

    def subscribed_views(self) -> set[str]:
        return {r.view for r in self.subscribers()}

    # -- retention
    def retain(
        self,
        keep: int = 3,
        *,
        stale_after_seconds: float | None = SUBSCRIBER_STALE_AFTER_SECONDS,
        now: datetime | None = None,
    ) -> list[int]:
        """Delete versions beyond the newest `keep` complete ones, never the pointer's version, a
        version above it (in flight), or one a subscriber reports in use (`in_use` or applied) in a
        report not older than `stale_after_seconds` (None: every report pins, however old), nor any
        version one of those is rebuilt from: per view, its delta base, that version's base, ... down to
        an anchor (docs/weights.md, "Deltas between versions"). Returns deleted versions.

        Why an aged-out report may stop pinning: a sidecar rewrites its report every
        SUBSCRIBER_HEARTBEAT_SECONDS, during downloads too, so a report that stopped is a replica that
        is gone or cannot reach the store. Engines serve weights they loaded into memory; the store copy
        matters to a download or in-place verification in progress and, for a sidecar loading in place,
        to the engine's next relaunch from it (docs/weights.md, "Loading in place")."""
        if keep < 1:
            raise ValueError("keep must be >= 1")
        now = now or datetime.now(UTC)
        pointer = self.latest()
        if pointer is None:
            return []
        keys = self.store.list("v")
        by_version: dict[int, list[str]] = {}
        for key in keys:
            if m := _VERSION_KEY.match(key):
                by_version.setdefault(int(m.group(1)), []).append(key)
        claims = {int(m.group(1)): k for k in self.store.list("claims/") if (m := _CLAIM_KEY.match(k))}
        complete = sorted(v for v, ks in by_version.items() if manifest_key(v) in ks and v <= pointer.version)
        protected = set(complete[-keep:]) | {pointer.version}
        protected |= self._pinned_by_subscribers(now, stale_after_seconds, pointer.version)
        manifested = {v for v, ks in by_version.items() if manifest_key(v) in ks}
        in_flight = {v for v in manifested if v > pointer.version}
        protected |= self._delta_bases(protected | in_flight, manifested)
        doomed = sorted(
            v for v in set(by_version) | set(claims) if v < pointer.version and v not in protected
        )
        clean_staging = getattr(self.store, "clean_staging", None)
        if clean_staging is not None:
            clean_staging()
        for v in doomed:
            # Manifest first: a half-deleted version is then "incomplete", never "complete but broken".
            ks = sorted(by_version.get(v, []), key=lambda k: k != manifest_key(v))
            self.store.delete_many(ks)
            if v in claims:
                self.store.delete(claims[v])
        return doomed

    def _delta_bases(self, versions: Collection[int], manifested: Collection[int]) -> set[int]:
        """Every version a view of `versions` is rebuilt from: per view, `delta.base` followed through the
        manifests down to an anchor; and the versions holding a LoRA version's base views (`lora_bases`). A base whose manifest is gone or damaged ends its chain (the versions
        after it cannot be rebuilt anyway: logged); any other store error propagates, so retention deletes
        nothing on a guess."""
        manifests: dict[int, Manifest | None] = {}

        def read(version: int) -> Manifest | None:
            if version not in manifests:
                manifests[version] = None
                if version in manifested:
                    try:
                        manifests[version] = self.manifest(version)
                    except (KeyNotFoundError, ChannelError) as e:
                        log.warning("retention: the manifest of v%d is unreadable (%s)", version, e)
            return manifests[version]

        bases: set[int] = set()
        walked: set[tuple[int, str]] = set()
        for top in sorted(versions):
            manifest = read(top)
            try:
                held = lora_bases(manifest) if manifest is not None else {}
            except ChannelError as e:
                log.warning("retention: %s", e)
                held = {}
            bases.update(v for v in held.values() if v != top)  # the base views a kept adapter applies to
            for view, vm in sorted(manifest.views.items()) if manifest is not None else ():
                version = top
                while vm.delta is not None and (vm.delta.base, view) not in walked:
                    base = vm.delta.base
                    walked.add((base, view))
                    bases.add(base)
                    below = read(base)
                    if below is None or view not in below.views:
                        log.warning(
                            "retention: view %s of v%d is a delta against v%d, which the channel no longer "
                            "holds: versions after it cannot be rebuilt",
                            view,
                            version,
                            base,
                        )
                        break
                    version, vm = base, below.views[view]
        return bases

    def _pinned_by_subscribers(
        self, now: datetime, stale_after_seconds: float | None, pointer: int
    ) -> set[int]:
        """The versions subscribers report in use or applied, in reports not older than
        `stale_after_seconds` (None: every report counts): per report, at most its
        MAX_PINNED_PER_REPORT newest versions at or below the `pointer` (a replica serves one version
        and obtains at most one more; a number above the pointer names nothing published)."""
        pinned: set[int] = set()
        for r in self.subscribers():
            if stale_after_seconds is not None and not report_is_fresh(r, now, stale_after_seconds):
                continue  # a dead replica's report pins nothing (docs/weights.md)
            listed = {*r.in_use, *(() if r.applied_version is None else (r.applied_version,))}
            pinned.update(sorted(v for v in listed if v <= pointer)[-MAX_PINNED_PER_REPORT:])
        return pinned


# ----------------------------------------------------------------------------------------------
# Status for the operator (pure: no torch, no kube)


@dataclass(frozen=True)
class ViewArtifactStatus:
    view: str
    version: int
    uri: str
    sha256: str
    bytes: int
    """Size of the complete view (what a sampler loads)."""
    time: str
    kind: str = "anchor"
    """"anchor" (every file stored whole) or "delta" (docs/weights.md, "Deltas between versions")."""
    stored_bytes: int | None = None
    """Bytes the channel holds for this view of this version: what a replica that follows every version
    reads (the payloads of a delta and the files stored whole; `bytes` for an anchor)."""
    base: int | None = None
    """The version a delta applies to (None: an anchor)."""


@dataclass(frozen=True)
class GroupVersionStatus:
    group: str
    view: str | None
    applied_version: int | None
    """Lowest version applied by the group's (fresh) replicas."""
    lag: int | None
    replicas: dict[str, int | None]
    sync_failures: int = 0
    """Failed weight syncs of the group's (fresh) replicas since each started (store, checksum, engine)."""
    last_error: str | None = None
    """The newest failure a replica still reports (cleared by its next applied version)."""


@dataclass(frozen=True)
class ChannelStatus:
    latest_version: int | None
    published_at: str | None
    artifacts: list[ViewArtifactStatus]
    groups: list[GroupVersionStatus]
    retained_versions: list[int]
    subscribers: list[SubscriberReport]
    lora_base: dict[str, int] = field(default_factory=dict)
    """A LoRA job's base views and the version holding each (the latest manifest's `lora_base`; {}: not
    LoRA): every version is the adapter, each base is stored once."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def stored_share(self) -> float | None:
        """Bytes stored for the latest version over the bytes of its complete views (1.0: every view an
        anchor; a delta version of bf16 at lr 1e-6 about 0.012). None: nothing published."""
        full = sum(a.bytes for a in self.artifacts)
        if not full:
            return None
        return sum(a.bytes if a.stored_bytes is None else a.stored_bytes for a in self.artifacts) / full


def report_age_seconds(report: SubscriberReport, now: datetime) -> float:
    """Seconds since the report was written: since the OLDER of its `updated_at` (its writer's claim)
    and `stored_at` (the store's own time of its last write, when known), never below 0. So a report
    dated in the future, or whose writer's clock is ahead, counts as written at the store's time, never
    fresher: only rewriting it keeps it fresh. An undated or unparseable report is infinitely old (the
    sidecar always dates its reports); a timestamp without a zone is UTC."""
    try:
        at = datetime.fromisoformat(report.updated_at)
    except (TypeError, ValueError):
        return math.inf
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    with contextlib.suppress(TypeError, ValueError):  # stored_at comes from the store: always parseable
        stored = datetime.fromisoformat(report.stored_at)
        at = min(at, stored if stored.tzinfo else stored.replace(tzinfo=UTC))
    return max(0.0, (now - at).total_seconds())


def report_is_fresh(report: SubscriberReport, now: datetime, stale_after_seconds: float) -> bool:
    """Pure: the report is at most `stale_after_seconds` old (it pins versions and counts in status)."""
    return report_age_seconds(report, now) <= stale_after_seconds


def subscribers_to_remove(
    reports: Iterable[SubscriberReport],
    live_replicas: Mapping[str, Collection[str]],
    now: datetime,
    *,
    stale_after_seconds: float = SUBSCRIBER_STALE_AFTER_SECONDS,
) -> list[SubscriberReport]:
    """Pure: the reports to delete from the store, by (group, replica): those whose replica is not a live
    pod of its group (`live_replicas[group]`: the pod names the operator's pod index holds for that
    SamplerGroup; a group missing from the mapping has none, e.g. one removed from its job) AND that
    are older than `stale_after_seconds`.

    Both conditions, because:
    - a fresh report of a replica the index does not hold may belong to a pod created an instant ago
      (its sidecar can write before the pod's watch event reaches the operator); a live sidecar
      rewrites its report every SUBSCRIBER_HEARTBEAT_SECONDS, so a report of a pod that is really gone
      stops being fresh after `stale_after_seconds` and goes at the first read after that;
    - an aged-out report of a live pod stays: its sidecar cannot write (it says why in its log) and
      will overwrite it when it can.
    So only reports that already pin nothing and count nowhere are removed: removal changes neither
    retention nor status, it keeps `subscribers/` to the replicas that exist."""
    return sorted(
        (
            r
            for r in reports
            if r.replica not in live_replicas.get(r.group, ())
            and not report_is_fresh(r, now, stale_after_seconds)
        ),
        key=lambda r: (r.group, r.replica),
    )


def group_versions(
    reports: Iterable[SubscriberReport],
    latest_version: int | None,
    *,
    stale_after_seconds: float | None = None,
    now: datetime | None = None,
) -> list[GroupVersionStatus]:
    """Pure: per-group applied version (min over fresh replicas) and lag from subscriber reports.
    With `stale_after_seconds`, a report older than that (`report_is_fresh`) counts nowhere: a group
    with only aged-out reports is not listed."""
    now = now or datetime.now(UTC)
    by_group: dict[str, list[SubscriberReport]] = {}
    for r in reports:
        if stale_after_seconds is not None and not report_is_fresh(r, now, stale_after_seconds):
            continue
        by_group.setdefault(r.group, []).append(r)
    groups = []
    for name, rs in sorted(by_group.items()):
        applied = [r.applied_version for r in rs]
        known = [v for v in applied if v is not None]
        lowest = None if len(known) != len(applied) or not known else min(known)
        views = {r.view for r in rs}
        lag = None if lowest is None or latest_version is None else max(0, latest_version - lowest)
        groups.append(
            GroupVersionStatus(
                group=name,
                view=views.pop() if len(views) == 1 else None,
                applied_version=lowest,
                lag=lag,
                replicas={r.replica: r.applied_version for r in sorted(rs, key=lambda r: r.replica)},
                sync_failures=sum(r.failures for r in rs),
                last_error=max(
                    ((r.updated_at, r.last_error) for r in rs if r.last_error), default=(None, None)
                )[1],
            )
        )
    return groups


def read_channel_status(
    store: Store, *, stale_after_seconds: float | None = None, now: datetime | None = None
) -> ChannelStatus:
    """Everything the operator shows for a WeightChannel (the operator passes
    `stale_after_seconds=SUBSCRIBER_STALE_AFTER_SECONDS`: groups count only fresh reports; `subscribers`
    lists every report): per view of the latest version its kind (anchor or delta), the bytes stored and
    the bytes of the complete view. Raises StoreError if the store is unreachable."""
    now = now or datetime.now(UTC)
    channel = WeightChannel(store, publisher_id="status-reader")
    pointer = channel.latest()
    reports = channel.subscribers()
    if pointer is None:
        return ChannelStatus(
            None,
            None,
            [],
            group_versions(reports, None, stale_after_seconds=stale_after_seconds, now=now),
            [],
            reports,
        )
    manifest = channel.manifest(pointer.version)
    artifacts = [
        ViewArtifactStatus(
            view=name,
            version=pointer.version,
            uri=store.uri_of(f"{_version_key(pointer.version)}/{name}"),
            sha256=vm.sha256,
            bytes=vm.bytes,
            time=manifest.published_at,
            kind="anchor" if vm.delta is None else "delta",
            stored_bytes=vm.stored_bytes,
            base=None if vm.delta is None else vm.delta.base,
        )
        for name, vm in sorted(manifest.views.items())
    ]
    return ChannelStatus(
        latest_version=pointer.version,
        published_at=pointer.published_at,
        artifacts=artifacts,
        groups=group_versions(reports, pointer.version, stale_after_seconds=stale_after_seconds, now=now),
        retained_versions=channel.versions(),
        subscribers=reports,
        lora_base=lora_bases(manifest),
    )
