"""Fixtures of the weight-channel tests: a REAL S3-compatible server and small stores.

The S3 server is moto's standalone server (`moto_server`, from `moto[server]`, Apache-2.0) run as a
separate process on 127.0.0.1 and a free port: boto3 talks real HTTP to it, exactly as to AWS S3 or
any S3-compatible server. MinIO is not used (AGPL)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rlfleet.store import FilesystemStore, S3Store

CREDS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto(port: int) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **CREDS},
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/moto-api/", timeout=1.0)
            return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto_server did not start")


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    for k, v in CREDS.items():
        os.environ.setdefault(k, v)
    port = free_port()
    proc = start_moto(port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_bucket(endpoint: str) -> str:
    import boto3

    bucket = f"wc-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return bucket


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
