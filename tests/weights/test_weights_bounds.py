"""What pods write into the channel stays within bounds (issue 39): a subscriber report cannot make
itself fresher than its last write in the store, pins at most its newest versions at or below the
pointer, and cannot make the trainer publish a view its job does not have. Every attack goes through the
real store code: a real directory and a real S3 server (moto_server)."""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from test_weights_channel import make_view
from test_weights_sync import tiny_state

from rlfleet.channel import (
    MAX_PINNED_PER_REPORT,
    SUBSCRIBER_STALE_AFTER_SECONDS,
    SubscriberReport,
    WeightChannel,
    read_channel_status,
    report_age_seconds,
)
from rlfleet.store import FilesystemStore, Store
from rlfleet.trainer.publisher import WeightPublisher

FAR_FUTURE = "2099-01-01T00:00:00+00:00"


def publish_versions(store: Store, tmp_path: Path, count: int) -> WeightChannel:
    channel = WeightChannel(store, publisher_id="trainer")
    for i in range(count):
        channel.publish({"bf16": make_view(tmp_path / f"v{i}", "bf16", str(i))}, version=i)
    return channel


def test_a_report_dated_in_the_future_ages_from_its_write_in_the_store(any_store: Store, tmp_path: Path) -> None:
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
    body = {"group": "g", "replica": "r", "view": "bf16", "applied_version": 0, "in_use": [0],
            "updated_at": FAR_FUTURE, "stored_at": FAR_FUTURE}  # fmt: skip
    any_store.put("subscribers/g/r.json", json.dumps(body).encode())
    [report] = channel.subscribers()
    assert report.stored_at != FAR_FUTURE
    assert datetime.fromisoformat(report.stored_at) < datetime.now(UTC) + timedelta(seconds=60)
    assert channel.retain(keep=1, now=datetime.now(UTC) + timedelta(seconds=SUBSCRIBER_STALE_AFTER_SECONDS + 60)) == [0, 1]
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


def test_a_report_pins_only_its_newest_versions_at_or_below_the_pointer(any_store: Store, tmp_path: Path) -> None:
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


def test_a_legitimate_report_still_pins_what_its_replica_serves_and_obtains(any_store: Store, tmp_path: Path) -> None:
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
    with caplog.at_level(logging.WARNING, logger="rlfleet.trainer.publisher"):
        first = publisher.publish(tiny_state(0), version=0)
        second = publisher.publish(tiny_state(1), version=1)
    assert sorted(first.manifest.views) == sorted(second.manifest.views) == ["bf16"]
    assert store.list("v1/fp8/") == []
    refused = [r.getMessage() for r in caplog.records if "names view 'fp8'" in r.getMessage()]
    assert refused == ["a subscriber report names view 'fp8', which this job does not publish (its views: bf16): ignored"]
    # a view the job has is still followed (allowed but not configured here: a tool's publisher)
    follower = WeightPublisher(store, views=["bf16"], base_checkpoint=tiny_qwen3_dir, allowed_views=["bf16", "fp8"])
    assert sorted(follower.publish(tiny_state(2), version=2).manifest.views) == ["bf16", "fp8"]
