"""File digests: the algorithms a manifest may name, streamed hashing of a file, and writing a file
while a second thread hashes it (docs/weights.md "Manifest", docs/benchmarks.md)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import blake3

from rlfleet.store.errors import StoreError

CHUNK_BYTES = 8 * 1024 * 1024
"""Streaming chunk: big enough that the hashers release the GIL and syscalls are amortised."""

FILE_DIGEST = "blake3"
"""The algorithm of file digests the project computes (weight-view files in the channel manifest,
checkpoints): BLAKE3, ~5x sha256 per core, so hashing while writing keeps up with a page-cache write
(docs/weights.md "Manifest", docs/benchmarks.md). sha256 only where a format prescribes it
(`SHA256SUMS` of model sources, the pointer's `manifest_sha256`)."""
DIGEST_ALGORITHMS = ("blake3", "sha256")
"""Algorithms `new_hasher` knows (and so a manifest entry may name)."""


@dataclass(frozen=True)
class FileDigest:
    """Digest (algorithm + hex) and size of bytes written or read."""

    algorithm: str
    """One of DIGEST_ALGORITHMS."""
    hexdigest: str
    bytes: int

    def __str__(self) -> str:
        return f"{self.algorithm}:{self.hexdigest[:12]}.. ({self.bytes} B)"


class _Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str) -> _Hasher:
    """A streaming hasher of `algorithm` (DIGEST_ALGORITHMS; ValueError otherwise). Both release the
    GIL while hashing a large buffer, so a second thread hashes while another writes."""
    if algorithm == "blake3":
        return blake3.blake3()  # one thread: the caller overlaps it with the write (or the copy)
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algorithm!r} (known: {', '.join(DIGEST_ALGORITHMS)})")


def hash_file(path: Path, algorithm: str = FILE_DIGEST) -> FileDigest:
    """Digest and size of a local file, streamed."""
    digest = new_hasher(algorithm)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return FileDigest(algorithm, digest.hexdigest(), size)


def write_file_hashed(
    path: Path, chunks: Iterable[bytes | memoryview], algorithm: str = FILE_DIGEST
) -> FileDigest:
    """Write `chunks` to a new file at `path` and return their digest and size, computed in the SAME
    pass: while chunk i is written, a second thread hashes it (the hashers and write(2) release the
    GIL), so the bytes are read from memory once for both and the cost is about max(write, hash).
    Not durable by itself: `Store.put_file(..., move=True, digest=...)` fsyncs and renames it."""
    digest = new_hasher(algorithm)
    size = 0
    with ThreadPoolExecutor(max_workers=1) as hasher, open(path, "wb", buffering=0) as f:
        pending: Future[object] | None = None
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            for start in range(0, len(view), CHUNK_BYTES):
                piece = view[start : start + CHUNK_BYTES]
                if pending is not None:
                    pending.result()  # hash order must follow byte order
                pending = hasher.submit(digest.update, piece)
                rest = piece
                while rest:
                    rest = rest[f.write(rest) :]
                size += len(piece)
        if pending is not None:
            pending.result()
    return FileDigest(algorithm, digest.hexdigest(), size)


def check_digest(path: Path, digest: FileDigest | None) -> FileDigest | None:
    """A writer's digest of `path`, refused when its size disagrees with the file (stale digest)."""
    if digest is not None and digest.bytes != os.stat(path).st_size:
        raise StoreError(f"{path} has {os.stat(path).st_size} bytes, its digest says {digest.bytes}")
    return digest
