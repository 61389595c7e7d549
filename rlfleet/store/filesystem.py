"""`FilesystemStore`: the store on a directory of a shared volume (ReadWriteMany PVC, NFS, local disk
in tests).

Every write is temp file + fsync + rename + fsync of the directory, so a reader never sees a partial
object and an acknowledged write survives a crash. `create` is `link(2)` of a fsynced temp file
(atomic, fails if the name exists); compare-and-swap holds an `flock(2)` on a sidecar lock file
(released by the kernel if the holder is SIGKILLed; NFSv4 maps it to POSIX byte-range locks).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlfleet.store.base import PointerValue, Store, check_key
from rlfleet.store.digests import FILE_DIGEST, FileDigest, check_digest, hash_file
from rlfleet.store.errors import KeyNotFoundError, ObjectTooLargeError, StoreError, StoreUnavailableError


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

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        self._require_root()
        try:
            with open(self._path(key), "rb") as f:
                data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise KeyNotFoundError(f"{key} not found in {self.uri}") from e
        if max_bytes is not None and len(data) > max_bytes:
            raise ObjectTooLargeError(f"{self.uri_of(key)} holds more than {max_bytes} bytes")
        return data

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

    def _walk(self, prefix: str) -> Iterator[tuple[str, str]]:
        """(key, path) of every object whose key starts with `prefix` (hidden temp and lock files are none)."""
        self._require_root()
        # Walk only the deepest directory the prefix names.
        base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self.root / base_rel if base_rel else self.root
        if not base.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if name.startswith("."):
                    continue  # temp and lock files
                key = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                if key.startswith(prefix):
                    yield key, os.path.join(dirpath, name)

    def list(self, prefix: str = "") -> list[str]:
        return sorted(key for key, _ in self._walk(prefix))

    def modified_times(self, prefix: str = "") -> dict[str, datetime]:
        """ctime: set by the kernel (or the NFS server) at every write and rename, and, unlike mtime,
        not settable by whoever writes the file (`touch -d` / utime change mtime and set ctime to now)."""
        times: dict[str, datetime] = {}
        for key, path in self._walk(prefix):
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                times[key] = datetime.fromtimestamp(os.stat(path).st_ctime, UTC)
        return dict(sorted(times.items()))

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
        self._require_root()
        try:
            with open(self._path(key), "rb") as f:  # ctime and bytes of the same inode
                ctime = os.fstat(f.fileno()).st_ctime
                data = f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        return PointerValue(data, self._token(data), max(0.0, time.time() - ctime))

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
