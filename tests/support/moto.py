"""A REAL S3-compatible server for the tests: moto's standalone server (`moto_server`, from `moto[server]`,
Apache-2.0) run as a separate process on 127.0.0.1 and a free port. boto3 talks real HTTP to it, exactly
as to AWS S3 or any S3-compatible server. MinIO is not used (AGPL)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx

from support.ports import free_port

CREDS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def start_moto(port: int) -> subprocess.Popen[bytes]:
    """moto_server listening on 127.0.0.1:`port` (its admin API answers), or RuntimeError."""
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


@contextlib.contextmanager
def moto_endpoint() -> Iterator[str]:
    """A running moto_server's endpoint URL (the credentials boto3 needs set in this process unless they
    are); stopped at exit."""
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
    """A new, empty bucket on the server at `endpoint`."""
    import boto3

    bucket = f"wc-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return bucket
