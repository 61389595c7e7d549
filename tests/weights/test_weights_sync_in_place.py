"""Loading in place (docs/weights.md): with a filesystem store the engine sees, the sidecar verifies every
file of a version where the channel holds it and hands the engine that directory; nothing is copied
into its cache. Verification is the same as a download's: one flipped bit is refused and the engine
keeps serving the previous version; retention keeps the served version while the replica reports it.

Real stores, the real publisher and the real sidecar against the recording SGLang-API engine of
test_weights_sync.py (its `/update_weights_from_disk` loads the directory it is given)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from test_weights_sync import (  # noqa: F401 - engine: fixture
    RecordingEngine,
    engine,
    expected_fp8,
    tiny_state,
)

from rlfleet.channel import ChannelError, WeightChannel
from rlfleet.sampler.engine_clients import DiskEngine
from rlfleet.sampler.launch_checkpoint import read_launch_file
from rlfleet.sampler.sync_state import SyncConfig
from rlfleet.sampler.syncer import Syncer
from rlfleet.store import FilesystemStore, S3Store
from rlfleet.trainer.publish.publisher import WeightPublisher


def in_place_syncer(
    store: FilesystemStore, engine_url: str, client: httpx.AsyncClient, cache: Path
) -> Syncer:
    config = SyncConfig(
        store=str(store.root),
        view="fp8",
        engine_url=engine_url,
        group="h100-fp8",
        replica="pod-0",
        cache_dir=cache,
        poll_interval=0.05,
        backoff_base=0.05,
        backoff_max=0.5,
        in_place=True,
    )
    return Syncer(config, store, DiskEngine(client))


def disk_updates(recording: RecordingEngine) -> list[tuple[str, str]]:
    return [
        (b["weight_version"], b["model_path"])
        for p, b in recording.requests
        if p == "/update_weights_from_disk"
    ]


def cache_files(cache: Path) -> list[str]:
    return sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file())


async def test_in_place_loads_the_channel_directory_and_refuses_a_flipped_bit(
    engine: RecordingEngine,  # noqa: F811 - the fixture
    tmp_path: Path,
    tiny_qwen3_dir: Path,
) -> None:
    root, cache = tmp_path / "store", tmp_path / "cache"
    store = FilesystemStore(root, create=True)
    publisher = WeightPublisher(store, views=["bf16", "fp8"], base_checkpoint=tiny_qwen3_dir)
    first = tiny_state(1)
    publisher.publish(first)
    async with httpx.AsyncClient(base_url=engine.url) as client:
        syncer = in_place_syncer(store, engine.url, client, cache)
        assert await syncer.reconcile_once() is True
        # the engine loaded the channel's own directory, and got exactly the published fp8 view
        assert disk_updates(engine) == [("0", str(root / "v0" / "fp8"))]
        assert engine.weights is not None
        for name, expected in expected_fp8(first).items():
            assert torch.equal(engine.weights[name], expected), name
        assert read_launch_file(cache) == (0, root / "v0" / "fp8")
        assert cache_files(cache) == ["launch"]  # no copy: only the launch file
        assert syncer.status()["in_place"] is True

        publisher.publish(tiny_state(2))
        shard = root / "v1" / "fp8" / "model.safetensors"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01  # one flipped bit inside the tensor bytes, in the channel itself
        shard.write_bytes(bytes(data))
        for attempt in (1, 2):
            assert await syncer.reconcile_once() is False
            assert syncer.state.failures["checksum"] == attempt
        assert (
            "model.safetensors" in (syncer.state.last_error or "") and "checksum" in syncer.state.last_error
        )
        # refused before the engine saw it: still serving v0's weights, launching from v0
        assert disk_updates(engine) == [("0", str(root / "v0" / "fp8"))] and engine.version == "0"
        assert torch.equal(
            engine.weights["lm_head.weight"], first["lm_head.weight"].to(torch.bfloat16).float()
        )
        assert read_launch_file(cache) == (0, root / "v0" / "fp8")
        [report] = WeightChannel(store).subscribers()
        assert (report.applied_version, report.in_use) == (0, [0])  # v0 stays pinned while served

        publisher.publish(tiny_state(3))  # the trainer moves on: v2 is clean
        assert await syncer.reconcile_once() is True
        assert disk_updates(engine)[-1] == ("2", str(root / "v2" / "fp8"))
        assert cache_files(cache) == ["launch"]


async def test_in_place_retention_keeps_the_served_version(
    engine: RecordingEngine,  # noqa: F811 - the fixture
    tmp_path: Path,
    tiny_qwen3_dir: Path,
) -> None:
    """keep_versions=1 would delete v0 at the next publish; the replica serving it in place reports it
    (applied), so it stays, complete and verifiable, until the replica has moved on."""
    root = tmp_path / "store"
    store = FilesystemStore(root, create=True)
    publisher = WeightPublisher(store, views=["fp8"], keep_versions=1, base_checkpoint=tiny_qwen3_dir)
    publisher.publish(tiny_state(1))
    async with httpx.AsyncClient(base_url=engine.url) as client:
        syncer = in_place_syncer(store, engine.url, client, tmp_path / "cache")
        assert await syncer.reconcile_once() is True
        engine.fail_next["/update_weights_from_disk"] = 1  # v1 fails to apply: the replica keeps v0
        publisher.publish(tiny_state(2))
        assert await syncer.reconcile_once() is False and syncer.state.applied_version == 0
        publisher.publish(tiny_state(3))  # retention runs: v1 is no one's, v0 is served
        channel = WeightChannel(store)
        assert channel.versions() == [0, 2]
        assert channel.verify_view_in_place(0, "fp8") == root / "v0" / "fp8"
        assert await syncer.reconcile_once() is True and syncer.state.applied_version == 2
        publisher.publish(tiny_state(4))  # now v0 is released
        assert channel.versions() == [2, 3]


def test_verify_in_place_refuses_an_unlisted_file_and_a_non_filesystem_store(
    tmp_path: Path, tiny_qwen3_dir: Path, s3_endpoint: str, s3_bucket: str
) -> None:
    """The engine loads the whole directory, so a file the manifest does not vouch for is refused; an
    S3 store has no directory to load."""
    root = tmp_path / "store"
    store = FilesystemStore(root, create=True)
    WeightPublisher(store, views=["fp8"], base_checkpoint=tiny_qwen3_dir).publish(tiny_state(1))
    channel = WeightChannel(store)
    assert channel.verify_view_in_place(0, "fp8") == root / "v0" / "fp8"
    (root / "v0" / "fp8" / "extra.safetensors").write_bytes(b"not in the manifest")
    with pytest.raises(ChannelError, match=r"does not list: \['extra.safetensors'\]"):
        channel.verify_view_in_place(0, "fp8")
    s3 = S3Store(s3_bucket, "job", endpoint_url=s3_endpoint, conditional_writes=False)
    with pytest.raises(ChannelError, match="not a filesystem store"):
        WeightChannel(s3).verify_view_in_place(0, "fp8", manifest=channel.manifest(0))


async def test_in_place_loads_anchors_where_they_are_and_rebuilds_deltas_into_the_cache(
    engine: RecordingEngine,  # noqa: F811 - the fixture
    tmp_path: Path,
    tiny_qwen3_dir: Path,
) -> None:
    """A channel of anchors and deltas (test_weights_deltas_sync.py's DeltaPublisher): an anchor has a
    complete directory in the store and is loaded there; a delta version has none, so it is rebuilt into
    the cache (from the anchor, then from the copy of the version before) and the engine loads that copy.
    The bytes hashed in place count as anchor bytes read."""
    from test_weights_deltas_sync import DeltaPublisher, assert_bit_exact, assert_engine_serves

    root, cache = tmp_path / "store", tmp_path / "cache"
    store = FilesystemStore(root, create=True)
    publisher = DeltaPublisher(store, tmp_path / "published", tiny_qwen3_dir)
    expected = {
        0: (root / "v0" / "fp8", "anchor v0 in place"),
        1: (cache / "v1-fp8", "anchor v0 + delta v1"),
        2: (cache / "v2-fp8", "local v1 + delta v2"),
        3: (root / "v3" / "fp8", "anchor v3 in place"),
    }
    async with httpx.AsyncClient(base_url=engine.url) as client:
        syncer = in_place_syncer(store, engine.url, client, cache)
        for version, (directory, source) in expected.items():
            publisher.publish(version, anchor=version in (0, 3))
            assert await syncer.reconcile_once() is True
            assert disk_updates(engine)[-1] == (str(version), str(directory))
            assert_engine_serves(engine, publisher, version)
            assert_bit_exact(directory, publisher, version)
            assert syncer.status()["last_apply"]["source"] == source
            assert read_launch_file(cache) == (version, directory)
    v1_delta = publisher.manifests[1].views["fp8"].delta
    v2_delta = publisher.manifests[2].views["fp8"].delta
    assert v1_delta is not None and v2_delta is not None
    # v0 hashed in place, read again as v1's seed; v3 hashed in place; only payloads for v1 and v2
    assert syncer.status()["read_bytes"] == {
        "anchor": 2 * publisher.stored_bytes(0) + publisher.stored_bytes(3),
        "delta": v1_delta.bytes + v2_delta.bytes,
        "whole-file": 0,
    }
    assert sorted(p.name for p in cache.iterdir()) == ["launch", "v1-fp8", "v2-fp8"]
