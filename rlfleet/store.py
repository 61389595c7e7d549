"""Object stores for the weight channel: a small interface and two real implementations.

`Store` is deliberately small: put / get / list / delete, an exclusive `create` (put-if-absent) and
an atomic compare-and-swap on a pointer object. Everything the channel guarantees (bytes durable
before the pointer moves, monotonic versions, no mixed version) is built on these primitives in
`rlfleet.channel`.

- `FilesystemStore`: a directory on a shared volume (ReadWriteMany PVC, NFS, local disk in tests).
  Every write is temp file + fsync + rename + fsync of the directory, so a reader never sees a
  partial object and an acknowledged write survives a crash. `create` is `link(2)` of a fsynced temp
  file (atomic, fails if the name exists); compare-and-swap holds an `flock(2)` on a sidecar lock
  file (released by the kernel if the holder is SIGKILLed; NFSv4 maps it to POSIX byte-range locks).
- `S3Store`: any S3-compatible bucket via boto3. Credentials come from boto3's default chain (the
  pod gets `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` from the Secret named by the WeightChannel's
  `secretRef`; nothing is copied into the spec). The pointer uses S3 conditional writes
  (`If-None-Match: *` to create, `If-Match: <etag>` to swap) when the server honours them (probed
  once, or forced with `conditional_writes=True/False`). Without them a lock-free scheme is used,
  see `S3Store` and docs/weights.md.

No torch here: the operator reads channel status through this module.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlparse

import blake3

CHUNK_BYTES = 8 * 1024 * 1024
"""Streaming chunk: big enough that the hashers release the GIL and syscalls are amortised."""

FILE_DIGEST = "blake3"
"""The algorithm of file digests the project computes (weight-view files in the channel manifest,
checkpoints): BLAKE3, ~5x sha256 per core, so hashing while writing keeps up with a page-cache write
(docs/weights.md "Manifest", docs/benchmarks.md). sha256 only where a format prescribes it
(`SHA256SUMS` of model sources, the pointer's `manifest_sha256`)."""
DIGEST_ALGORITHMS = ("blake3", "sha256")
"""Algorithms `new_hasher` knows (and so a manifest entry may name)."""


class StoreError(Exception):
    """Base class of store errors."""


class KeyNotFoundError(StoreError, KeyError):
    """The key does not exist."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else "key not found"


class StoreUnavailableError(StoreError):
    """The store could not be reached (network, endpoint down, volume missing). Retry later."""


@dataclass(frozen=True)
class FileDigest:
    """Digest (algorithm + hex) and size of bytes written or read."""

    algorithm: str
    """One of DIGEST_ALGORITHMS."""
    hexdigest: str
    bytes: int

    def __str__(self) -> str:
        return f"{self.algorithm}:{self.hexdigest[:12]}.. ({self.bytes} B)"


@dataclass(frozen=True)
class PointerValue:
    """Current content of a pointer object and the opaque token to swap it with."""

    data: bytes
    token: str


def check_key(key: str) -> str:
    """Keys are relative, '/'-separated, without empty, '.' or '..' parts or hidden components."""
    if not key or key.startswith("/") or key.endswith("/"):
        raise ValueError(f"invalid store key {key!r}")
    for part in key.split("/"):
        if part in ("", ".", "..") or part.startswith("."):
            raise ValueError(f"invalid store key {key!r}")
    return key


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
        pending: Future[None] | None = None
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
    def get(self, key: str) -> bytes:
        """Bytes of `key` (KeyNotFoundError if absent)."""

    @abstractmethod
    def get_file(self, key: str, path: Path, *, algorithm: str = FILE_DIGEST) -> FileDigest:
        """Download `key` into local `path` (written atomically); return the digest (`algorithm`)
        and size of the local copy."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys starting with `prefix` (string prefix, as S3)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete `key` (no error if absent)."""

    def delete_many(self, keys: list[str]) -> None:
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


# ----------------------------------------------------------------------------------------------
# Filesystem


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FilesystemStore(Store):
    """A directory on a (shared) filesystem. See the module docstring for the durability scheme."""

    def __init__(self, root: str | Path, *, create: bool = False, fsync: bool = True) -> None:
        self.root = Path(root).absolute()
        # fsync=False only for throwaway stores (never for a channel others read).
        self.fsync = fsync
        if create:
            # Publishers may create the channel directory; readers must not (a missing directory
            # means the volume is not mounted, which must surface as "store unavailable").
            self.root.mkdir(parents=True, exist_ok=True)

    @property
    def uri(self) -> str:
        return str(self.root)

    def uri_of(self, key: str) -> str:
        return str(self.root / key)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _require_root(self) -> None:
        if not self.root.is_dir():
            raise StoreUnavailableError(f"store directory {self.root} does not exist (volume not mounted?)")

    def _mkdirs(self, directory: Path) -> None:
        """Create missing parents and fsync each new directory's parent (so the entry is durable)."""
        missing: list[Path] = []
        d = directory
        while not d.exists():
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            with contextlib.suppress(FileExistsError):
                d.mkdir()
            if self.fsync:
                _fsync_dir(d.parent)

    def _in_dir(self, directory: Path, action: Callable[[], Any]) -> Any:
        """Run `action` (which creates an entry in `directory`) after making sure the directory
        exists, again if a concurrent `delete` pruned it as empty in between."""
        for attempt in range(5):
            self._mkdirs(directory)
            try:
                return action()
            except FileNotFoundError:
                if attempt == 4 or directory.is_dir():
                    raise  # something else is missing (e.g. the source file)
        raise AssertionError("unreachable")

    def _temp_for(self, path: Path) -> Path:
        return path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"

    def _write_temp(self, path: Path, data: bytes) -> Path:
        self._require_root()
        tmp = self._temp_for(path)
        try:
            with self._in_dir(path.parent, lambda: open(tmp, "wb", buffering=0)) as f:
                view = memoryview(data)
                while view:
                    view = view[f.write(view) :]
                if self.fsync:
                    os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return tmp

    def _commit(self, tmp: Path, path: Path) -> None:
        os.replace(tmp, path)
        if self.fsync:
            _fsync_dir(path.parent)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        self._commit(tmp, path)

    STAGING = ".staging"

    def staging_dir(self) -> Path | None:
        """`<root>/.staging`: hidden from `list`, on the same filesystem, so put_file(move=True) of a
        file staged there is a rename (the bytes are written once, by the publisher)."""
        self._require_root()
        path = self.root / self.STAGING
        path.mkdir(exist_ok=True)
        return path

    def clean_staging(self, older_than_seconds: float = 3600.0) -> None:
        """Remove staging leftovers of killed publishers."""
        path = self.root / self.STAGING
        if not path.is_dir():
            return
        now = time.time()
        for entry in path.iterdir():
            with contextlib.suppress(OSError):
                if now - entry.stat().st_mtime > older_than_seconds:
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()

    def _fsync_file(self, path: Path) -> None:
        if self.fsync:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def put_file(
        self, key: str, path: Path, *, move: bool = False, digest: FileDigest | None = None
    ) -> FileDigest:
        """Copy: kernel copy (copy_file_range / sendfile: no user-space pass over the bytes) while
        another thread hashes the source, so it costs about max(copy, hash), not their sum.
        Move (same filesystem): fsync + hash, then rename into place: the bytes are never copied.
        The digest is of the local source; the sidecar re-hashes what it downloads, so a byte the
        store got wrong is still refused before use."""
        target = self._path(key)
        self._require_root()
        self._mkdirs(target.parent)
        known = check_digest(path, digest)
        if move and os.stat(path).st_dev == os.stat(self.root).st_dev:
            if known is None:
                digest = self._hash_while(Path(path), lambda: self._fsync_file(Path(path)))
            else:
                self._fsync_file(Path(path))
            self._in_dir(target.parent, lambda: os.rename(path, target))
            if self.fsync:
                _fsync_dir(target.parent)
            assert digest is not None
            return digest
        tmp = self._temp_for(target)

        def copy() -> None:
            self._in_dir(target.parent, lambda: shutil.copyfile(path, tmp))
            self._fsync_file(tmp)

        try:
            if known is None:
                digest = self._hash_while(Path(path), copy)
            else:
                copy()
            assert digest is not None
            if digest.bytes != tmp.stat().st_size:
                raise StoreError(f"{path} changed while it was uploaded")
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        self._commit(tmp, target)
        return digest

    @staticmethod
    def _hash_while(path: Path, work: Callable[[], None]) -> FileDigest:
        """FILE_DIGEST of `path` computed in a second thread while `work()` runs (both release the GIL)."""
        digest_box: list[FileDigest | BaseException] = []

        def hash_source() -> None:
            try:
                digest_box.append(hash_file(Path(path)))
            except BaseException as e:  # re-raised in the caller
                digest_box.append(e)

        hasher = threading.Thread(target=hash_source, daemon=True)
        hasher.start()
        try:
            work()
        finally:
            hasher.join()
        if isinstance(digest_box[0], BaseException):
            raise digest_box[0]
        return digest_box[0]

    def get(self, key: str) -> bytes:
        self._require_root()
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise KeyNotFoundError(f"{key} not found in {self.uri}") from e

    def get_file(self, key: str, path: Path, *, algorithm: str = FILE_DIGEST) -> FileDigest:
        self._require_root()
        source = self._path(key)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
        try:
            try:
                shutil.copyfile(source, tmp)  # in-kernel copy
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
                raise KeyNotFoundError(f"{key} not found in {self.uri}") from e
            # Hash the LOCAL copy (what the engine will load), not the store's file.
            digest = hash_file(tmp, algorithm)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        return digest

    def list(self, prefix: str = "") -> list[str]:
        self._require_root()
        # Walk only the deepest directory the prefix names.
        base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self.root / base_rel if base_rel else self.root
        if not base.is_dir():
            return []
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if name.startswith("."):
                    continue  # temp and lock files
                key = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        # Remove now-empty parent directories (best effort; a concurrent writer may refill them).
        parent = path.parent
        while parent != self.root and parent.is_relative_to(self.root):
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def create(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        if path.exists():
            return False
        tmp = self._write_temp(path, data)
        try:
            os.link(tmp, path)  # atomic and exclusive: EEXIST if someone else created it
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        if self.fsync:
            _fsync_dir(path.parent)
        return True

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        self._require_root()
        self._mkdirs(path.parent)
        lock = path.parent / f".{path.name}.lock"
        fd = self._in_dir(path.parent, lambda: os.open(lock, os.O_RDWR | os.O_CREAT, 0o644))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    @staticmethod
    def _token(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    def read_pointer(self, key: str) -> PointerValue | None:
        try:
            data = self.get(key)
        except KeyNotFoundError:
            return None
        return PointerValue(data, self._token(data))

    def compare_and_swap(self, key: str, expected_token: str | None, data: bytes) -> bool:
        path = self._path(key)
        with self._locked(path):
            try:
                current: str | None = self._token(path.read_bytes())
            except FileNotFoundError:
                current = None
            if current != expected_token:
                return False
            tmp = self._write_temp(path, data)
            self._commit(tmp, path)
            return True


# ----------------------------------------------------------------------------------------------
# S3


class S3Store(Store):
    """An S3-compatible bucket (boto3), optionally under a key prefix.

    Pointer with conditional writes (AWS S3 since 2024, and most S3-compatible servers): the pointer
    is one object; create = `PutObject If-None-Match: *`, swap = `PutObject If-Match: <etag>`.

    Lock-free fallback (servers that ignore conditional headers): S3 has strong read-after-write
    and list-after-write consistency, so an exclusive create is a claim protocol: write
    `_claims/<key>/<uuid>`, list `_claims/<key>/`, win only if no other fresh claim is listed (two
    racers both see each other and both back off: safe, the caller retries), then write the key. A
    claim older than `claim_ttl_seconds` is ignored (its writer crashed between claim and write).
    The pointer is then an append-only log `_log/<key>/<seq:020d>` whose entries are created with
    that protocol; the current value is the highest entry and the swap token is its seq, so a swap
    is "create entry seq+1". Readers never see a lower value than one they saw before.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        conditional_writes: bool | None = None,
        client: Any = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        max_attempts: int = 3,
        claim_ttl_seconds: float = 600.0,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = (
            endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        )
        self.claim_ttl_seconds = claim_ttl_seconds
        if client is None:
            import boto3
            from botocore.config import Config

            config = Config(
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                retries={"max_attempts": max_attempts, "mode": "standard"},
                s3={"addressing_style": "path"},
            )
            client = boto3.session.Session().client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name=region
                or os.environ.get("AWS_REGION")
                or os.environ.get("AWS_DEFAULT_REGION")
                or "us-east-1",
                config=config,
            )
        self.client = client
        self._conditional = conditional_writes

    # -- helpers
    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def _k(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    @contextlib.contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in ("NoSuchKey", "404", "NotFound"):
                raise KeyNotFoundError(f"{key} not found in {self.uri}") from e
            if code in ("NoSuchBucket",):
                raise StoreUnavailableError(f"bucket {self.bucket} does not exist") from e
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if status >= 500:
                raise StoreUnavailableError(f"{self.uri}: {code} ({status})") from e
            raise StoreError(f"{self.uri}: {key}: {code}: {e}") from e
        except BotoCoreError as e:  # connection refused, timeouts, DNS, ...
            raise StoreUnavailableError(f"{self.uri} unreachable: {e}") from e

    @staticmethod
    def _precondition_failed(e: Exception) -> bool:
        response = getattr(e, "response", None) or {}
        code = str(response.get("Error", {}).get("Code", ""))
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        # 412 PreconditionFailed; 409 ConditionalRequestConflict (concurrent conditional write).
        return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)

    # -- basic operations
    def put(self, key: str, data: bytes) -> None:
        with self._errors(key):
            self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data)

    def put_file(
        self, key: str, path: Path, *, move: bool = False, digest: FileDigest | None = None
    ) -> FileDigest:
        from boto3.s3.transfer import TransferConfig

        digest = check_digest(path, digest) or hash_file(Path(path))
        with self._errors(key):
            self.client.upload_file(
                str(path),
                self.bucket,
                self._k(key),
                Config=TransferConfig(
                    multipart_threshold=64 * 1024 * 1024, multipart_chunksize=64 * 1024 * 1024
                ),
            )
        return digest

    def get(self, key: str) -> bytes:
        with self._errors(key):
            return self.client.get_object(Bucket=self.bucket, Key=self._k(key))["Body"].read()

    def get_file(self, key: str, path: Path, *, algorithm: str = FILE_DIGEST) -> FileDigest:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
        digest = new_hasher(algorithm)
        size = 0
        try:
            with self._errors(key):
                body = self.client.get_object(Bucket=self.bucket, Key=self._k(key))["Body"]
                with open(tmp, "wb") as f:
                    for chunk in body.iter_chunks(CHUNK_BYTES):
                        digest.update(chunk)
                        f.write(chunk)
                        size += len(chunk)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        return FileDigest(algorithm, digest.hexdigest(), size)

    def _list_full(self, prefix: str) -> list[dict[str, Any]]:
        full_prefix = (
            (f"{self.prefix}/{prefix}" if self.prefix else prefix)
            if prefix
            else (f"{self.prefix}/" if self.prefix else "")
        )
        items: list[dict[str, Any]] = []
        with self._errors(prefix or "/"):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full_prefix
            ):
                items.extend(page.get("Contents", []))
        return items

    def list(self, prefix: str = "") -> list[str]:
        keys = [self._rel(item["Key"]) for item in self._list_full(prefix)]
        return sorted(k for k in keys if not k.startswith(("_claims/", "_log/", "_probe/")))

    def delete(self, key: str) -> None:
        with self._errors(key):
            self.client.delete_object(Bucket=self.bucket, Key=self._k(key))

    def delete_many(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self._k(k)} for k in keys[start : start + 1000]]
            if batch:
                with self._errors(keys[start]):
                    self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    # -- conditional writes
    @property
    def conditional_writes(self) -> bool:
        """Whether the server honours If-None-Match / If-Match on PutObject (probed once)."""
        if self._conditional is None:
            self._conditional = self._probe_conditional_writes()
        return self._conditional

    def _probe_conditional_writes(self) -> bool:
        from botocore.exceptions import ClientError

        probe = self._k(f"_probe/{uuid.uuid4().hex}")
        try:
            with self._errors(probe):
                self.client.put_object(Bucket=self.bucket, Key=probe, Body=b"1", IfNoneMatch="*")
                try:
                    self.client.put_object(Bucket=self.bucket, Key=probe, Body=b"2", IfNoneMatch="*")
                    return False  # the header was ignored
                except ClientError as e:
                    if not self._precondition_failed(e):
                        raise
                try:
                    self.client.put_object(Bucket=self.bucket, Key=probe, Body=b"3", IfMatch='"0000"')
                    return False
                except ClientError as e:
                    return self._precondition_failed(e)
        finally:
            with contextlib.suppress(Exception):
                self.client.delete_object(Bucket=self.bucket, Key=probe)

    def create(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        if not self.conditional_writes:
            return self._create_lock_free(key, data)
        try:
            with self._errors(key):
                try:
                    self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data, IfNoneMatch="*")
                except ClientError as e:
                    if self._precondition_failed(e):
                        return False
                    raise
        except KeyNotFoundError:
            return False
        return True

    def _exists(self, key: str) -> bool:
        try:
            with self._errors(key):
                self.client.head_object(Bucket=self.bucket, Key=self._k(key))
            return True
        except KeyNotFoundError:
            return False

    def _create_lock_free(self, key: str, data: bytes) -> bool:
        if self._exists(key):
            return False
        claim_prefix = f"_claims/{key}/"
        mine = f"{claim_prefix}{uuid.uuid4().hex}"
        with self._errors(mine):
            self.client.put_object(Bucket=self.bucket, Key=self._k(mine), Body=b"")
        try:
            now = time.time()
            others = [
                item
                for item in self._list_full(claim_prefix)
                if self._rel(item["Key"]) != mine
                and now - item["LastModified"].timestamp() < self.claim_ttl_seconds
            ]
            if others or self._exists(key):
                return False  # contention (or lost): back off, the caller retries
            self.put(key, data)
            return True
        finally:
            # A later claimant checks the key after listing, so the claim is not needed once the
            # key exists (and a loser's claim must go so it does not block the next round).
            with contextlib.suppress(StoreError):
                self.delete(mine)

    def read_pointer(self, key: str) -> PointerValue | None:
        if not self.conditional_writes:
            entries = [item["Key"] for item in self._list_full(f"_log/{key}/")]
            if not entries:
                return None
            latest = max(entries)
            seq = latest.rsplit("/", 1)[1]
            try:
                with self._errors(key):
                    data = self.client.get_object(Bucket=self.bucket, Key=latest)["Body"].read()
            except KeyNotFoundError:
                return None  # pruned between list and get: caller re-reads
            return PointerValue(data, seq)
        try:
            with self._errors(key):
                response = self.client.get_object(Bucket=self.bucket, Key=self._k(key))
                return PointerValue(response["Body"].read(), response["ETag"])
        except KeyNotFoundError:
            return None

    def compare_and_swap(self, key: str, expected_token: str | None, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        if not self.conditional_writes:
            current = self.read_pointer(key)
            if (current.token if current else None) != expected_token:
                return False
            seq = 0 if expected_token is None else int(expected_token) + 1
            if not self._create_lock_free(f"_log/{key}/{seq:020d}", data):
                return False
            # Prune old log entries (keep a few so a reader between list and get still finds one).
            old = [self._rel(item["Key"]) for item in self._list_full(f"_log/{key}/")]
            stale = sorted(old)[:-4]
            if stale:
                with contextlib.suppress(StoreError):
                    self.delete_many(stale)
            return True
        kwargs: dict[str, Any] = (
            {"IfNoneMatch": "*"} if expected_token is None else {"IfMatch": expected_token}
        )
        try:
            with self._errors(key):
                try:
                    self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data, **kwargs)
                except ClientError as e:
                    if self._precondition_failed(e):
                        return False
                    raise
        except KeyNotFoundError:  # If-Match on a pointer deleted meanwhile
            return False
        return True

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


# ----------------------------------------------------------------------------------------------
# Construction from a URI or a WeightChannel store spec


def open_store(uri: str, **s3_options: Any) -> Store:
    """`/path`, `file:///path` -> FilesystemStore; `s3://bucket/prefix[?endpoint=URL&region=R]` -> S3Store.

    Raises ValueError with a one-line message on anything else."""
    if not uri:
        raise ValueError("store URI is empty")
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        path = parsed.path if parsed.scheme == "file" else uri
        if not path:
            raise ValueError(f"store URI {uri!r} has no path")
        return FilesystemStore(path)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"store URI {uri!r} has no bucket")
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        options = dict(s3_options)
        if "endpoint" in query:
            options.setdefault("endpoint_url", query["endpoint"])
        if "region" in query:
            options.setdefault("region", query["region"])
        if "conditional" in query:
            options.setdefault("conditional_writes", query["conditional"].lower() in ("1", "true", "yes"))
        return S3Store(parsed.netloc, parsed.path.strip("/"), **options)
    raise ValueError(f"unsupported store URI {uri!r}: use a path, file:// or s3://")


def store_from_spec(spec: Any, **s3_options: Any) -> Store:
    """A Store from a `rlfleet.api.weightchannel.StoreSpec` (or anything with the same fields)."""
    if getattr(spec, "type", "filesystem") == "s3":
        return S3Store(
            spec.bucket,
            getattr(spec, "prefix", "") or "",
            endpoint_url=getattr(spec, "endpoint", None),
            region=getattr(spec, "region", None),
            **s3_options,
        )
    if not getattr(spec, "path", None):
        raise ValueError("filesystem store needs a path")
    return FilesystemStore(spec.path)


def is_unavailable(error: BaseException) -> bool:
    """True for errors worth retrying later (store down), false for logic errors."""
    if isinstance(error, StoreUnavailableError):
        return True
    return isinstance(error, OSError) and error.errno in (
        errno.ENOENT,
        errno.EIO,
        errno.ESTALE,
        errno.ENOTCONN,
    )
