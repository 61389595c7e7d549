"""Store contract, run against every implementation: a real directory, and a real S3-compatible
server (moto_server in its own process) with conditional writes and with the lock-free scheme."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import blake3
import pytest
from support.ports import free_port

from rlfleet.store import (
    FileDigest,
    FilesystemStore,
    KeyNotFoundError,
    S3Store,
    Store,
    StoreUnavailableError,
    open_store,
)


def test_put_get_list_delete(any_store: Store) -> None:
    any_store.put("a/b/one.json", b"1")
    any_store.put("a/b/two.json", b"2")
    any_store.put("a/c.bin", b"3")
    any_store.put("a/b/one.json", b"1bis")  # overwrite
    assert any_store.get("a/b/one.json") == b"1bis"
    assert any_store.list("a/") == ["a/b/one.json", "a/b/two.json", "a/c.bin"]
    assert any_store.list("a/b/") == ["a/b/one.json", "a/b/two.json"]
    assert any_store.list("a/b/t") == ["a/b/two.json"]
    assert any_store.list("zzz") == []
    any_store.delete("a/b/one.json")
    any_store.delete("a/b/one.json")  # idempotent
    with pytest.raises(KeyNotFoundError):
        any_store.get("a/b/one.json")
    assert any_store.list("a/") == ["a/b/two.json", "a/c.bin"]
    any_store.delete_many(["a/b/two.json", "a/c.bin"])
    assert any_store.list("") == []


def test_put_file_get_file_digests(any_store: Store, tmp_path: Path) -> None:
    data = bytes(range(256)) * 5000 + b"tail"
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    sent = any_store.put_file("v0/bf16/model.safetensors", src)
    assert sent == FileDigest("blake3", blake3.blake3(data).hexdigest(), len(data))  # the default
    got = any_store.get_file("v0/bf16/model.safetensors", tmp_path / "out" / "x.bin")
    assert got == sent
    assert (tmp_path / "out" / "x.bin").read_bytes() == data
    # sha256 where a format prescribes it (model sources' SHA256SUMS)
    got256 = any_store.get_file("v0/bf16/model.safetensors", tmp_path / "out" / "z.bin", algorithm="sha256")
    assert got256 == FileDigest("sha256", hashlib.sha256(data).hexdigest(), len(data))
    with pytest.raises(ValueError, match="unknown digest algorithm 'md5'"):
        any_store.get_file("v0/bf16/model.safetensors", tmp_path / "out" / "w.bin", algorithm="md5")
    assert not (tmp_path / "out" / "w.bin").exists()
    with pytest.raises(KeyNotFoundError):
        any_store.get_file("v0/bf16/missing", tmp_path / "out" / "y.bin")
    assert not (tmp_path / "out" / "y.bin").exists()


def test_create_is_exclusive(any_store: Store) -> None:
    assert any_store.create("claims/v1", b"me")
    assert not any_store.create("claims/v1", b"you")
    assert any_store.get("claims/v1") == b"me"


def test_compare_and_swap_semantics(any_store: Store) -> None:
    assert any_store.read_pointer("pointer.json") is None
    assert not any_store.compare_and_swap("pointer.json", "bogus", b"x")
    assert any_store.compare_and_swap("pointer.json", None, b"v1")
    assert not any_store.compare_and_swap("pointer.json", None, b"again")  # exists now
    first = any_store.read_pointer("pointer.json")
    assert first is not None and first.data == b"v1"
    assert any_store.compare_and_swap("pointer.json", first.token, b"v2")
    assert not any_store.compare_and_swap("pointer.json", first.token, b"v3")  # stale token
    second = any_store.read_pointer("pointer.json")
    assert second is not None and second.data == b"v2"


@pytest.mark.parametrize("kind", ["filesystem", "s3-lock-free"])
def test_concurrent_compare_and_swap_loses_no_update(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Threads increment a counter through CAS loops: any non-atomic swap would lose increments.
    (Conditional S3 writes are atomic on AWS; moto's threaded server checks If-Match without a lock,
    so that path is only tested sequentially above.)"""
    if kind == "filesystem":
        store: Store = FilesystemStore(tmp_path / "s", create=True)
    else:
        from support.moto import make_bucket

        endpoint = request.getfixturevalue("s3_endpoint")
        store = S3Store(make_bucket(endpoint), endpoint_url=endpoint, conditional_writes=False)
    threads, increments = 3, 6 if kind == "filesystem" else 3
    store.compare_and_swap("counter", None, b"0")

    def worker() -> None:
        import random
        import time

        done = 0
        while done < increments:
            current = store.read_pointer("counter")
            assert current is not None
            if store.compare_and_swap("counter", current.token, str(int(current.data) + 1).encode()):
                done += 1
            else:
                time.sleep(random.uniform(0, 0.02))  # back off (lock-free claims can collide)

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(120)
    final = store.read_pointer("counter")
    assert final is not None and int(final.data) == threads * increments


def test_bad_keys_rejected(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path, create=True)
    for key in ["../escape", "/abs", "a//b", "a/./b", ".hidden", "a/", ""]:
        with pytest.raises(ValueError):
            store.put(key, b"x")


def test_filesystem_missing_volume_is_unavailable(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path / "not-mounted")
    with pytest.raises(StoreUnavailableError):
        store.list("")
    with pytest.raises(StoreUnavailableError):
        store.put("a", b"x")


def test_filesystem_writes_leave_no_temp_files(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path / "s", create=True)
    store.put("x/y", b"1")
    store.compare_and_swap("p", None, b"1")
    store.create("c", b"1")
    names = sorted(p.name for p in (tmp_path / "s").rglob("*"))
    assert not [n for n in names if ".tmp-" in n], names


def test_s3_unreachable_endpoint_is_unavailable() -> None:
    port = free_port()  # nothing listens there
    store = S3Store(
        "bucket",
        endpoint_url=f"http://127.0.0.1:{port}",
        conditional_writes=True,
        max_attempts=1,
        connect_timeout=1,
    )
    with pytest.raises(StoreUnavailableError):
        store.get("pointer.json")
    with pytest.raises(StoreUnavailableError):
        store.list("v")


def test_s3_probe_detects_conditional_writes(s3_endpoint: str, s3_bucket: str) -> None:
    store = S3Store(s3_bucket, "p", endpoint_url=s3_endpoint)
    assert store.conditional_writes is True
    assert store.list("") == []  # the probe object is removed


def test_open_store_uris(tmp_path: Path) -> None:
    fs = open_store(str(tmp_path))
    assert isinstance(fs, FilesystemStore) and fs.root == tmp_path
    assert isinstance(open_store(f"file://{tmp_path}"), FilesystemStore)
    s3 = open_store("s3://bucket/some/prefix?endpoint=http://127.0.0.1:9&region=eu-west-1&conditional=false")
    assert isinstance(s3, S3Store)
    assert (s3.bucket, s3.prefix, s3.endpoint_url, s3.conditional_writes) == (
        "bucket",
        "some/prefix",
        "http://127.0.0.1:9",
        False,
    )
    assert s3.uri_of("v1/bf16") == "s3://bucket/some/prefix/v1/bf16"
    for bad in ["", "s3://", "gs://bucket/x"]:
        with pytest.raises(ValueError):
            open_store(bad)


def test_put_file_move_renames_on_the_same_filesystem(any_store: Store, tmp_path: Path) -> None:
    staging = any_store.staging_dir() or tmp_path
    src = staging / "staged.bin"
    src.write_bytes(b"x" * 100_000)
    digest = any_store.put_file("v3/fp8/model.safetensors", src, move=True)
    assert digest == FileDigest("blake3", blake3.blake3(b"x" * 100_000).hexdigest(), 100_000)
    assert any_store.get("v3/fp8/model.safetensors") == b"x" * 100_000
    if isinstance(any_store, FilesystemStore):
        assert not src.exists()  # renamed, not copied
        assert ".staging" not in " ".join(any_store.list(""))  # staging is invisible to readers


def test_filesystem_write_survives_a_concurrent_prune_of_its_directory(tmp_path: Path) -> None:
    """`delete` prunes empty parent directories; a writer that just created the directory must not
    fail when a concurrent delete removes it before the file lands (simulated deterministically:
    the directory vanishes right after the first mkdir, as if retention pruned `claims/`)."""

    class PrunedOnce(FilesystemStore):
        pruned = 0

        def _mkdirs(self, directory: Path) -> None:
            super()._mkdirs(directory)
            if self.pruned < 1 and not any(directory.iterdir()):
                self.pruned += 1
                directory.rmdir()  # what a concurrent `delete` of the dir's last entry does

    store = PrunedOnce(tmp_path / "s", create=True)
    assert store.create("claims/v4", b"me")
    assert store.pruned == 1 and store.get("claims/v4") == b"me"
    src = tmp_path / "f.bin"
    src.write_bytes(b"abc")
    store2 = PrunedOnce(tmp_path / "s2", create=True)
    assert store2.put_file("claims/x", src).bytes == 3  # the copy path retries too
    staged = store2.staging_dir() / "f.bin"  # type: ignore[operator]
    staged.write_bytes(b"defg")
    store3 = PrunedOnce(tmp_path / "s2")
    assert store3.put_file("claims/y/z", staged, move=True).bytes == 4  # and the rename path
    assert store3.pruned == 1 and not staged.exists()
    assert store2.get("claims/x") == b"abc" and store2.get("claims/y/z") == b"defg"


def test_lock_free_create_backs_off_from_a_live_claim_and_removes_a_dead_one(
    s3_endpoint: str, s3_bucket: str
) -> None:
    """The lock-free S3 exclusive create (servers without conditional writes): another writer's claim of the
    key younger than claim_ttl_seconds makes this create back off; once older (its writer died between its
    claim and its write) it is ignored, the create wins, and the dead claim is deleted, not left forever."""
    import time

    store = S3Store(
        s3_bucket, "ch", endpoint_url=s3_endpoint, conditional_writes=False, claim_ttl_seconds=1.0
    )
    store.client.put_object(Bucket=s3_bucket, Key="ch/_claims/claims/v3/dead-writer", Body=b"")
    assert not store.create("claims/v3", b"me")
    time.sleep(1.5)
    assert store.create("claims/v3", b"me") and store.get("claims/v3") == b"me"
    assert [item["Key"] for item in store._list_full("_claims/")] == []
    store.close()
