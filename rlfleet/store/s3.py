"""`S3Store`: the store on any S3-compatible bucket, via boto3 (imported on first use, so the rest of
the package needs no boto3).

Credentials come from boto3's default chain (the pod gets `AWS_ACCESS_KEY_ID` /
`AWS_SECRET_ACCESS_KEY` from the Secret named by the WeightChannel's `secretRef`; nothing is copied
into the spec). The pointer uses S3 conditional writes (`If-None-Match: *` to create, `If-Match:
<etag>` to swap) when the server honours them (probed once, or forced with
`conditional_writes=True/False`). Without them a lock-free scheme is used, see `S3Store` and
docs/weights.md.
"""

from __future__ import annotations

import contextlib
import email.utils
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlfleet.store.base import PointerValue, Store, check_key
from rlfleet.store.digests import CHUNK_BYTES, FILE_DIGEST, FileDigest, check_digest, hash_file, new_hasher
from rlfleet.store.errors import KeyNotFoundError, ObjectTooLargeError, StoreError, StoreUnavailableError


class S3Store(Store):
    """An S3-compatible bucket (boto3), optionally under a key prefix.

    Pointer with conditional writes (AWS S3 since 2024, and most S3-compatible servers): the pointer
    is one object; create = `PutObject If-None-Match: *`, swap = `PutObject If-Match: <etag>`.

    Lock-free fallback (servers that ignore conditional headers): S3 has strong read-after-write
    and list-after-write consistency, so an exclusive create is a claim protocol: write
    `_claims/<key>/<uuid>`, list `_claims/<key>/`, win only if no other fresh claim is listed (two
    racers both see each other and both back off: safe, the caller retries), then write the key. A
    claim older than `claim_ttl_seconds` is ignored (its writer crashed between claim and write) and
    deleted by the next create of that key.
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
        self._abandoned: set[str] = set()
        """This object's lock-free claims whose create ended (failed) without deleting them: the store
        went away between the claim and its removal. No create of ours will write their key any more,
        so they block nobody here (the next create of that key deletes them); other writers ignore them
        after claim_ttl_seconds."""
        self._abandoned_lock = threading.Lock()

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
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as e:
            raise self._client_error(key, e) from e
        except S3UploadFailedError as e:  # upload_file wraps the ClientError it gave up on (its context)
            cause = e.__context__
            if isinstance(cause, ClientError):
                raise self._client_error(key, cause) from e
            raise StoreError(f"{self.uri}: {key}: {e}") from e
        except BotoCoreError as e:  # connection refused, timeouts, DNS, ...
            raise StoreUnavailableError(f"{self.uri} unreachable: {e}") from e

    def _client_error(self, key: str, e: Any) -> StoreError:
        """What a botocore ClientError means: absent, unreachable (a missing bucket, 5xx: SlowDown,
        InternalError, after boto's retries), or refused."""
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchKey", "404", "NotFound"):
            return KeyNotFoundError(f"{key} not found in {self.uri}")
        if code in ("NoSuchBucket",):
            return StoreUnavailableError(f"bucket {self.bucket} does not exist")
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if status >= 500:
            return StoreUnavailableError(f"{self.uri}: {key}: {code} ({status})")
        return StoreError(f"{self.uri}: {key}: {code}: {e}")

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

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        with self._errors(key):
            response = self.client.get_object(Bucket=self.bucket, Key=self._k(key))
            body = response["Body"]
            try:
                if max_bytes is not None and int(response.get("ContentLength") or 0) > max_bytes:
                    raise ObjectTooLargeError(f"{self.uri_of(key)} holds more than {max_bytes} bytes")
                data: bytes = body.read() if max_bytes is None else body.read(max_bytes + 1)
            finally:
                body.close()
        if max_bytes is not None and len(data) > max_bytes:
            raise ObjectTooLargeError(f"{self.uri_of(key)} holds more than {max_bytes} bytes")
        return data

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

    def modified_times(self, prefix: str = "") -> dict[str, datetime]:
        items = self._list_full(prefix)
        return {
            key: item["LastModified"].astimezone(UTC)
            for item in items
            if not (key := self._rel(item["Key"])).startswith(("_claims/", "_log/", "_probe/"))
        }

    def delete(self, key: str) -> None:
        with self._errors(key):
            self.client.delete_object(Bucket=self.bucket, Key=self._k(key))

    def delete_many(self, keys: Sequence[str]) -> None:
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
        try:
            with self._errors(mine):
                self.client.put_object(Bucket=self.bucket, Key=self._k(mine), Body=b"")
            items = self._list_full(claim_prefix)
            # The claim's age is by the store's clock: "now" is our own claim's Last-Modified.
            now = next(
                (i["LastModified"].timestamp() for i in items if self._rel(i["Key"]) == mine), time.time()
            )
            with self._abandoned_lock:
                abandoned = set(self._abandoned)
            listed = [item for item in items if self._rel(item["Key"]) != mine]
            others = [
                item
                for item in listed
                if now - item["LastModified"].timestamp() < self.claim_ttl_seconds
                and self._rel(item["Key"]) not in abandoned
            ]
            stale = [self._rel(item["Key"]) for item in listed if item not in others]
            if stale:  # claims of writers that died between claim and write (or ours, abandoned): cleaned up
                with contextlib.suppress(StoreError):
                    self.delete_many(stale)
                    with self._abandoned_lock:
                        self._abandoned.difference_update(stale)
            if others or self._exists(key):
                return False  # contention (or lost): back off, the caller retries
            self.put(key, data)
            return True
        finally:
            # A later claimant checks the key after listing, so the claim is not needed once the
            # key exists (and a loser's claim must go so it does not block the next round).
            try:
                self.delete(mine)
            except StoreError:  # the store went away: this call is over, so its claim blocks nobody here
                with self._abandoned_lock:
                    self._abandoned.add(mine)
            else:
                self._remove_abandoned()

    def _remove_abandoned(self) -> None:
        """Delete this object's abandoned claims once the store answers again (best effort: a claim of a
        key nobody creates again would otherwise stay, ignored by others only after its TTL)."""
        with self._abandoned_lock:
            leftovers = sorted(self._abandoned)
        if leftovers:
            with contextlib.suppress(StoreError):
                self.delete_many(leftovers)
                with self._abandoned_lock:
                    self._abandoned.difference_update(leftovers)

    def read_pointer(self, key: str) -> PointerValue | None:
        if not self.conditional_writes:
            entries = [item["Key"] for item in self._list_full(f"_log/{key}/")]
            if not entries:
                return None
            latest = max(entries)
            seq = latest.rsplit("/", 1)[1]
            try:
                with self._errors(key):
                    response = self.client.get_object(Bucket=self.bucket, Key=latest)
                    return PointerValue(response["Body"].read(), seq, self._age(response))
            except KeyNotFoundError:
                return None  # pruned between list and get: caller re-reads
        try:
            with self._errors(key):
                response = self.client.get_object(Bucket=self.bucket, Key=self._k(key))
                return PointerValue(response["Body"].read(), response["ETag"], self._age(response))
        except KeyNotFoundError:
            return None

    @staticmethod
    def _age(response: dict[str, Any]) -> float | None:
        """Seconds since the object was written, by the store's clock: the response's Date header minus
        its Last-Modified (both whole seconds); None without them."""
        date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        modified = response.get("LastModified")
        if not date or modified is None:
            return None
        try:
            return max(0.0, (email.utils.parsedate_to_datetime(date) - modified).total_seconds())
        except (TypeError, ValueError):
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
