"""What others write into the channel stays within bounds (issue 39): a subscriber report cannot make
itself fresher than its last write in the store, pins at most its newest versions at or below the
pointer, and cannot make the trainer publish a view its job does not have; the writer lease ages by the
store's clock and its holder recovers at once after a store hiccup (lock-free S3); a garbage pointer,
manifest or report is one line on every reading side, and records are read with a size bound. Every
attack goes through the real store code: a real directory and a real S3 server (moto_server)."""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from support.moto import make_bucket
from support.weight_sync import engineless_syncer
from test_weights_channel import make_view
from test_weights_lease import stored_lease
from test_weights_sync import tiny_state

from rlfleet.channel import (
    LEASE_KEY,
    MAX_MANIFEST_BYTES,
    MAX_PINNED_PER_REPORT,
    MAX_REPORT_BYTES,
    POINTER_KEY,
    SUBSCRIBER_STALE_AFTER_SECONDS,
    ChannelError,
    LeaseHeldError,
    SubscriberReport,
    WeightChannel,
    WriterLease,
    manifest_key,
    read_channel_status,
    report_age_seconds,
)
from rlfleet.store import FilesystemStore, ObjectTooLargeError, S3Store, Store, StoreUnavailableError
from rlfleet.trainer.failures import FailureContext, describe_failure
from rlfleet.trainer.publish.publisher import WeightPublisher

FAR_FUTURE = "2099-01-01T00:00:00+00:00"


def publish_versions(store: Store, tmp_path: Path, count: int) -> WeightChannel:
    channel = WeightChannel(store, publisher_id="trainer")
    for i in range(count):
        channel.publish({"bf16": make_view(tmp_path / f"v{i}", "bf16", str(i))}, version=i)
    return channel


def put_far_future_report(store: Store, replica: str, **fields: Any) -> None:
    """The subscriber report of group g's `replica` written into the store as its bytes, not through the
    channel: applied v0, v0 in use, dated FAR_FUTURE, with `fields` added."""
    body = {
        "group": "g",
        "replica": replica,
        "view": "bf16",
        "applied_version": 0,
        "in_use": [0],
        "updated_at": FAR_FUTURE,
        **fields,
    }
    store.put(f"subscribers/g/{replica}.json", json.dumps(body).encode())


def test_a_report_dated_in_the_future_ages_from_its_write_in_the_store(
    any_store: Store, tmp_path: Path
) -> None:
    """The attack: a report dated 2099 used to stay fresh for good and pin its versions forever. Its age is
    now from the store's own time of its write: past the bound it pins nothing and counts nowhere."""
    channel = publish_versions(any_store, tmp_path, 4)
    channel.report(SubscriberReport("g", "attacker", "bf16", 0, [0, 1], updated_at=FAR_FUTURE))
    [report] = channel.subscribers()
    assert report.updated_at == FAR_FUTURE and report.stored_at  # the store's time is attached
    written = datetime.fromisoformat(report.stored_at)
    assert abs((datetime.now(UTC) - written).total_seconds()) < 60
    now = datetime.now(UTC)
    assert report_age_seconds(report, written) == 0.0  # counted from the write, not from 2099
    # while fresh it pins v0 and v1 (keep=1 would otherwise delete both)
    assert channel.retain(keep=1, now=now) == [2]
    assert channel.versions() == [0, 1, 3]
    later = written + timedelta(seconds=SUBSCRIBER_STALE_AFTER_SECONDS + 1)
    assert report_age_seconds(report, later) == SUBSCRIBER_STALE_AFTER_SECONDS + 1
    assert channel.retain(keep=1, now=later) == [0, 1]
    assert channel.versions() == [3]
    status = read_channel_status(any_store, stale_after_seconds=SUBSCRIBER_STALE_AFTER_SECONDS, now=later)
    assert status.groups == []  # counts in no group either
    # rewriting it (what a live sidecar does every heartbeat) is the only way to stay fresh
    assert json.loads(any_store.get("subscribers/g/attacker.json"))["updated_at"] == FAR_FUTURE


def test_a_stored_at_written_into_the_report_is_ignored(any_store: Store, tmp_path: Path) -> None:
    """`stored_at` is the store's, never the report's: a pod writing one of its own into the bytes changes
    nothing (and the channel never writes it)."""
    channel = publish_versions(any_store, tmp_path, 3)
    put_far_future_report(any_store, "r", stored_at=FAR_FUTURE)
    [report] = channel.subscribers()
    assert report.stored_at != FAR_FUTURE
    assert datetime.fromisoformat(report.stored_at) < datetime.now(UTC) + timedelta(seconds=60)
    assert channel.retain(
        keep=1, now=datetime.now(UTC) + timedelta(seconds=SUBSCRIBER_STALE_AFTER_SECONDS + 60)
    ) == [0, 1]
    channel.report(SubscriberReport("g", "r2", "bf16", 2, [2]))
    assert "stored_at" not in json.loads(any_store.get("subscribers/g/r2.json"))


def test_a_future_mtime_on_a_filesystem_report_does_not_make_it_fresh(tmp_path: Path) -> None:
    """A sampler pod mounts its group's report directory read-write and can set a file's mtime (utime): the
    age is from ctime, which every write and utime set to the kernel's now and no writer can set."""
    store = FilesystemStore(tmp_path / "store", create=True)
    channel = publish_versions(store, tmp_path, 3)
    channel.report(SubscriberReport("g", "r", "bf16", 0, [0], updated_at=FAR_FUTURE))
    path = tmp_path / "store" / "subscribers" / "g" / "r.json"
    future = datetime.fromisoformat(FAR_FUTURE).timestamp()
    os.utime(path, (future, future))
    [report] = channel.subscribers()
    stored = datetime.fromisoformat(report.stored_at)
    assert stored.year < 2099 and abs((datetime.now(UTC) - stored).total_seconds()) < 60
    past_bound = datetime.now(UTC) + timedelta(seconds=SUBSCRIBER_STALE_AFTER_SECONDS + 60)
    assert channel.retain(keep=1, now=past_bound) == [0, 1]


def test_a_report_pins_only_its_newest_versions_at_or_below_the_pointer(
    any_store: Store, tmp_path: Path
) -> None:
    """The attack: a fresh report listing every version (and numbers far above the pointer) pinned them
    all. Now it pins at most MAX_PINNED_PER_REPORT of its listed versions, the newest at or below the
    pointer; numbers above the pointer or not in the channel pin nothing."""
    assert MAX_PINNED_PER_REPORT == 2
    channel = publish_versions(any_store, tmp_path, 6)  # v0..v5, pointer 5
    channel.report(SubscriberReport("g", "greedy", "bf16", 0, [0, 1, 2, 3, 99, 10**12]))
    # keep=1 keeps v5; the report pins v2 and v3 (its two newest at or below 5); v0, v1, v4 go
    assert channel.retain(keep=1) == [0, 1, 4]
    assert channel.versions() == [2, 3, 5]
    # a report listing only numbers above the pointer or deleted ones pins nothing
    channel.report(SubscriberReport("g", "greedy", "bf16", 77, [0, 1, 6, 77]))
    assert channel.retain(keep=1) == [2, 3]
    assert channel.versions() == [5]


def test_a_legitimate_report_still_pins_what_its_replica_serves_and_obtains(
    any_store: Store, tmp_path: Path
) -> None:
    """What a sidecar reports (sampler/sync_report.py: `in_use` = the applied version and the one being
    obtained) stays pinned: the bound takes nothing a real replica uses."""
    channel = publish_versions(any_store, tmp_path, 5)
    channel.report(SubscriberReport("g", "r", "bf16", 1, [1, 3]))
    assert channel.retain(keep=1) == [0, 2]
    assert channel.versions() == [1, 3, 4]


def test_the_trainer_publishes_only_its_jobs_views(
    tmp_path: Path, tiny_qwen3_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The attack: a report naming another view made the trainer convert and upload it every step. With
    `allowed_views` (the cluster trainer passes its RLJob's views) the view is ignored, logged once."""
    store = FilesystemStore(tmp_path / "store", create=True)
    WeightChannel(store).report(SubscriberReport("g", "r", "fp8", None, []))
    publisher = WeightPublisher(store, views=["bf16"], base_checkpoint=tiny_qwen3_dir, allowed_views=["bf16"])
    with caplog.at_level(logging.WARNING, logger="rlfleet.trainer.publish.publisher"):
        first = publisher.publish(tiny_state(0), version=0)
        second = publisher.publish(tiny_state(1), version=1)
    assert sorted(first.manifest.views) == sorted(second.manifest.views) == ["bf16"]
    assert store.list("v1/fp8/") == []
    refused = [r.getMessage() for r in caplog.records if "names view 'fp8'" in r.getMessage()]
    assert refused == [
        "a subscriber report names view 'fp8', which this job does not publish (its views: bf16): ignored"
    ]
    # a view the job has is still followed (allowed but not configured here: a tool's publisher)
    follower = WeightPublisher(
        store, views=["bf16"], base_checkpoint=tiny_qwen3_dir, allowed_views=["bf16", "fp8"]
    )
    assert sorted(follower.publish(tiny_state(2), version=2).manifest.views) == ["bf16", "fp8"]


# ----------------------------------------------------------------------------------------------
# The writer lease: ages by the store's clock, and a holder recovers after a store hiccup


def _store_lease(store: Store, lease: WriterLease) -> None:
    """Write `lease` as another trainer would have (compare-and-swap over whatever is there)."""
    current = store.read_pointer(LEASE_KEY)
    assert store.compare_and_swap(LEASE_KEY, None if current is None else current.token, lease.to_bytes())


def test_a_lease_dated_in_the_future_expires_by_the_stores_clock(any_store: Store) -> None:
    """A holder whose clock is years ahead wrote `renewed_at` in 2099: by its own date its lease never
    expired. Its age is the store's: past its TTL without a rewrite, another id takes it over."""
    _store_lease(any_store, WriterLease("trainer/ns/ahead", 1, FAR_FUTURE, 1.0))
    with pytest.raises(LeaseHeldError, match="'trainer/ns/ahead'"):
        WeightChannel(any_store, publisher_id="trainer/ns/b").acquire_lease()
    time.sleep(2.2)  # past its TTL by the store's clock (whole seconds on S3)
    assert WeightChannel(any_store, publisher_id="trainer/ns/b").acquire_lease().generation == 2


def test_a_lease_dated_in_the_past_is_held_while_it_is_rewritten(any_store: Store) -> None:
    """A holder whose clock is an hour behind wrote `renewed_at` an hour ago at every renewal: by its date
    any other trainer could take over at once. By the store's clock it was just written: refused."""
    behind = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    _store_lease(any_store, WriterLease("trainer/ns/behind", 1, behind, 300.0))
    with pytest.raises(
        LeaseHeldError, match=r"'trainer/ns/behind' \(generation 1, last renewed .*, [01]s ago"
    ):
        WeightChannel(any_store, publisher_id="trainer/ns/b").acquire_lease()
    assert stored_lease(any_store).holder == "trainer/ns/behind"


def _claims(endpoint: str, bucket: str) -> list[str]:
    import boto3

    listed = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").list_objects_v2(
        Bucket=bucket, Prefix="ch/_claims/"
    )
    return [item["Key"] for item in listed.get("Contents", [])]


def test_the_lock_free_lease_holder_recovers_at_once_after_a_hiccup(s3_endpoint: str, tmp_path: Path) -> None:
    """S3 without conditional writes: a renewal's claim was written, then the store failed (503 SlowDown,
    past boto's retries) on the claim listing and on the claim's removal. Before, that claim blocked every
    renewal and publish of the lease's next entry for claim_ttl_seconds (600 s): "compare-and-swap kept
    failing" with a traceback. Now the store knows the claim is its own, from a call that ended: the
    next renewal, once S3 answers, succeeds at once and removes it, and publishing goes on."""
    from s3_fault_proxy import S3FaultProxy

    bucket = make_bucket(s3_endpoint)
    proxy = S3FaultProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    store = S3Store(bucket, "ch", endpoint_url=proxy.url, conditional_writes=False, max_attempts=2)
    try:
        channel = WeightChannel(store, publisher_id="trainer/ns/a")
        lease = channel.acquire_lease()
        view = {"bf16": make_view(tmp_path / "bf16", "bf16", "x")}
        assert channel.publish(view, version=0).advanced
        with proxy.failing("GET|DELETE", r"_claims"), pytest.raises(StoreUnavailableError, match="SlowDown"):
            channel.renew_lease()
        assert proxy.failed and len(_claims(s3_endpoint, bucket)) == 1  # the hiccup's claim is left behind
        assert channel.renew_lease().generation == lease.generation  # at once, not after 600 s
        assert _claims(s3_endpoint, bucket) == []
        assert channel.publish(view, version=1).advanced
        # the same hiccup on the pointer's log: the next publish moves the pointer at once too
        with proxy.failing("GET|DELETE", r"_claims"), pytest.raises(StoreUnavailableError):
            channel.publish(view, version=2)
        assert channel.publish(view, version=3).advanced
        pointer = channel.latest()
        assert pointer is not None and pointer.version == 3
        assert _claims(s3_endpoint, bucket) == []
    finally:
        store.close()
        proxy.close()


def test_another_writers_unfinished_claim_still_blocks(s3_endpoint: str) -> None:
    """What the recovery must not do: a claim of ANOTHER store object (another process, maybe alive between
    its claim and its write) is not ignored before claim_ttl_seconds; one older than that is."""
    bucket = make_bucket(s3_endpoint)
    store = S3Store(bucket, "ch", endpoint_url=s3_endpoint, conditional_writes=False, claim_ttl_seconds=2.0)
    try:
        store.client.put_object(Bucket=bucket, Key="ch/_claims/k/someone-else", Body=b"")
        assert store.create("k", b"mine") is False
        time.sleep(3.1)  # past the TTL by the store's clock (its own claim's Last-Modified)
        assert store.create("k", b"mine") is True and store.get("k") == b"mine"
        assert _claims(s3_endpoint, bucket) == []
    finally:
        store.close()


def test_a_channel_error_is_one_line_with_its_own_exit_code(tmp_path: Path) -> None:
    """Every other ChannelError (a damaged record, a compare-and-swap that kept failing) has a failure row:
    one line naming the store and the fix, exit 10, never a traceback."""
    store = FilesystemStore(tmp_path / "ch", create=True)
    store.put(POINTER_KEY, b"\x80 garbage")
    with pytest.raises(ChannelError) as damaged:
        WeightChannel(store).latest()
    context = FailureContext(
        store=store.uri,
        checkpoints="c",
        router="r",
        rollout_logs="l",
        own_store="its own store",
        continue_with="restart it",
    )
    code, line = describe_failure(damaged.value, context) or (0, "")
    assert code == 10
    assert line == (
        f"the weight channel {store.uri} cannot be used: {store.uri_of(POINTER_KEY)}: unreadable pointer "
        "(UnicodeDecodeError: 'utf-8' codec can't decode byte 0x80 in position 0: invalid start byte). Fix: a "
        "record in it is damaged (restore it, or delete a damaged pointer.json: the next publish writes it "
        "again) or the store kept refusing its compare-and-swap (an S3 store without conditional writes frees "
        "a writer's claim it could not delete after 600 s); then restart it"
    )
    assert describe_failure(ChannelError("pointer compare-and-swap kept failing"), context)[0] == 10  # type: ignore[index]


# ----------------------------------------------------------------------------------------------
# Garbage records: one line each, on every reading side


GARBAGE_POINTERS = {
    "not json": b"garbage",
    "not utf-8": b"\x80\x81 version",
    "a list": b"[1, 2]",
    "no version": b'{"manifest": "v0/manifest.json", "manifest_sha256": "x"}',
    "a huge number": b'{"version": 1e400, "manifest": "m", "manifest_sha256": "x"}',
    "too deep": b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("garbage", sorted(GARBAGE_POINTERS))
def test_a_garbage_pointer_is_one_line_for_readers_and_publishers(
    any_store: Store, tmp_path: Path, garbage: str
) -> None:
    channel = publish_versions(any_store, tmp_path, 1)
    current = any_store.read_pointer(POINTER_KEY)
    assert current is not None and any_store.compare_and_swap(
        POINTER_KEY, current.token, GARBAGE_POINTERS[garbage]
    )
    for call in (
        channel.latest,
        lambda: channel.publish({"bf16": make_view(tmp_path / "n", "bf16", "n")}, version=5),
    ):
        with pytest.raises(ChannelError) as refused:
            call()
        message = str(refused.value)
        assert (
            message.startswith(f"{any_store.uri_of(POINTER_KEY)}: unreadable pointer (")
            and "\n" not in message
        )
        assert len(message) < 400


MALFORMED_MANIFESTS = {
    "not utf-8": b'{"format": "rlfleet.weights/v3", "version": 0, "views": {"bf\xff16": {}}}',
    "not json": b"\x00\x01garbage",
    "a string": b'"manifest"',
    "a huge version": b'{"format": "rlfleet.weights/v3", "version": 1e400, "published_at": "", "views": {}}',
}


@pytest.mark.parametrize("garbage", sorted(MALFORMED_MANIFESTS))
def test_a_malformed_manifest_is_a_damaged_version_in_one_line(
    any_store: Store, tmp_path: Path, garbage: str
) -> None:
    channel = publish_versions(any_store, tmp_path, 1)
    any_store.put(manifest_key(0), MALFORMED_MANIFESTS[garbage])
    with pytest.raises(ChannelError, match=r"^malformed manifest: [A-Za-z]+Error: ") as refused:
        channel.manifest(0)
    assert "\n" not in str(refused.value)


def test_get_refuses_an_object_above_its_bound(any_store: Store) -> None:
    any_store.put("subscribers/g/big.json", b"x" * 11)
    assert any_store.get("subscribers/g/big.json", max_bytes=11) == b"x" * 11
    with pytest.raises(ObjectTooLargeError, match="holds more than 10 bytes"):
        any_store.get("subscribers/g/big.json", max_bytes=10)


def test_a_manifest_above_the_bound_is_refused_unread(tmp_path: Path) -> None:
    """MAX_MANIFEST_BYTES (64 MiB): a larger manifest is a damaged version, refused before it is parsed
    (the file here is sparse: 64 MiB + 1 byte that take no disk)."""
    assert MAX_MANIFEST_BYTES == 64 * 1024 * 1024
    store = FilesystemStore(tmp_path / "store", create=True)
    channel = publish_versions(store, tmp_path, 1)
    with open(tmp_path / "store" / manifest_key(0), "r+b") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)
    with pytest.raises(
        ChannelError, match=r"^manifest of v0 refused as damaged: .* holds more than 67108864 bytes"
    ):
        channel.manifest(0)


def test_an_oversized_or_malformed_report_pins_nothing(any_store: Store, tmp_path: Path) -> None:
    """MAX_REPORT_BYTES (64 KiB): a sampler pod's report larger than that, like a malformed one, is skipped."""
    channel = publish_versions(any_store, tmp_path, 3)
    put_far_future_report(any_store, "big", pad="x" * MAX_REPORT_BYTES)
    any_store.put("subscribers/g/list.json", b"[0, 1]")
    any_store.put(
        "subscribers/g/huge-number.json", b'{"group": "g", "replica": "n", "view": "bf16", "in_use": [1e400]}'
    )
    any_store.put("subscribers/g/text.json", "\u00e9".encode("latin-1"))
    assert channel.subscribers() == []
    assert channel.retain(keep=1) == [0, 1]
    assert channel.remove_subscriber("g", "big", if_updated_at=FAR_FUTURE) is True  # judged as malformed


async def test_the_sidecar_reports_a_garbage_pointer_and_manifest_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The reading side: the sync sidecar's step never crashes (no "weight sync step crashed" traceback) on
    a garbage pointer or a non-UTF-8 manifest; it fails the step with one line and keeps its version."""
    store = FilesystemStore(tmp_path / "store", create=True)
    channel = WeightChannel(store, publisher_id="trainer")
    channel.publish({"fp8": make_view(tmp_path / "v0", "fp8", "0")}, version=0)
    channel.publish({"bf16": make_view(tmp_path / "v1", "bf16", "1")}, version=1)  # fp8 is in v0 only
    caplog.set_level(logging.WARNING, logger="rlfleet.sampler.sync")
    async with engineless_syncer(store, tmp_path / "cache") as syncer:
        store.put(manifest_key(0), b'{"format": "rlfleet.weights/v3", "views": {"fp\xff8": {}}}')
        assert await syncer.reconcile_once() is False
        assert syncer.state.last_error is not None
        assert syncer.state.last_error.startswith(
            "store: read pointer: malformed manifest: UnicodeDecodeError: "
        )
        pointer = store.read_pointer(POINTER_KEY)
        assert pointer is not None and store.compare_and_swap(POINTER_KEY, pointer.token, b"[]")
        assert await syncer.reconcile_once() is False
        assert syncer.state.last_error == (
            f"store: read pointer: {store.uri_of(POINTER_KEY)}: unreadable pointer "
            "(TypeError: list indices must be integers or slices, not str)"
        )
    assert syncer.state.applied_version is None and syncer.state.failures["store"] == 2
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert [r.getMessage().count("\n") for r in caplog.records] == [0, 0]
