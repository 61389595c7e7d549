"""Weight channel: versions, manifests, checksums, pointer, retention, racing publishers, status.

Runs against a real directory and a real S3-compatible server (moto_server process)."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import blake3
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from rlfleet.channel import (
    POINTER_KEY,
    SUBSCRIBER_HEARTBEAT_SECONDS,
    SUBSCRIBER_STALE_AFTER_SECONDS,
    ChannelError,
    ChecksumMismatchError,
    DeltaSource,
    SubscriberReport,
    UnknownDigestError,
    VersionConflictError,
    WeightChannel,
    group_versions,
    manifest_key,
    read_channel_status,
    report_age_seconds,
    report_is_fresh,
    subscribers_to_remove,
)
from rlfleet.deltas import encode_delta
from rlfleet.store import FileDigest, FilesystemStore, Store, StoreError


def make_view(directory: Path, view: str, tag: str, *, rows: int = 8) -> Path:
    """A small view directory: one safetensors file whose values encode `tag`, plus a config."""
    directory.mkdir(parents=True, exist_ok=True)
    seed = int(hashlib.sha256(tag.encode()).hexdigest()[:8], 16)
    rng = np.random.default_rng(seed)
    save_file(
        {
            "model.layers.0.mlp.up_proj.weight": rng.standard_normal((rows, 16)).astype(np.float32),
            "model.norm.weight": np.ones(16, dtype=np.float32),
            "tag": np.frombuffer(tag.encode().ljust(64, b" "), dtype=np.uint8).copy(),
        },
        str(directory / "model.safetensors"),
    )
    (directory / "rlfleet_view.json").write_text(json.dumps({"view": view, "tag": tag}))
    return directory


def tag_of(view_dir: Path) -> str:
    return json.loads((view_dir / "rlfleet_view.json").read_text())["tag"]


def test_publish_download_roundtrip(any_store: Store, tmp_path: Path) -> None:
    channel = WeightChannel(any_store, publisher_id="p1")
    assert channel.latest() is None
    views = {
        "bf16": make_view(tmp_path / "a" / "bf16", "bf16", "a"),
        "fp8": make_view(tmp_path / "a" / "fp8", "fp8", "a", rows=4),
    }
    first = channel.publish(views)
    assert (first.version, first.advanced) == (0, True)
    second = channel.publish(
        {
            "bf16": make_view(tmp_path / "b" / "bf16", "bf16", "b"),
            "fp8": make_view(tmp_path / "b" / "fp8", "fp8", "b"),
        }
    )
    assert (second.version, second.advanced) == (1, True)
    pointer = channel.latest()
    assert pointer is not None and pointer.version == 1

    manifest = channel.manifest(0, expected_sha256=None)
    fp8 = manifest.views["fp8"]
    local = tmp_path / "a" / "fp8" / "model.safetensors"
    expected = blake3.blake3(local.read_bytes()).hexdigest()  # independently of rlfleet.store
    assert fp8.files["model.safetensors"] == FileDigest("blake3", expected, local.stat().st_size)
    raw = json.loads(any_store.get(manifest_key(0)))  # the stored format (docs/weights.md "Manifest")
    assert raw["format"] == "rlfleet.weights/v3"
    assert raw["views"]["fp8"]["files"]["model.safetensors"] == {
        "digest": f"blake3:{expected}",
        "bytes": local.stat().st_size,
    }
    assert fp8.tensors["model.layers.0.mlp.up_proj.weight"] == {"dtype": "F32", "shape": [4, 16]}
    assert fp8.tensors["tag"] == {"dtype": "U8", "shape": [64]}

    out = channel.obtain_view(1, "bf16", tmp_path / "dl" / "v1-bf16").directory
    assert tag_of(out) == "b"
    assert (out / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "bf16" / "model.safetensors"
    ).read_bytes()
    assert channel.versions() == [0, 1]


def test_tampered_file_is_refused_and_nothing_is_left(any_store: Store, tmp_path: Path) -> None:
    channel = WeightChannel(any_store)
    channel.publish({"bf16": make_view(tmp_path / "bf16", "bf16", "x")})
    key = "v0/bf16/model.safetensors"
    data = bytearray(any_store.get(key))
    data[-1] ^= 0xFF  # one flipped bit in the tensor bytes
    any_store.put(key, bytes(data))
    dest = tmp_path / "dl" / "v0"
    with pytest.raises(
        ChecksumMismatchError, match=r"model.safetensors: blake3:\w{12}.. .* != manifest blake3:"
    ):
        channel.obtain_view(0, "bf16", dest)
    assert not dest.exists()
    assert not list((tmp_path / "dl").iterdir())  # no partial directory either


def _rewrite_entry(store: Store, version: int, digest: str) -> None:
    """Replace the bf16 weights' manifest entry digest (as a publisher writing `digest` would)."""
    raw = json.loads(store.get(manifest_key(version)))
    raw["views"]["bf16"]["files"]["model.safetensors"]["digest"] = digest
    store.put(manifest_key(version), json.dumps(raw).encode())


def test_unknown_digest_algorithm_is_refused(any_store: Store, tmp_path: Path) -> None:
    """A manifest entry naming an algorithm the reader cannot verify is refused when the manifest is
    read (UnknownDigestError is a ChecksumMismatchError: the sidecar counts it as "checksum")."""
    channel = WeightChannel(any_store)
    channel.publish({"bf16": make_view(tmp_path / "bf16", "bf16", "x")})
    local = tmp_path / "bf16" / "model.safetensors"
    _rewrite_entry(any_store, 0, "md5:" + hashlib.md5(local.read_bytes()).hexdigest())
    with pytest.raises(UnknownDigestError, match=r"unknown digest algorithm 'md5' .*blake3, sha256"):
        channel.manifest(0)
    with pytest.raises(ChecksumMismatchError, match="model.safetensors"):
        channel.obtain_view(0, "bf16", tmp_path / "dl" / "v0")
    assert not (tmp_path / "dl").exists() or not list((tmp_path / "dl").iterdir())
    _rewrite_entry(any_store, 0, "blake3:" + "0" * 63)  # known algorithm, malformed hex
    with pytest.raises(ChannelError, match="not blake3:<64 hex digits>"):
        channel.manifest(0)


def test_an_entry_verifies_with_the_algorithm_it_names(any_store: Store, tmp_path: Path) -> None:
    """sha256 is a known algorithm: an entry naming it is verified with sha256 (right: accepted,
    one flipped bit: refused); verification follows the entry, not a fixed algorithm."""
    channel = WeightChannel(any_store)
    channel.publish({"bf16": make_view(tmp_path / "bf16", "bf16", "x")})
    data = (tmp_path / "bf16" / "model.safetensors").read_bytes()
    _rewrite_entry(any_store, 0, "sha256:" + hashlib.sha256(data).hexdigest())
    out = channel.obtain_view(0, "bf16", tmp_path / "dl" / "ok").directory
    assert (out / "model.safetensors").read_bytes() == data
    wrong = bytearray(hashlib.sha256(data).digest())
    wrong[0] ^= 1
    _rewrite_entry(any_store, 0, "sha256:" + wrong.hex())
    with pytest.raises(ChecksumMismatchError, match="sha256:"):
        channel.obtain_view(0, "bf16", tmp_path / "dl" / "bad")
    assert not (tmp_path / "dl" / "bad").exists()


def test_digests_from_the_writer_are_used_and_still_verified(any_store: Store, tmp_path: Path) -> None:
    """publish(digests=...) trusts the writer's BLAKE3 digest (no second read); a wrong one is refused
    by the reader's verification, and a size that disagrees with the file is refused at publish."""
    view = make_view(tmp_path / "bf16", "bf16", "x")
    weights = view / "model.safetensors"
    size = weights.stat().st_size
    channel = WeightChannel(any_store)
    with pytest.raises(StoreError, match="digest says"):
        channel.publish({"bf16": view}, digests={weights: FileDigest("blake3", "0" * 64, size + 1)})
    real = FileDigest("blake3", blake3.blake3(weights.read_bytes()).hexdigest(), size)
    result = channel.publish({"bf16": view}, digests={weights: real})
    assert result.manifest.views["bf16"].files["model.safetensors"] == real
    wrong = channel.publish({"bf16": view}, digests={weights: FileDigest("blake3", "0" * 64, size)})
    with pytest.raises(ChecksumMismatchError, match="model.safetensors"):
        channel.obtain_view(wrong.version, "bf16", tmp_path / "dl")


def test_tampered_manifest_is_refused(any_store: Store, tmp_path: Path) -> None:
    channel = WeightChannel(any_store)
    channel.publish({"bf16": make_view(tmp_path / "bf16", "bf16", "x")})
    pointer = channel.latest()
    assert pointer is not None
    raw = json.loads(any_store.get(manifest_key(0)))
    # an attacker rewrites the manifest (the pointer's manifest_sha256 no longer matches)
    raw["views"]["bf16"]["files"]["model.safetensors"]["digest"] = "blake3:" + "0" * 64
    any_store.put(manifest_key(0), json.dumps(raw).encode())
    with pytest.raises(ChecksumMismatchError, match="manifest"):
        channel.manifest(0, expected_sha256=pointer.manifest_sha256)


def test_explicit_versions_must_increase(tmp_path: Path) -> None:
    channel = WeightChannel(FilesystemStore(tmp_path / "s", create=True))
    view = {"bf16": make_view(tmp_path / "bf16", "bf16", "x")}
    assert channel.publish(view, version=5).version == 5
    with pytest.raises(VersionConflictError):
        channel.publish(view, version=5)
    with pytest.raises(VersionConflictError):
        channel.publish(view, version=3)
    assert channel.publish(view).version == 6
    pointer = channel.latest()
    assert pointer is not None and pointer.version == 6


def test_a_publisher_takes_over_only_its_own_claim_above_the_pointer(
    any_store: Store, tmp_path: Path
) -> None:
    """An interrupted publish left claims/v4 and partial bytes: the same publisher id publishes v4 again
    (stale files removed); another id is refused naming the holder; a claim at or below the pointer is
    never taken over."""
    view = {"bf16": make_view(tmp_path / "bf16", "bf16", "x")}
    WeightChannel(any_store, publisher_id="job-a").publish(view, version=3)
    any_store.create("claims/v4", b"job-a")
    any_store.put("v4/bf16/old.safetensors", b"partial")
    with pytest.raises(VersionConflictError, match="claimed by publisher 'job-a'"):
        WeightChannel(any_store, publisher_id="job-b").publish(view, version=4)
    assert WeightChannel(any_store, publisher_id="job-a").publish(view, version=4).version == 4
    assert "v4/bf16/old.safetensors" not in any_store.list("v4/")
    with pytest.raises(VersionConflictError, match="not above the published version 4"):
        WeightChannel(any_store, publisher_id="job-a").publish(view, version=4)


def test_publish_rejects_bad_input(tmp_path: Path) -> None:
    channel = WeightChannel(FilesystemStore(tmp_path / "s", create=True))
    with pytest.raises(ValueError):
        channel.publish({})
    with pytest.raises(ValueError, match="not a directory"):
        channel.publish({"bf16": tmp_path / "missing"})
    with pytest.raises(ValueError, match="invalid view"):
        channel.publish({"../x": make_view(tmp_path / "v", "bf16", "x")})
    assert channel.latest() is None


def test_retention_keeps_latest_and_what_subscribers_use(any_store: Store, tmp_path: Path) -> None:
    channel = WeightChannel(any_store)
    for i in range(6):
        channel.publish({"bf16": make_view(tmp_path / str(i), "bf16", str(i))})
    # an abandoned publish (claim + partial bytes, no manifest) below the pointer
    any_store.create("claims/v2", b"dead")  # already claimed by the real v2: returns False, fine
    channel.report(SubscriberReport("h100-fp8", "pod-a", "bf16", applied_version=1, in_use=[1]))
    channel.report(SubscriberReport("b200-nvfp4", "pod-b", "bf16", applied_version=5, in_use=[5]))
    deleted = channel.retain(keep=2)
    assert deleted == [0, 2, 3]
    assert channel.versions() == [1, 4, 5]
    assert [k for k in any_store.list("claims/")] == ["claims/v1", "claims/v4", "claims/v5"]
    assert tag_of(channel.obtain_view(1, "bf16", tmp_path / "dl1").directory) == "1"
    # the subscriber moves on: v1 is no longer protected
    channel.report(SubscriberReport("h100-fp8", "pod-a", "bf16", applied_version=5, in_use=[5]))
    assert channel.retain(keep=2) == [1]
    pointer = channel.latest()
    assert pointer is not None and pointer.version == 5


def test_retention_removes_abandoned_partial_versions(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path / "s", create=True)
    channel = WeightChannel(store)
    channel.publish({"bf16": make_view(tmp_path / "0", "bf16", "0")})
    store.create("claims/v1", b"killed publisher")
    store.put("v1/bf16/model.safetensors", b"half")
    channel.publish({"bf16": make_view(tmp_path / "2", "bf16", "2")})
    assert channel.latest().version == 2  # type: ignore[union-attr]
    assert channel.versions() == [0, 2]
    assert channel.retain(keep=5) == [1]
    assert store.list("v1/") == [] and store.list("claims/v1") == []


@pytest.mark.parametrize("kind", ["filesystem", "s3-lock-free", "s3-conditional"])
def test_racing_publishers_monotonic_and_never_mixed(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Two publishers publish concurrently while a reader polls the pointer: every version is
    entirely one publisher's bytes, the pointer never goes backwards and ends at the highest version."""
    if kind == "filesystem":
        store: Store = FilesystemStore(tmp_path / "s", create=True)
    else:
        from support.moto import make_bucket

        from rlfleet.store import S3Store

        endpoint = request.getfixturevalue("s3_endpoint")
        store = S3Store(
            make_bucket(endpoint), endpoint_url=endpoint, conditional_writes=(kind == "s3-conditional")
        )
    rounds = 4
    results: dict[str, list[int]] = {"A": [], "B": []}
    seen: list[int] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def publisher(name: str) -> None:
        try:
            channel = WeightChannel(store, publisher_id=name)
            for i in range(rounds):
                views = {
                    v: make_view(tmp_path / name / str(i) / v, v, f"{name}-{i}") for v in ("bf16", "fp8")
                }
                results[name].append(channel.publish(views).version)
        except BaseException as e:  # surfaced below
            errors.append(e)

    def reader() -> None:
        channel = WeightChannel(store)
        while not stop.is_set():
            pointer = channel.latest()
            if pointer is not None:
                seen.append(pointer.version)

    threads = [threading.Thread(target=publisher, args=(n,)) for n in "AB"]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    watcher.join(10)
    assert not errors, errors
    all_versions = results["A"] + results["B"]
    assert len(set(all_versions)) == 2 * rounds  # every publish got its own number
    for name in "AB":
        assert results[name] == sorted(results[name])
    assert seen == sorted(seen)  # the pointer never went backwards
    channel = WeightChannel(store)
    assert channel.latest().version == max(all_versions)  # type: ignore[union-attr]
    for version in all_versions:
        manifest = channel.manifest(version)
        owner = manifest.publisher
        assert version in results[owner]
        tags = {
            tag_of(channel.obtain_view(version, v, tmp_path / "dl" / f"{version}-{v}").directory)
            for v in ("bf16", "fp8")
        }
        assert len(tags) == 1 and tags.pop().startswith(f"{owner}-")  # one publisher's bytes only


def test_channel_status_for_the_operator(any_store: Store, tmp_path: Path) -> None:
    channel = WeightChannel(any_store)
    empty = read_channel_status(any_store)
    assert empty.latest_version is None and empty.artifacts == [] and empty.groups == []
    for i in range(3):
        channel.publish({v: make_view(tmp_path / str(i) / v, v, str(i)) for v in ("bf16", "nvfp4")})
    channel.report(SubscriberReport("h100", "pod-0", "bf16", applied_version=2, in_use=[2]))
    channel.report(SubscriberReport("h100", "pod-1", "bf16", applied_version=1, in_use=[1, 2]))
    channel.report(
        SubscriberReport(
            "b200", "pod-0", "nvfp4", applied_version=None, in_use=[], failures=3, last_error="checksum"
        )
    )
    status = read_channel_status(any_store)
    assert status.latest_version == 2
    assert [a.view for a in status.artifacts] == ["bf16", "nvfp4"]
    manifest = channel.manifest(2)
    for artifact in status.artifacts:
        assert artifact.version == 2
        assert artifact.bytes == sum(e.bytes for e in manifest.views[artifact.view].files.values()) > 0
        assert artifact.sha256 == manifest.views[artifact.view].sha256 and len(artifact.sha256) == 64
        assert artifact.uri.endswith(f"v2/{artifact.view}")
        assert (artifact.kind, artifact.base, artifact.stored_bytes) == ("anchor", None, artifact.bytes)
    assert status.stored_share == 1.0
    groups = {g.group: g for g in status.groups}
    assert (groups["h100"].applied_version, groups["h100"].lag, groups["h100"].view) == (1, 1, "bf16")
    assert groups["h100"].replicas == {"pod-0": 2, "pod-1": 1}
    assert (groups["b200"].applied_version, groups["b200"].lag) == (None, None)
    assert status.retained_versions == [0, 1, 2]
    assert json.dumps(status.to_dict())  # plain data, serialisable
    assert any_store.read_pointer(POINTER_KEY) is not None


def test_channel_status_reports_each_views_kind_and_stored_bytes(any_store: Store, tmp_path: Path) -> None:
    """The latest version's bf16 view stored as a delta (one element changed), its fp8 view whole: status
    says which, the bytes the channel holds for each (the delta payload and the files stored whole) beside
    the complete view's, and the share stored over the two views."""
    channel = WeightChannel(any_store)
    v0 = {v: make_view(tmp_path / "0" / v, v, "a", rows=256) for v in ("bf16", "fp8")}
    channel.publish(v0)
    v1 = {v: Path(shutil.copytree(v0[v], tmp_path / "1" / v)) for v in v0}
    weights = v1["bf16"] / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one element of the last tensor
    weights.write_bytes(bytes(data))
    payload = tmp_path / "model.safetensors.delta"
    stats = encode_delta(v0["bf16"] / "model.safetensors", weights, payload)
    assert stats is not None and stats.changed_elements == 1
    channel.publish(v1, deltas={"bf16": DeltaSource(0, {"model.safetensors": payload})})
    status = read_channel_status(any_store)
    manifest = channel.manifest(1)
    bf16, fp8 = status.artifacts
    full_bf16 = weights.stat().st_size + (v1["bf16"] / "rlfleet_view.json").stat().st_size
    stored_bf16 = payload.stat().st_size + (v1["bf16"] / "rlfleet_view.json").stat().st_size
    assert (bf16.view, bf16.kind, bf16.base, bf16.bytes, bf16.stored_bytes) == (
        "bf16",
        "delta",
        0,
        full_bf16,
        stored_bf16,
    )
    assert bf16.bytes == manifest.views["bf16"].bytes and bf16.stored_bytes < bf16.bytes / 10
    assert (fp8.view, fp8.kind, fp8.base, fp8.stored_bytes) == ("fp8", "anchor", None, fp8.bytes)
    assert status.stored_share == (stored_bf16 + fp8.bytes) / (full_bf16 + fp8.bytes)
    assert json.loads(json.dumps(status.to_dict()))["artifacts"][0]["kind"] == "delta"


def test_group_versions_ignores_stale_replicas() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    fresh = (now - timedelta(seconds=5)).isoformat()
    old = (now - timedelta(hours=1)).isoformat()
    reports = [
        SubscriberReport("g", "a", "fp8", 7, [7], updated_at=fresh),
        SubscriberReport("g", "dead", "fp8", 2, [2], updated_at=old),
    ]
    [with_stale] = group_versions(reports, 9, now=now)
    assert (with_stale.applied_version, with_stale.lag) == (2, 7)
    [fresh_only] = group_versions(reports, 9, stale_after_seconds=60, now=now)
    assert (fresh_only.applied_version, fresh_only.lag, fresh_only.replicas) == (7, 2, {"a": 7})


def test_group_versions_sum_failures_and_keep_the_newest_error_of_fresh_replicas() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    at = lambda s: (now - timedelta(seconds=s)).isoformat()  # noqa: E731
    reports = [
        SubscriberReport(
            "g", "a", "nvfp4", 7, [7], updated_at=at(20), failures=1, last_error="checksum: v8 old"
        ),
        SubscriberReport(
            "g", "b", "nvfp4", 7, [7], updated_at=at(5), failures=2, last_error="checksum: v8 new"
        ),
        SubscriberReport("g", "c", "nvfp4", 8, [8], updated_at=at(1), failures=0),
        SubscriberReport(
            "g", "gone", "nvfp4", 2, [2], updated_at=at(3600), failures=9, last_error="store: old"
        ),
    ]
    [g] = group_versions(reports, 8, stale_after_seconds=60, now=now)
    assert (g.sync_failures, g.last_error) == (3, "checksum: v8 new")
    [clean] = group_versions(reports[2:3], 8, stale_after_seconds=60, now=now)
    assert (clean.sync_failures, clean.last_error) == (0, None)


NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def aged(seconds: float) -> str:
    """An `updated_at` that is `seconds` old at NOW."""
    return (NOW - timedelta(seconds=seconds)).isoformat()


def report(group: str, replica: str, updated_at: str, applied: int | None = 1) -> SubscriberReport:
    return SubscriberReport(
        group, replica, "fp8", applied, [] if applied is None else [applied], updated_at=updated_at
    )


def test_the_age_out_bound_is_five_heartbeats() -> None:
    assert SUBSCRIBER_HEARTBEAT_SECONDS == 30.0 and SUBSCRIBER_STALE_AFTER_SECONDS == 150.0


@pytest.mark.parametrize(
    ("updated_at", "age"),
    [
        (aged(12.5), 12.5),
        ("2026-01-01T11:59:00Z", 60.0),  # Z suffix
        ("2026-01-01T11:58:00+00:00", 120.0),
        ("2026-01-01T13:58:00+02:00", 120.0),  # another zone, same instant
        ("2026-01-01T11:57:00", 180.0),  # no zone: UTC
        ("2026-01-01T12:00:30+00:00", 0.0),  # the writer's clock is ahead: counts as now, never fresher
        ("", float("inf")),  # undated: infinitely old
        ("yesterday", float("inf")),
    ],
)
def test_report_age(updated_at: str, age: float) -> None:
    assert report_age_seconds(report("g", "r", updated_at), NOW) == age


def test_report_is_fresh_up_to_the_bound_inclusive() -> None:
    assert report_is_fresh(report("g", "r", aged(150)), NOW, 150)
    assert not report_is_fresh(report("g", "r", aged(150.001)), NOW, 150)
    assert report_is_fresh(report("g", "r", aged(-5)), NOW, 150)
    assert not report_is_fresh(report("g", "r", ""), NOW, 150)


def test_subscribers_to_remove_exactly_the_aged_reports_of_replicas_that_are_no_live_pod() -> None:
    reports = [
        report("job-h100", "live-old", aged(3600)),  # a live pod whose sidecar cannot write: kept
        report("job-h100", "live-fresh", aged(1)),
        report("job-h100", "gone-old", aged(151)),  # replaced pod: removed
        report("job-h100", "gone-at-bound", aged(150)),  # not older than the bound yet: kept
        report("job-h100", "newborn", aged(2)),  # a pod the index has not seen yet: kept
        report("job-h100", "undated", ""),  # no pod, no date: removed
        report("job-removed", "pod-a", aged(900)),  # a group the index has no pods of: removed
        report("job-removed", "pod-b", aged(30)),  # ... unless fresh
        report("job-b200", "live-old", aged(900)),  # the same name in another group is another replica
    ]
    live = {"job-h100": frozenset({"live-old", "live-fresh", "terminating"}), "job-b200": frozenset()}
    removed = subscribers_to_remove(reports, live, NOW, stale_after_seconds=150)
    assert [(r.group, r.replica) for r in removed] == [
        ("job-b200", "live-old"),
        ("job-h100", "gone-old"),
        ("job-h100", "undated"),
        ("job-removed", "pod-a"),
    ]
    # the default bound is SUBSCRIBER_STALE_AFTER_SECONDS
    assert subscribers_to_remove(reports, live, NOW) == removed
    # a longer bound keeps every dated report; an undated one is infinitely old
    assert [r.replica for r in subscribers_to_remove(reports, live, NOW, stale_after_seconds=10_000)] == [
        "undated"
    ]
    assert subscribers_to_remove([], {}, NOW) == []


def test_group_versions_count_only_fresh_reports() -> None:
    reports = [
        report("g", "fresh", aged(149), applied=7),
        report("g", "dead", aged(151), applied=2),
        report("g", "undated", "", applied=1),
        report("only-dead", "x", aged(3600), applied=0),
    ]
    everything = {g.group: g for g in group_versions(reports, 9, now=NOW)}
    assert (everything["g"].applied_version, everything["g"].lag) == (1, 8)
    assert everything["only-dead"].applied_version == 0
    [fresh] = group_versions(reports, 9, stale_after_seconds=150, now=NOW)
    assert (fresh.group, fresh.applied_version, fresh.lag, fresh.replicas) == ("g", 7, 2, {"fresh": 7})


def test_retain_deletes_a_version_only_an_aged_out_report_pinned(any_store: Store, tmp_path: Path) -> None:
    channel = WeightChannel(any_store)
    for i in range(5):
        channel.publish({"bf16": make_view(tmp_path / str(i), "bf16", str(i))})
    now = datetime.now(UTC)
    dead = SubscriberReport(
        "g", "gone", "bf16", 1, [1, 2], updated_at=(now - timedelta(seconds=151)).isoformat()
    )
    live = SubscriberReport(
        "g", "live", "bf16", 2, [2], updated_at=(now - timedelta(seconds=149)).isoformat()
    )
    channel.report(dead)
    channel.report(live)
    # without the bound every report pins: v1 stays for the dead replica
    assert channel.retain(keep=2, stale_after_seconds=None, now=now) == [0]
    assert channel.versions() == [1, 2, 3, 4]
    # with it (the default), v1 goes: only the aged-out report pinned it; v2 stays (the fresh one uses it)
    assert channel.retain(keep=2, now=now) == [1]
    assert channel.versions() == [2, 3, 4]
    assert any_store.list("v1/") == [] and any_store.list("claims/v1") == []
    assert tag_of(channel.obtain_view(2, "bf16", tmp_path / "dl2").directory) == "2"
    # once the live report ages out too, v2 goes as well (keep=2 keeps v3 and v4)
    later = now + timedelta(seconds=2)
    assert channel.retain(keep=2, now=later) == [2]
    assert channel.versions() == [3, 4]


def test_remove_subscriber_only_deletes_the_report_that_was_judged(any_store: Store) -> None:
    channel = WeightChannel(any_store)
    judged = SubscriberReport("g", "pod-a", "bf16", 1, [1], updated_at=aged(600))
    channel.report(judged)
    channel.report(SubscriberReport("g", "pod-b", "bf16", 1, [1], updated_at=aged(600)))
    # pod-a's sidecar rewrote its report after the operator read it: not deleted
    channel.report(SubscriberReport("g", "pod-a", "bf16", 2, [2], updated_at=aged(1)))
    assert channel.remove_subscriber("g", "pod-a", if_updated_at=judged.updated_at) is False
    assert sorted(r.replica for r in channel.subscribers()) == ["pod-a", "pod-b"]
    assert channel.remove_subscriber("g", "pod-b", if_updated_at=aged(600)) is True
    assert [r.replica for r in channel.subscribers()] == ["pod-a"]
    assert any_store.list("subscribers/g/pod-b") == []
    assert channel.remove_subscriber("g", "pod-b", if_updated_at=aged(600)) is False  # already gone
    assert channel.remove_subscriber("g", "pod-a") is True  # unguarded
    assert channel.subscribers() == []


def test_channel_status_ages_reports_out_with_the_bound(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path / "s", create=True)
    channel = WeightChannel(store)
    for i in range(3):
        channel.publish({"bf16": make_view(tmp_path / str(i), "bf16", str(i))})
    channel.report(report("g", "gone", aged(600), applied=0))
    channel.report(report("g", "live", aged(10), applied=2))
    [frozen] = read_channel_status(store, now=NOW).groups
    assert (frozen.applied_version, frozen.lag) == (0, 2)  # what a dead replica did before the bound
    status = read_channel_status(store, stale_after_seconds=SUBSCRIBER_STALE_AFTER_SECONDS, now=NOW)
    [group] = status.groups
    assert (group.applied_version, group.lag, group.replicas) == (2, 0, {"live": 2})
    assert sorted(r.replica for r in status.subscribers) == ["gone", "live"]  # listed, not counted


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("publish"), st.integers(0, 3)),  # 0: next number, else explicit latest + n
            st.tuples(st.just("report"), st.integers(0, 2), st.integers(0, 50)),  # replica, which version
            st.tuples(st.just("retain"), st.integers(1, 3)),  # keep
        ),
        min_size=1,
        max_size=12,
    )
)
def test_property_publish_report_retain_invariants(ops: list[tuple], tmp_path: Path) -> None:
    """Any sequence of publishes, subscriber reports and retention keeps: the pointer at the highest
    published version, versions strictly increasing, the newest `keep` and every reported version
    present and verifiable, and nothing deleted that is still listed. (fsync off: invariants only.)"""
    import uuid

    root = tmp_path / uuid.uuid4().hex
    store = FilesystemStore(root, create=True, fsync=False)
    channel = WeightChannel(store)
    view = make_view(root.parent / f"{root.name}-view" / "bf16", "bf16", "p", rows=2)
    published: list[int] = []
    in_use: dict[int, int] = {}
    for op in ops:
        if op[0] == "publish":
            explicit = None if op[1] == 0 else (published[-1] if published else -1) + op[1]
            result = channel.publish({"bf16": view}, version=explicit)
            assert result.advanced and result.version > (published[-1] if published else -1)
            if explicit is not None:
                assert result.version == explicit
            published.append(result.version)
        elif op[0] == "report" and published:
            version = published[op[2] % len(published)]
            if version in channel.versions():  # a replica can only be using a version that exists
                in_use[op[1]] = version
                channel.report(SubscriberReport("g", f"r{op[1]}", "bf16", version, [version]))
        elif op[0] == "retain":
            before = channel.versions()
            deleted = channel.retain(keep=op[1])
            remaining = channel.versions()
            assert not set(deleted) & set(remaining)
            assert set(before[-op[1] :]) <= set(remaining)  # the newest `keep` survive
            assert set(in_use.values()) <= set(remaining)  # so does every reported version
            assert set(before) - set(remaining) == set(deleted)
        if published:
            pointer = channel.latest()
            assert pointer is not None and pointer.version == published[-1]
    for version in channel.versions():
        channel.obtain_view(version, "bf16", tmp_path / "dl" / uuid.uuid4().hex)  # verifies every sha256
