"""A `Store` from what names one: a URI (`open_store`: CLI flags, env vars) or a WeightChannel's store
spec (`store_from_spec`: the operator and the cluster trainer)."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlencode, urlparse

from rlfleet.store.base import Store
from rlfleet.store.filesystem import FilesystemStore
from rlfleet.store.s3 import S3Store


def spec_uri(spec: Any) -> str:
    """The URI `open_store` takes for a WeightChannel's store spec: its filesystem path, or
    s3://bucket/prefix[?endpoint=URL] (credentials stay in the environment): the sidecar's and the slime
    bridge's --store."""
    if getattr(spec, "type", "filesystem") == "filesystem":
        return str(getattr(spec, "path", "") or "")
    uri = f"s3://{spec.bucket}/{str(getattr(spec, 'prefix', '') or '').strip('/')}".rstrip("/")
    endpoint = getattr(spec, "endpoint", None)
    return uri + ("?" + urlencode({"endpoint": endpoint}) if endpoint else "")


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
