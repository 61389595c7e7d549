"""One writer per channel: the writer lease (`lease.json`, compare-and-swapped like the pointer) on every
store kind (filesystem, S3 with conditional writes, S3 lock-free), and the publisher that renews it."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import pytest
from test_weights_channel import make_view

from rlfleet.channel import (
    LEASE_KEY,
    LeaseHeldError,
    LeaseLostError,
    VersionConflictError,
    WeightChannel,
    WriterLease,
)
from rlfleet.store import Store
from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model
from rlfleet.trainer.publish.publisher import WeightPublisher


def stored_lease(store: Store) -> WriterLease:
    value = store.read_pointer(LEASE_KEY)  # a pointer object (lock-free S3: the newest entry of its log)
    assert value is not None
    return WriterLease.from_bytes(value.data)


def test_a_second_writer_is_refused_naming_the_first_and_a_restart_takes_over(
    any_store: Store, tmp_path: Path
) -> None:
    """Another id is refused while the lease is fresh, with the holder and its last renewal in the message;
    the same id (a restarted trainer) takes it over at once, as a new generation that fences the old
    incarnation: its next publish and renewal fail, and the pointer stays where the new one put it."""
    view = {"bf16": make_view(tmp_path / "bf16", "bf16", "x")}
    first = WeightChannel(any_store, publisher_id="trainer/ns/a")
    lease = first.acquire_lease()
    assert (lease.holder, lease.generation, lease.ttl_seconds) == ("trainer/ns/a", 1, 300.0)
    assert first.publish(view, version=0).advanced

    other = WeightChannel(any_store, publisher_id="trainer/ns/b")
    with pytest.raises(LeaseHeldError) as refused:
        other.acquire_lease()
    message = str(refused.value)
    # the age is the store's (S3: whole seconds, so 0 or 1 here)
    assert re.search(
        rf"is written by 'trainer/ns/a' \(generation 1, last renewed {re.escape(lease.renewed_at)}, [01]s ago",
        message,
    )
    assert any_store.uri in message and "this is 'trainer/ns/b'" in message
    assert stored_lease(any_store) == lease  # the refusal changed nothing

    restarted = WeightChannel(any_store, publisher_id="trainer/ns/a")
    assert restarted.acquire_lease().generation == 2
    with pytest.raises(
        LeaseLostError,
        match=r"generation 1 of 'trainer/ns/a'\) was taken over by 'trainer/ns/a' \(generation 2",
    ):
        first.publish(view, version=1)
    with pytest.raises(LeaseLostError):
        first.renew_lease()
    assert any_store.list("claims/") == ["claims/v0"]  # fenced before claiming
    assert restarted.publish(view, version=1).advanced
    assert restarted.renew_lease().generation == 2
    pointer = restarted.latest()
    assert pointer is not None and (pointer.version, pointer.publisher) == (1, "trainer/ns/a")


def test_an_expired_lease_is_taken_over_with_the_stale_claims_of_its_holder(
    any_store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder that stopped renewing (killed between its claim of v2 and the pointer) loses the lease after
    its TTL; the new holder takes over its claim above the pointer (the partial bytes go), publishes v2, and
    the old holder, back, is fenced."""
    view = {"bf16": make_view(tmp_path / "bf16", "bf16", "x")}
    old = WeightChannel(any_store, publisher_id="trainer/ns/old")
    old.acquire_lease(ttl_seconds=1.0)
    old.publish(view, version=1)
    assert any_store.create("claims/v2", b"trainer/ns/old")  # its publish of v2, interrupted
    any_store.put("v2/bf16/partial.bin", b"half")
    new = WeightChannel(any_store, publisher_id="trainer/ns/new")
    with pytest.raises(LeaseHeldError, match="'trainer/ns/old'"):
        new.acquire_lease()
    time.sleep(2.2)  # the TTL the old holder set passes without a renewal (S3 tells ages in whole seconds)
    with caplog.at_level(logging.WARNING, logger="rlfleet.channel"):
        assert new.acquire_lease().generation == 2
        assert new.publish(view, version=2).advanced
    assert any("took over the writer lease of 'trainer/ns/old'" in r.getMessage() for r in caplog.records)
    assert any("taking over the claim of 'trainer/ns/old'" in r.getMessage() for r in caplog.records)
    assert any_store.get("claims/v2") == b"trainer/ns/new"
    assert "v2/bf16/partial.bin" not in any_store.list("v2/")
    new.obtain_view(2, "bf16", tmp_path / "dl")  # every file verifies
    with pytest.raises(LeaseLostError, match="'trainer/ns/new'"):
        old.publish(view, version=3)
    # without the lease, another id's claim above the pointer is still refused (rlfleet/channel.py)
    assert any_store.create("claims/v5", b"trainer/ns/new")
    with pytest.raises(VersionConflictError, match="claimed by publisher 'trainer/ns/new'"):
        WeightChannel(any_store, publisher_id="tool").publish(view, version=5)


def test_the_publisher_renews_its_lease_until_closed(any_store: Store, tiny_qwen3_dir: Path) -> None:
    """WeightPublisher(writer_lease_ttl_seconds=T) takes the lease when it is made and renews it every T/5
    from a thread: past T another id is still refused; once closed, the lease expires, another id takes
    it and the closed publisher's next publish raises LeaseLostError."""
    state = dict(tiny_model(TinyQwen3(seed=0)).state_dict())
    publisher = WeightPublisher(
        any_store,
        views=["bf16"],
        keep_versions=None,
        base_checkpoint=tiny_qwen3_dir,
        publisher_id="trainer/ns/a",
        writer_lease_ttl_seconds=1.0,
    )
    try:
        first = stored_lease(any_store)
        time.sleep(1.5)
        with pytest.raises(LeaseHeldError, match="'trainer/ns/a'"):
            WeightChannel(any_store, publisher_id="trainer/ns/b").acquire_lease()
        renewed = stored_lease(any_store)
        assert renewed.generation == first.generation and renewed.renewed_at > first.renewed_at
        assert publisher.publish(state, version=0).advanced
    finally:
        publisher.close()
    time.sleep(2.5)  # past the TTL by the store's clock (whole seconds on S3)
    WeightChannel(any_store, publisher_id="trainer/ns/b").acquire_lease()
    with pytest.raises(LeaseLostError, match="taken over by 'trainer/ns/b'"):
        publisher.publish(state, version=1)


def test_the_pointer_refuses_an_older_generation_even_past_its_lease_check(
    any_store: Store, tmp_path: Path
) -> None:
    """The fence's last line: the pointer records the lease generation that moved it, and its
    compare-and-swap never lowers it. A writer paused between its lease check and its pointer swap (here:
    its check passes, as it did just before the takeover) cannot move the pointer once the new holder
    has: LeaseLostError naming the newer generation; its version stays unnamed. An unreadable lease does
    not restart the count: the next acquire continues from the pointer's generation."""
    view = {"bf16": make_view(tmp_path / "bf16", "bf16", "x")}
    old = WeightChannel(any_store, publisher_id="trainer/ns/old")
    old.acquire_lease(ttl_seconds=0.5)
    old.publish(view, version=1)
    time.sleep(1.1)  # past its TTL by the store's clock (whole seconds on S3)
    new = WeightChannel(any_store, publisher_id="trainer/ns/new")
    assert new.acquire_lease().generation == 2
    assert new.publish(view, version=2).advanced
    old._check_lease = lambda: None  # type: ignore[method-assign,assignment,return-value]  # paused past its check
    with pytest.raises(
        LeaseLostError, match=r"moved by writer lease generation 2 \('trainer/ns/new'\); this is generation 1"
    ):
        old.publish(view, version=3)
    pointer = new.latest()
    assert pointer is not None and (pointer.version, pointer.publisher, pointer.lease_generation) == (
        2,
        "trainer/ns/new",
        2,
    )
    value = any_store.read_pointer(LEASE_KEY)
    assert value is not None and any_store.compare_and_swap(LEASE_KEY, value.token, b"not json")
    assert WeightChannel(any_store, publisher_id="trainer/ns/new").acquire_lease().generation == 3
