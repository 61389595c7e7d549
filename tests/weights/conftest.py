"""Fixtures of the weight-channel tests: a REAL S3-compatible server and small stores.

The S3 server is moto's standalone server in its own process (tests/support/moto.py): boto3 talks real
HTTP to it, exactly as to AWS S3 or any S3-compatible server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.moto import make_bucket, moto_endpoint

from rlfleet.store import FilesystemStore, S3Store


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    with moto_endpoint() as endpoint:
        yield endpoint


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    return make_bucket(s3_endpoint)


@pytest.fixture(params=["filesystem", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FilesystemStore | S3Store]:
    """A filesystem store and an S3 store (moto_server, conditional writes): the two kinds a sampler pulls from
    (`any_store` adds the lock-free S3 mode, for what writers do)."""
    if request.param == "filesystem":
        yield FilesystemStore(tmp_path / "store", create=True)
        return
    endpoint = request.getfixturevalue("s3_endpoint")
    s3 = S3Store(make_bucket(endpoint), "channel", endpoint_url=endpoint)
    yield s3
    s3.close()


@pytest.fixture(params=["filesystem", "s3-conditional", "s3-lock-free"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FilesystemStore | S3Store]:
    if request.param == "filesystem":
        yield FilesystemStore(tmp_path / "store", create=True)
        return
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = make_bucket(endpoint)
    store = S3Store(
        bucket,
        "channel",
        endpoint_url=endpoint,
        conditional_writes=None if request.param == "s3-conditional" else False,
    )
    if request.param == "s3-conditional":
        assert store.conditional_writes, "moto_server should honour If-None-Match / If-Match"
    yield store
    store.close()
