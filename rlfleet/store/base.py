"""The `Store` interface every channel operation is built on, its pointer value and the key rule."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rlfleet.store.digests import FILE_DIGEST, FileDigest


@dataclass(frozen=True)
class PointerValue:
    """Current content of a pointer object and the opaque token to swap it with."""

    data: bytes
    token: str
    age_seconds: float | None = None
    """Seconds since the store wrote it, by the STORE's clock where it tells its time (S3: the response's
    Date minus Last-Modified, whole seconds; a filesystem: this host's clock minus the file's ctime),
    never below 0; None: unknown. What the writer lease ages by (rlfleet/channel.py), not by the time its
    writer put into it."""


def check_key(key: str) -> str:
    """Keys are relative, '/'-separated, without empty, '.' or '..' parts or hidden components."""
    if not key or key.startswith("/") or key.endswith("/"):
        raise ValueError(f"invalid store key {key!r}")
    for part in key.split("/"):
        if part in ("", ".", "..") or part.startswith("."):
            raise ValueError(f"invalid store key {key!r}")
    return key


class Store(ABC):
    """A flat key -> bytes store with an exclusive create and a pointer compare-and-swap."""

    @property
    @abstractmethod
    def uri(self) -> str:
        """Where the store lives (a path or s3:// URI), for status and logs."""

    def uri_of(self, key: str) -> str:
        """URI of one key (or prefix)."""
        return f"{self.uri.rstrip('/')}/{key}"

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Write (or overwrite) `key` durably; readers see the old or the new bytes, never a mix."""

    @abstractmethod
    def put_file(
        self, key: str, path: Path, *, move: bool = False, digest: FileDigest | None = None
    ) -> FileDigest:
        """Upload a local file to `key` durably; return the digest and size of the bytes sent
        (`digest` when given, else computed with FILE_DIGEST).

        `move=True`: the caller gives the file up (a private staging file); a store on the same
        filesystem may rename it into place instead of copying its bytes.
        `digest`: the file's digest and size, already computed by whoever wrote it
        (`write_file_hashed`): the store does not read the bytes again to hash them."""

    def staging_dir(self) -> Path | None:
        """A local directory on the store's own filesystem for files later put with move=True
        (None: the store has none, stage anywhere)."""
        return None

    @abstractmethod
    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """Bytes of `key` (KeyNotFoundError if absent). `max_bytes`: read at most that many, and raise
        ObjectTooLargeError for a bigger object instead (records others write: manifests, reports)."""

    @abstractmethod
    def get_file(self, key: str, path: Path, *, algorithm: str = FILE_DIGEST) -> FileDigest:
        """Download `key` into local `path` (written atomically); return the digest (`algorithm`)
        and size of the local copy."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys starting with `prefix` (string prefix, as S3)."""

    @abstractmethod
    def modified_times(self, prefix: str = "") -> dict[str, datetime]:
        """Keys starting with `prefix` (as `list`) -> when the store last wrote each, by the STORE's own
        clock (UTC): S3's Last-Modified, a filesystem's ctime (which no writer can set, unlike mtime).
        What readers age records by where the record's own timestamp is its writer's claim (subscriber
        reports: docs/weights.md, "Subscriber reports")."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete `key` (no error if absent)."""

    def delete_many(self, keys: Sequence[str]) -> None:
        """Delete several keys."""
        for key in keys:
            self.delete(key)

    @abstractmethod
    def create(self, key: str, data: bytes) -> bool:
        """Write `key` only if it does not exist. True if this call created it."""

    @abstractmethod
    def read_pointer(self, key: str) -> PointerValue | None:
        """Current pointer content and swap token (None: the pointer does not exist)."""

    @abstractmethod
    def compare_and_swap(self, key: str, expected_token: str | None, data: bytes) -> bool:
        """Atomically replace the pointer if it still has `expected_token` (None: create it).

        Returns False when another writer got there first; the caller re-reads and decides."""

    def close(self) -> None:  # noqa: B027 (optional hook, not abstract)
        """Release clients (default: nothing)."""
