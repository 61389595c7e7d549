"""Object stores for the weight channel: a small interface and two real implementations.

`Store` is deliberately small: put / get / list / delete, an exclusive `create` (put-if-absent) and
an atomic compare-and-swap on a pointer object. Everything the channel guarantees (bytes durable
before the pointer moves, monotonic versions, no mixed version) is built on these primitives in
`rlfleet.channel`.

One module per question:
- `base`: the `Store` interface, its `PointerValue` and the key rule (`check_key`);
- `errors`: what a store raises (`StoreError`, `KeyNotFoundError`, `StoreUnavailableError`);
- `digests`: file digests (`FileDigest`, `hash_file`, `write_file_hashed`, the algorithms a manifest
  may name);
- `filesystem`: `FilesystemStore`, a directory on a shared volume (temp file + fsync + rename; `flock`
  for the pointer);
- `s3`: `S3Store`, any S3-compatible bucket via boto3 (conditional writes, or a lock-free fallback);
- `factory`: a store from a URI (`open_store`) or a WeightChannel's store spec (`store_from_spec`).

Callers import the names from `rlfleet.store`. No torch here: the operator reads channel status
through this package.
"""

from rlfleet.store.base import PointerValue, Store, check_key
from rlfleet.store.digests import (
    CHUNK_BYTES,
    DIGEST_ALGORITHMS,
    FILE_DIGEST,
    FileDigest,
    check_digest,
    hash_file,
    new_hasher,
    write_file_hashed,
)
from rlfleet.store.errors import KeyNotFoundError, ObjectTooLargeError, StoreError, StoreUnavailableError
from rlfleet.store.factory import open_store, store_from_spec
from rlfleet.store.filesystem import FilesystemStore
from rlfleet.store.s3 import S3Store

__all__ = [
    "CHUNK_BYTES",
    "DIGEST_ALGORITHMS",
    "FILE_DIGEST",
    "FileDigest",
    "FilesystemStore",
    "KeyNotFoundError",
    "ObjectTooLargeError",
    "PointerValue",
    "S3Store",
    "Store",
    "StoreError",
    "StoreUnavailableError",
    "check_digest",
    "check_key",
    "hash_file",
    "new_hasher",
    "open_store",
    "store_from_spec",
    "write_file_hashed",
]
