"""Checkpoints: model, optimizer, step, weight version, data position, detector state, RNG.

Buffer policy (stated, and tested): rollouts that were generated or in flight but NOT yet trained
on when the checkpoint was taken are discarded on resume, and their prompts are not re-issued. The
checkpoint stores `data_position` = the index of the next prompt never dispatched; a resumed run
dispatches from there, so no consumed rollout is reused and no prompt is served twice. (Re-using
buffered rollouts would train on samples from weights older than the resumed trainer, for no gain
on a restart that already costs a fresh rollout pipeline.)

Files: `<dir>/ckpt-<step:08d>.pt` (`ckpt-<step:08d>-g<G>.pt` when the trainer holds the channel's writer
lease, generation G: `checkpoint_name`) written to a temp name, fsynced, renamed; then `<dir>/latest` is
compare-and-swapped: JSON naming the kept checkpoints, newest last, each with its digest and size, and the
lease generation that wrote it (`{"checkpoints": [{"name": ..., "digest": "blake3:<hex>", "bytes": N}, ...],
"lease_generation": G}`). A crash mid-write leaves the previous checkpoint as `latest`. A resume verifies
the newest checkpoint's bytes against its digest before unpickling them; a checkpoint that is missing,
truncated, bit-flipped, unreadable or a symbolic link is skipped with a warning for the previous one
(`keep` >= 2 keeps one), and only when none loads does the resume fail, naming why each was refused. A
`latest` of older runs (a bare name) loads unverified.

Names are names, never paths: an entry of `latest` must be exactly a name the trainer writes
(`parse_checkpoint_name`: no directory part, no `..`, no absolute path); anything else is a damaged entry,
refused with its reason like a bad digest, and nothing outside the resume's temporary directory (or a
checkpoint file the trainer named) is ever read, written or deleted on its account.

Fenced like publishes (docs/weights.md, "One writer per channel"): with a `WriterFence` (the channel's
writer lease), the lease is checked before the checkpoint is written and again before `latest` is swapped;
the file name carries the lease generation, so a fenced trainer (paused, partitioned) never replaces the
lease holder's file of the same step; `latest` is refused (LeaseLostError) once a newer generation wrote
it, never lists a lower step as newest for the same generation, and only checkpoints of this generation or
older that the stored `latest` does not list are deleted.

No pickle from the store runs code: a checkpoint is read with `torch.load(weights_only=True)`
(`load_checkpoint_file`), whose unpickler builds only tensors, storages, dtypes and plain containers
(dict, list, tuple, OrderedDict, str, numbers, bool, None) plus the globals in `SAFE_GLOBALS`. Anything
else (a pickle naming `os.system`, a class of some library) is refused like a damaged file, never
imported or called: the store is not trusted to hold only what the trainer wrote (an S3 channel whose
sampler pods share the trainer's credentials lets any of them write it; docs/weights.md, "Stores").

On a cluster checkpoints live next to the weight channel: `<channel path>/checkpoints/` on a
filesystem store, and the keys `checkpoints/ckpt-<step>.pt` + `checkpoints/latest` under the channel's
prefix on an S3 store (pass the channel's `Store` instead of a directory; the channel's own keys are
`v<N>/...`, `pointer.json`, ..., so retention never touches them).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlfleet.channel import LeaseLostError
from rlfleet.store import (
    FILE_DIGEST,
    FileDigest,
    FilesystemStore,
    KeyNotFoundError,
    Store,
    StoreError,
    hash_file,
    new_hasher,
)

log = logging.getLogger(__name__)

LATEST = "latest"
STORE_PREFIX = "checkpoints/"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A file's `write` that hashes the bytes as they pass (the checkpoint's digest without reading the
    file back: optimizer state is large) and remembers the OSError it raised: torch.save's C++ writer
    turns a failed write (a full volume: ENOSPC) into its own RuntimeError ("enforce fail ... unexpected
    pos"), losing why."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.error: OSError | None = None
        self.hasher = new_hasher(FILE_DIGEST)
        self.size = 0

    def write(self, data: Any) -> int:
        try:
            written = self.fh.write(data)
        except OSError as e:
            self.error = e
            raise
        view = memoryview(data).cast("B")[:written]
        self.hasher.update(view)
        self.size += len(view)
        return written

    def flush(self) -> None:
        self.fh.flush()

    def digest(self) -> FileDigest:
        return FileDigest(FILE_DIGEST, self.hasher.hexdigest(), self.size)


def _atomic_write_bytes(path: Path, write: Callable[[Any], object]) -> FileDigest:  # a file-like writer
    """`write(fh)` into `<path>.tmp`, fsync, then rename onto `path`: a reader never sees partial bytes;
    on failure the temporary file is removed and a failed write's OSError is what is raised. Returns the
    digest and size of the bytes written."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            writer = _HashingWriter(fh)
            try:
                write(writer)
                fh.flush()
            except RuntimeError as e:
                if writer.error is None:
                    raise
                raise writer.error from e
            os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return writer.digest()


class CheckpointError(RuntimeError):
    """No kept checkpoint could be loaded (each one's reason in the message)."""


SAFE_GLOBALS: list[Any] = []
"""Globals a checkpoint may name beyond what `torch.load(weights_only=True)` builds by itself (tensors,
storages, dtypes, OrderedDict and plain Python values). Empty, because everything the trainer saves is
made of those: the loop's state (step, data position, history, uids: plain values), the HF backend's
module and torch.optim state dicts, and megatron-core 0.19.2's `state_dict()` as
`MegatronBackend` gathers it (model, DistributedOptimizer state dict, `save_parameter_state`'s fp32
main params and Adam moments): their pickles name only collections.OrderedDict, torch's
`_rebuild_tensor_v2`, storage classes and dtypes (listed from the pickle opcodes of a bf16 TP=1 state;
the megatron CPU tier restores TP=2 and TP=2 x DP=2 states through `load_checkpoint_file`). A type
added here must be a plain data class whose construction runs no code of the file's choosing."""


def load_checkpoint_file(path: str | Path) -> Any:
    """Unpickle a checkpoint written by `torch.save` without running code from it: weights_only=True
    with `SAFE_GLOBALS` allowed. A pickle naming any other global (a crafted file calling os.system)
    raises CheckpointError naming it; nothing of it is imported or called."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # torch's weights-only unpickler refusing a global or an opcode
        raise CheckpointError(
            f"refused to unpickle (not plain tensors and values): {_unpickling_reason(e)}"
        ) from None


def _unpickling_reason(error: Exception) -> str:
    """The paragraph of torch's weights-only message that says what was refused (e.g. "Trying to load
    unsupported GLOBAL posix.system ..."), without its advice to load with weights_only=False."""
    paragraphs = [p.strip() for p in str(error).split("\n\n") if p.strip()]
    advice = ("Weights only load failed", "Check the documentation")
    return next((p for p in paragraphs if not p.startswith(advice)), str(error) or type(error).__name__)


_NAME = re.compile(r"ckpt-([0-9]{8,})(?:-g([1-9][0-9]*))?\.pt")


def checkpoint_name(step: int, generation: int = 0) -> str:
    """The name the trainer gives step `step`'s checkpoint: `ckpt-<step:08d>.pt`, and `-g<G>` before the
    suffix when written under the channel's writer lease generation G (a fenced trainer of an older
    generation then never replaces the file of the lease holder's same step)."""
    return f"ckpt-{step:08d}.pt" if generation == 0 else f"ckpt-{step:08d}-g{generation}.pt"


def parse_checkpoint_name(name: object) -> tuple[int, int]:
    """(step, lease generation) of a name exactly as `checkpoint_name` writes it; CheckpointError for
    anything else (an absolute path, `..`, a directory part, another spelling): `latest` comes from the
    store and is never used as a path."""
    found = _NAME.fullmatch(name) if isinstance(name, str) else None
    if found is None or checkpoint_name(int(found[1]), int(found[2] or 0)) != name:
        raise CheckpointError(
            f"{str(name)[:120]!r} is not a checkpoint name the trainer writes (ckpt-<step:08d>[-g<generation>].pt)"
        )
    return int(found[1]), int(found[2] or 0)


@dataclass(frozen=True)
class WriterFence:
    """The channel's writer lease as checkpoints see it (trainer/run.py builds it from the publisher):
    `check()` raises LeaseLostError once another writer holds the lease."""

    generation: int
    check: Callable[[], None]


@dataclass
class _Latest:
    """What `latest` says: the kept checkpoints, newest first, and the lease generation that wrote it (0:
    without a lease, or a `latest` of an older run)."""

    entries: list[Any] = field(default_factory=list)
    generation: int = 0

    def newest_step(self) -> int | None:
        for entry in self.entries:
            try:
                return parse_checkpoint_name(entry.get("name") if isinstance(entry, dict) else None)[0]
            except CheckpointError:
                continue
        return None

    def names(self) -> set[str]:
        return {str(e.get("name")) for e in self.entries if isinstance(e, dict)}


def _entry(name: str, digest: FileDigest) -> dict[str, Any]:
    return {"name": name, "digest": f"{digest.algorithm}:{digest.hexdigest}", "bytes": digest.bytes}


def _parse_latest(text: str) -> _Latest:
    """The kept checkpoints `latest` names, newest first (a bare name: a run before digests)."""
    text = text.strip()
    if not text.startswith("{"):
        return _Latest([{"name": text}] if text else [])
    try:
        raw = json.loads(text)
        generation = raw.get("lease_generation", 0)
        entries = raw.get("checkpoints") or []
        if not isinstance(entries, list) or not isinstance(generation, int) or isinstance(generation, bool):
            raise ValueError("checkpoints must be a list and lease_generation an integer")
        return _Latest(list(reversed(entries)), generation)
    except (json.JSONDecodeError, AttributeError, ValueError) as e:
        raise CheckpointError(
            f"the checkpoint list `{LATEST}` is not readable ({e}): {text[:200]!r}"
        ) from None


def _verified(path: Path, entry: dict[str, Any]) -> None:
    """Refuse bytes that differ from what the writer recorded (truncated, bit-flipped)."""
    if "digest" not in entry:
        return
    algorithm, _, expected = str(entry["digest"]).partition(":")
    found = hash_file(path, algorithm)
    if found.bytes != entry.get("bytes") or found.hexdigest != expected:
        raise CheckpointError(
            f"{found} != the recorded {str(entry['digest'])[:19]}.. ({entry.get('bytes')} B)"
        )


def _load_first_good(
    entries: list[Any], fetch: Callable[[str, Path], None], where: str, staging: Path | None = None
) -> dict[str, Any]:
    """The newest of `entries` whose name is one the trainer writes and whose bytes verify and unpickle
    (`fetch(name, path)` brings one to `path`, under `staging`: a store's staging directory, as large as
    its checkpoints)."""
    refused = []
    with tempfile.TemporaryDirectory(prefix="rlfleet-ckpt-", dir=staging) as tmp:
        for entry in entries:
            name = entry.get("name") if isinstance(entry, dict) else entry
            try:
                parse_checkpoint_name(name)  # before it joins any path: names are names
            except CheckpointError as e:
                refused.append(str(e))
                log.warning("checkpoint entry in %s not loaded (%s); trying the previous one", where, e)
                continue
            path = Path(tmp) / str(name)  # inside `tmp`: the name has no directory part
            try:
                fetch(str(name), path)
                _verified(path, entry)
                state = load_checkpoint_file(path)  # weights only: the digest proves no writer's intent
            except (CheckpointError, OSError, StoreError, RuntimeError, EOFError, ValueError) as e:
                refused.append(f"{name}: {e}")
                log.warning("checkpoint %s in %s not loaded (%s); trying the previous one", name, where, e)
                continue
            finally:
                path.unlink(missing_ok=True)  # streamed to disk, not held twice (optimizer state is large)
            if refused:
                log.warning("resuming from %s: the newer checkpoints were refused", name)
            return state
    raise CheckpointError(f"no checkpoint in {where} could be loaded: " + "; ".join(refused))


def _place(directory: Path | Store) -> tuple[Store, str]:
    """The store `latest` and the checkpoint files live in, and their keys' prefix: a directory is a
    filesystem store of its own (its compare-and-swap holds a lock file, `.latest.lock`)."""
    if isinstance(directory, Store):
        return directory, STORE_PREFIX
    return FilesystemStore(directory), ""


def _read_latest(store: Store, key: str) -> tuple[_Latest | None, str | None]:
    """`latest` (None: there is none) and its swap token (None: absent, or a plain object written before
    `latest` was swapped)."""
    value = store.read_pointer(key)
    if value is not None:
        return _parse_latest(value.data.decode(errors="replace")), value.token
    try:  # a lock-free S3 store keeps swapped keys in a log; older runs wrote `latest` as a plain object
        return _parse_latest(store.get(key).decode(errors="replace")), None
    except KeyNotFoundError:
        return None, None


def _swap_latest(
    store: Store, prefix: str, entry: dict[str, Any], step: int, keep: int, fence: WriterFence | None
) -> None:
    """Name `entry` (step `step`) as the newest checkpoint, keeping up to keep - 1 older ones with a
    digest whose step is lower (entries of the same or a higher step, from a run resumed from an older
    checkpoint, and names the trainer does not write, go). Refused when a newer lease generation wrote
    `latest` (LeaseLostError: this trainer is fenced) or when it would list a lower step as newest."""
    generation = 0 if fence is None else fence.generation
    key = prefix + LATEST
    for _ in range(100):
        stored, token = _read_latest(store, key)
        current = stored or _Latest()
        if current.generation > generation:
            raise LeaseLostError(
                f"{store.uri_of(key)} was written under writer lease generation {current.generation}; this "
                f"trainer holds generation {generation}: another trainer writes this channel now; this one stops"
            )
        newest = current.newest_step()
        if newest is not None and newest > step and current.generation == generation:
            raise CheckpointError(
                f"refusing to name step {step} the newest checkpoint in {store.uri_of(key)}: it names step {newest}"
            )
        older = [e for e in current.entries if _is_older(e, step)][: max(keep, 1) - 1]
        document = {"checkpoints": list(reversed([entry, *older])), "lease_generation": generation}
        if fence is not None:
            fence.check()  # again, right before `latest` moves (as a publish before its pointer)
        if store.compare_and_swap(key, token, json.dumps(document, indent=1).encode()):
            return
    raise CheckpointError(f"{store.uri_of(key)}: compare-and-swap kept failing")


def _is_older(entry: Any, step: int) -> bool:
    if not isinstance(entry, dict) or "digest" not in entry:
        return False
    try:
        return parse_checkpoint_name(entry.get("name"))[0] < step
    except CheckpointError:
        return False


def _delete_unlisted(store: Store, prefix: str, fence: WriterFence | None) -> None:
    """Delete the checkpoint files the stored `latest` no longer lists, of this lease generation or an
    older one (never a newer writer's, never a name the trainer does not write)."""
    generation = 0 if fence is None else fence.generation
    if fence is not None:
        fence.check()
    stored = _read_latest(store, prefix + LATEST)[0]  # as stored now: a newer writer's list too
    listed = set() if stored is None else stored.names()
    for key in store.list(prefix + "ckpt-"):
        name = key.removeprefix(prefix)
        try:
            written_by = parse_checkpoint_name(name)[1]
        except CheckpointError:
            continue  # not a checkpoint file (a temporary one, or somebody else's): not ours to delete
        if name not in listed and written_by <= generation:
            store.delete(key)


def save_checkpoint(
    directory: str | Path | Store, state: dict[str, Any], keep: int = 2, fence: WriterFence | None = None
) -> Path:
    """`state` must contain `step` (int); returns the checkpoint path (the key's name on a store).
    Keeps the newest `keep`. `fence`: the channel's writer lease (module docstring): checked before
    anything is written; LeaseLostError once another writer holds it."""
    step = int(state["step"])
    name = checkpoint_name(step, 0 if fence is None else fence.generation)
    if fence is not None:
        fence.check()  # a fenced trainer writes nothing
    if isinstance(directory, Store):
        with tempfile.TemporaryDirectory(prefix="rlfleet-ckpt-", dir=directory.staging_dir()) as tmp:
            staged = Path(tmp) / name
            digest = _atomic_write_bytes(staged, lambda fh: torch.save(state, fh))
            directory.put_file(
                STORE_PREFIX + name, staged, move=True, digest=digest
            )  # durable before `latest`
        path = Path(name)
    else:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / name
        digest = _atomic_write_bytes(path, lambda fh: torch.save(state, fh))
    store, prefix = _place(directory)
    _swap_latest(store, prefix, _entry(name, digest), step, keep, fence)
    _delete_unlisted(store, prefix, fence)
    return path


def load_latest(directory: str | Path | Store) -> dict[str, Any] | None:
    """The state of the newest kept checkpoint that verifies and loads (None if there is none)."""
    if isinstance(directory, Store):
        store = directory

        def fetch_key(name: str, path: Path) -> None:
            try:
                store.get_file(STORE_PREFIX + name, path)
            except KeyNotFoundError as e:
                raise FileNotFoundError(f"missing in {store.uri}") from e

        latest, _ = _read_latest(store, STORE_PREFIX + LATEST)
        if latest is None:
            return None
        return _load_first_good(latest.entries, fetch_key, store.uri, store.staging_dir())
    directory = Path(directory)
    if not (directory / LATEST).is_file():
        return None

    def fetch_file(name: str, path: Path) -> None:
        source = directory / name
        if source.is_symlink():  # the trainer writes files: a link could point anywhere
            raise CheckpointError("a symbolic link, not a checkpoint the trainer wrote")
        if not source.is_file():
            raise FileNotFoundError("missing")
        path.symlink_to(source.resolve())

    latest, _ = _read_latest(FilesystemStore(directory), LATEST)
    return None if latest is None else _load_first_good(latest.entries, fetch_file, str(directory))
