"""Checkpoints: model, optimizer, step, weight version, data position, detector state, RNG.

Buffer policy (stated, and tested): rollouts that were generated or in flight but NOT yet trained
on when the checkpoint was taken are discarded on resume, and their prompts are not re-issued. The
checkpoint stores `data_position` = the index of the next prompt never dispatched; a resumed run
dispatches from there, so no consumed rollout is reused and no prompt is served twice. (Re-using
buffered rollouts would train on samples from weights older than the resumed trainer, for no gain
on a restart that already costs a fresh rollout pipeline.)

Files: `<dir>/ckpt-<step:08d>.pt` written to a temp name, fsynced, renamed; then `<dir>/latest`
(a text file naming the checkpoint) is replaced atomically. A crash mid-write leaves the previous
checkpoint as `latest`.

On a cluster checkpoints live next to the weight channel: `<channel path>/checkpoints/` on a
filesystem store, and the keys `checkpoints/ckpt-<step>.pt` + `checkpoints/latest` under the channel's
prefix on an S3 store (pass the channel's `Store` instead of a directory; the channel's own keys are
`v<N>/...`, `pointer.json`, ..., so retention never touches them).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from rlfleet.store import KeyNotFoundError, Store

LATEST = "latest"
STORE_PREFIX = "checkpoints/"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _WriteErrors:
    """A file's `write`, remembering the OSError it raised: torch.save's C++ writer turns a failed write
    (a full volume: ENOSPC) into its own RuntimeError ("enforce fail ... unexpected pos"), losing why."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.fh.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.fh.flush()


def _atomic_write_bytes(path: Path, write) -> None:
    """`write(fh)` into `<path>.tmp`, fsync, then rename onto `path`: a reader never sees partial bytes;
    on failure the temporary file is removed and a failed write's OSError is what is raised."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            writer = _WriteErrors(fh)
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


def _save_to_store(store: Store, state: dict[str, Any], keep: int) -> Path:
    name = f"ckpt-{int(state['step']):08d}.pt"
    with tempfile.TemporaryDirectory(prefix="rlfleet-ckpt-", dir=store.staging_dir()) as tmp:
        path = Path(tmp) / name
        _atomic_write_bytes(path, lambda fh: torch.save(state, fh))
        store.put_file(STORE_PREFIX + name, path, move=True)  # durable before `latest` names it
    store.put(STORE_PREFIX + LATEST, name.encode())
    old = sorted(k for k in store.list(STORE_PREFIX + "ckpt-") if k.endswith(".pt"))
    for key in old[:-keep] if keep > 0 else []:
        store.delete(key)
    return Path(name)


def _load_from_store(store: Store) -> dict[str, Any] | None:
    try:
        name = store.get(STORE_PREFIX + LATEST).decode().strip()
    except KeyNotFoundError:
        return None
    with tempfile.TemporaryDirectory(prefix="rlfleet-ckpt-", dir=store.staging_dir()) as tmp:
        path = Path(tmp) / name  # streamed to disk, not held in memory twice (optimizer state is large)
        try:
            store.get_file(STORE_PREFIX + name, path)
        except KeyNotFoundError as e:
            raise FileNotFoundError(f"checkpoint pointer names {name}, which is missing in {store.uri}") from e
        return torch.load(path, map_location="cpu", weights_only=False)


def save_checkpoint(directory: str | Path | Store, state: dict[str, Any], keep: int = 2) -> Path:
    """`state` must contain `step` (int); returns the checkpoint path (the key's name on a store).
    Keeps the newest `keep`."""
    if isinstance(directory, Store):
        return _save_to_store(directory, state, keep)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    step = int(state["step"])
    path = directory / f"ckpt-{step:08d}.pt"
    _atomic_write_bytes(path, lambda fh: torch.save(state, fh))
    _atomic_write_bytes(directory / LATEST, lambda fh: fh.write(path.name.encode()))
    old = sorted(directory.glob("ckpt-*.pt"))[:-keep] if keep > 0 else []
    for p in old:
        p.unlink(missing_ok=True)
    return path


def load_latest(directory: str | Path | Store) -> dict[str, Any] | None:
    """The state of the checkpoint `latest` names, or None if there is none."""
    if isinstance(directory, Store):
        return _load_from_store(directory)
    directory = Path(directory)
    pointer = directory / LATEST
    if not pointer.is_file():
        return None
    path = directory / pointer.read_text().strip()
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint pointer names {path.name}, which is missing")
    return torch.load(path, map_location="cpu", weights_only=False)
