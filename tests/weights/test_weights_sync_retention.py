"""Retention never deletes what is in use: the channel keeps every version a subscriber reports (in use
or applied), and the sync sidecar's local cache keeps the version SGLang serves and launches from.

Real stores and the real sidecar against the recording SGLang-API engine of test_weights_sync.py."""

from __future__ import annotations

from pathlib import Path

import httpx
from support.stub_views import stub_views
from test_weights_sync import RecordingEngine, engine, make_syncer, tiny_state  # noqa: F401 - engine: fixture

from rlfleet.channel import SubscriberReport, WeightChannel
from rlfleet.sampler.launch_checkpoint import read_launch_file
from rlfleet.store import FilesystemStore
from rlfleet.trainer.publish.publisher import WeightPublisher


def test_channel_retention_keeps_every_version_a_subscriber_uses(tmp_path: Path) -> None:
    """keep=1 would leave only the latest; the reports protect more: a replica switching from 2 to 6
    (in_use [2, 6]), a new replica downloading 3 (in_use [3], nothing applied yet), and a replica that
    reports only its applied version 4 (in_use empty). Exactly the unprotected old versions go."""
    channel = WeightChannel(FilesystemStore(tmp_path / "store", create=True))
    views = stub_views(tmp_path / "views")
    for version in range(7):
        channel.publish(views, version=version)
    channel.report(SubscriberReport("h100-fp8", "pod-a", "fp8", applied_version=6, in_use=[2, 6]))
    channel.report(SubscriberReport("h100-fp8", "pod-b", "fp8", applied_version=None, in_use=[3]))
    channel.report(SubscriberReport("a100-bf16", "pod-c", "bf16", applied_version=4, in_use=[]))
    assert channel.retain(keep=1) == [0, 1, 5]
    assert channel.versions() == [2, 3, 4, 6]
    for version in (2, 3, 4):  # still complete: downloadable by the replicas that need them
        assert set(channel.manifest(version).views) == {"bf16", "fp8"}
    # the reports move on: what they released goes, what they still name stays
    channel.report(SubscriberReport("h100-fp8", "pod-a", "fp8", applied_version=6, in_use=[6]))
    channel.report(SubscriberReport("h100-fp8", "pod-b", "fp8", applied_version=6, in_use=[6]))
    assert channel.retain(keep=1) == [2, 3]
    assert channel.versions() == [4, 6]


async def test_sidecar_cache_keeps_the_served_version_and_prunes_only_older_ones(
    engine: RecordingEngine,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    """After every apply: the version SGLang serves (and the launch file names, for a restarted engine)
    is in the cache, and the cache holds the newest `keep_local` versions, no more."""
    store = FilesystemStore(tmp_path / "store", create=True)
    publisher = WeightPublisher(store, views=["bf16", "fp8"])
    cache = tmp_path / "cache"
    async with httpx.AsyncClient(base_url=engine.url) as client:
        syncer = make_syncer(store, engine, client, tmp_path)
        keep = syncer.config.keep_local
        assert keep == 2
        for version in range(4):
            assert publisher.publish(tiny_state(version)).version == version
            assert await syncer.reconcile_once() is True
            assert engine.version == str(version)
            served = Path(engine.requests[-1][1]["model_path"])
            assert served == cache / f"v{version}-fp8" and any(served.glob("*.safetensors"))
            assert read_launch_file(cache) == (version, served)
            cached = sorted(p.name for p in cache.glob("v*-fp8") if p.is_dir())
            assert cached == [f"v{v}-fp8" for v in range(max(0, version - keep + 1), version + 1)], cached
