"""Checkpoints: model, optimizer, step, weight version, data position, detector state, RNG.

Buffer policy (stated, and tested): rollouts that were generated or in flight but NOT yet trained
on when the checkpoint was taken are discarded on resume, and their prompts are not re-issued. The
checkpoint stores `data_position` = the index of the next prompt never dispatched; a resumed run
dispatches from there, so no consumed rollout is reused and no prompt is served twice. (Re-using
buffered rollouts would train on samples from weights older than the resumed trainer, for no gain
on a restart that already costs a fresh rollout pipeline.)

Files: `<dir>/ckpt-<step:08d>.pt` written to a temp name, fsynced, renamed; then `<dir>/latest`
is replaced atomically: JSON naming the kept checkpoints, newest last, each with its digest and size
(`{"checkpoints": [{"name": ..., "digest": "blake3:<hex>", "bytes": N}, ...]}`). A crash mid-write
leaves the previous checkpoint as `latest`. A resume verifies the newest checkpoint's bytes against
its digest before unpickling them; a checkpoint that is missing, truncated, bit-flipped or unreadable
is skipped with a warning for the previous one (`keep` >= 2 keeps one), and only when none loads does
the resume fail, naming why each was refused. A `latest` of older runs (a bare name) loads unverified.

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
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlfleet.store import FILE_DIGEST, FileDigest, KeyNotFoundError, Store, StoreError, hash_file, new_hasher

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
        raise CheckpointError(f"refused to unpickle (not plain tensors and values): {_unpickling_reason(e)}") from None


def _unpickling_reason(error: Exception) -> str:
    """The paragraph of torch's weights-only message that says what was refused (e.g. "Trying to load
    unsupported GLOBAL posix.system ..."), without its advice to load with weights_only=False."""
    paragraphs = [p.strip() for p in str(error).split("\n\n") if p.strip()]
    advice = ("Weights only load failed", "Check the documentation")
    return next((p for p in paragraphs if not p.startswith(advice)), str(error) or type(error).__name__)


def _entry(name: str, digest: FileDigest) -> dict[str, Any]:
    return {"name": name, "digest": f"{digest.algorithm}:{digest.hexdigest}", "bytes": digest.bytes}


def _latest_bytes(entries: list[dict[str, Any]]) -> bytes:
    return json.dumps({"checkpoints": entries}, indent=1).encode()


def _parse_latest(text: str) -> list[dict[str, Any]]:
    """The kept checkpoints `latest` names, newest first (a bare name: a run before digests)."""
    text = text.strip()
    if not text.startswith("{"):
        return [{"name": text}] if text else []
    try:
        return list(reversed(json.loads(text).get("checkpoints") or []))
    except (json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"the checkpoint list `{LATEST}` is not readable ({e}): {text[:200]!r}") from None


def _verified(path: Path, entry: dict[str, Any]) -> None:
    """Refuse bytes that differ from what the writer recorded (truncated, bit-flipped)."""
    if "digest" not in entry:
        return
    algorithm, _, expected = str(entry["digest"]).partition(":")
    found = hash_file(path, algorithm)
    if found.bytes != entry.get("bytes") or found.hexdigest != expected:
        raise CheckpointError(f"{found} != the recorded {entry['digest'][:19]}.. ({entry.get('bytes')} B)")


def _load_first_good(
    entries: list[dict[str, Any]], fetch: Callable[[str, Path], None], where: str, staging: Path | None = None
) -> dict[str, Any]:
    """The newest of `entries` whose bytes verify and unpickle (`fetch(name, path)` brings one to `path`,
    under `staging`: a store's staging directory, as large as its checkpoints)."""
    refused = []
    with tempfile.TemporaryDirectory(prefix="rlfleet-ckpt-", dir=staging) as tmp:
        for entry in entries:
            path = Path(tmp) / str(entry["name"])
            try:
                fetch(str(entry["name"]), path)
                _verified(path, entry)
                state = load_checkpoint_file(path)  # weights only: the digest proves no writer's intent
            except (CheckpointError, OSError, StoreError, RuntimeError, EOFError, ValueError) as e:
                refused.append(f"{entry['name']}: {e}")
                log.warning("checkpoint %s in %s not loaded (%s); trying the previous one", entry["name"], where, e)
                continue
            finally:
                path.unlink(missing_ok=True)  # streamed to disk, not held twice (optimizer state is large)
            if refused:
                log.warning("resuming from %s: the newer checkpoints were refused", entry["name"])
            return state
    raise CheckpointError(f"no checkpoint in {where} could be loaded: " + "; ".join(refused))


def _save_to_store(store: Store, state: dict[str, Any], keep: int) -> Path:
    name = f"ckpt-{int(state['step']):08d}.pt"
    with tempfile.TemporaryDirectory(prefix="rlfleet-ckpt-", dir=store.staging_dir()) as tmp:
        path = Path(tmp) / name
        digest = _atomic_write_bytes(path, lambda fh: torch.save(state, fh))
        store.put_file(STORE_PREFIX + name, path, move=True, digest=digest)  # durable before `latest` names it
    try:
        previous: str | None = store.get(STORE_PREFIX + LATEST).decode()
    except KeyNotFoundError:
        previous = None
    latest, kept = _next_latest(previous, name, digest, keep)
    store.put(STORE_PREFIX + LATEST, latest)
    for key in store.list(STORE_PREFIX + "ckpt-"):
        if key.endswith(".pt") and key.removeprefix(STORE_PREFIX) not in kept:
            store.delete(key)
    return Path(name)


def _next_latest(previous: str | None, name: str, digest: FileDigest, keep: int) -> tuple[bytes, set[str]]:
    """`latest` after saving checkpoint `name` (its bytes), and the names it keeps: the new one and up to
    keep - 1 older ones that have a digest (the rest, and a bare-name `latest`'s one, are deleted)."""
    older = [e for e in _parse_latest(previous or "") if e.get("name") != name and "digest" in e]
    kept = [_entry(name, digest), *older[: max(keep, 1) - 1]]
    return _latest_bytes(list(reversed(kept))), {e["name"] for e in kept}


def _load_from_store(store: Store) -> dict[str, Any] | None:
    try:
        entries = _parse_latest(store.get(STORE_PREFIX + LATEST).decode())
    except KeyNotFoundError:
        return None

    def fetch(name: str, path: Path) -> None:
        try:
            store.get_file(STORE_PREFIX + name, path)
        except KeyNotFoundError as e:
            raise FileNotFoundError(f"missing in {store.uri}") from e

    return _load_first_good(entries, fetch, store.uri, store.staging_dir())


def save_checkpoint(directory: str | Path | Store, state: dict[str, Any], keep: int = 2) -> Path:
    """`state` must contain `step` (int); returns the checkpoint path (the key's name on a store).
    Keeps the newest `keep`."""
    if isinstance(directory, Store):
        return _save_to_store(directory, state, keep)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    step = int(state["step"])
    path = directory / f"ckpt-{step:08d}.pt"
    digest = _atomic_write_bytes(path, lambda fh: torch.save(state, fh))
    pointer = directory / LATEST
    latest, kept = _next_latest(pointer.read_text() if pointer.is_file() else None, path.name, digest, keep)
    _atomic_write_bytes(pointer, lambda fh: fh.write(latest))
    for p in directory.glob("ckpt-*.pt"):
        if p.name not in kept:
            p.unlink(missing_ok=True)
    return path


def load_latest(directory: str | Path | Store) -> dict[str, Any] | None:
    """The state of the newest kept checkpoint that verifies and loads (None if there is none)."""
    if isinstance(directory, Store):
        return _load_from_store(directory)
    directory = Path(directory)
    pointer = directory / LATEST
    if not pointer.is_file():
        return None

    def fetch(name: str, path: Path) -> None:
        source = directory / name
        if not source.is_file():
            raise FileNotFoundError("missing")
        path.symlink_to(source.resolve())

    return _load_first_good(_parse_latest(pointer.read_text()), fetch, str(directory))
