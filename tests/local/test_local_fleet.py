"""The local fleet host (rlfleet/local/fleet.py) in process: each engine starts from the channel's newest
version of its view and loads its weights once before the first rollout; the sidecar loops verify
each later version in the channel directory and load it in place, so the cache directory holds only
the launch files (docs/weights.md, "Loading in place")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from rlfleet.channel import WeightChannel
from rlfleet.local.fleet import (
    FleetSpec,
    GroupSpec,
    RunningFleet,
    start_fleet,
    stop_fleet,
    wait_until_serving,
)
from rlfleet.store import FilesystemStore
from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model
from rlfleet.trainer.publish.publisher import WeightPublisher

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@contextlib.asynccontextmanager
async def serving_fleet(
    groups: list[GroupSpec], channel_dir: Path, cache: Path, model_path: Path
) -> AsyncIterator[RunningFleet]:
    """The local fleet of `groups` (one host, the router) on the channel in `channel_dir`, each group's
    sync loop polling every 50 ms into its directory under `cache`; stopped when the block ends."""
    spec = FleetSpec(
        groups=groups,
        store=str(channel_dir),
        cache_dir=str(cache),
        model_path=str(model_path),
        poll_interval=0.05,
    )
    stop = asyncio.Event()
    fleet, tasks = await start_fleet(spec, stop)
    try:
        yield fleet
    finally:
        stop.set()
        await stop_fleet(fleet, tasks)


def weight_loads(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The reference servers' `/update_weights_from_disk` loads (admin_routes logs each one)."""
    return sorted(r.getMessage() for r in caplog.records if r.name == "rlfleet.sampler.server")


async def test_each_engine_loads_once_and_later_versions_load_in_place(
    tmp_path: Path, tiny_qwen3_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rlfleet.sampler.server")
    channel_dir, cache = tmp_path / "channel", tmp_path / "cache"
    store = FilesystemStore(channel_dir, create=True)
    publisher = WeightPublisher(store, views=["bf16", "fp8"], base_checkpoint=tiny_qwen3_dir)
    model = tiny_model(TinyQwen3(seed=1))
    publisher.publish(model.state_dict(), version=0)  # the trainer's version 0, before the host starts
    groups = [GroupSpec("h100-bf16", "h100", "bf16"), GroupSpec("h100-fp8", "h100", "fp8")]
    async with serving_fleet(groups, channel_dir, cache, tiny_qwen3_dir) as fleet:
        async with httpx.AsyncClient(timeout=10) as client:
            for g in groups:  # serving version 0 as soon as the host is up, loaded from the channel
                info = (await client.get(fleet.servers[g.name] + "/model_info")).json()
                expected = str(channel_dir / "v0" / g.weight_format)
                assert (info["weight_version"], info["model_path"], info["weight_format"]) == (
                    "0",
                    expected,
                    g.weight_format,
                )
            deadline = time.monotonic() + 30
            while {r.group: r.applied_version for r in WeightChannel(store).subscribers()} != {
                "h100-bf16": 0,
                "h100-fp8": 0,
            }:
                assert time.monotonic() < deadline, "the sync loops did not report version 0 applied"
                await asyncio.sleep(0.05)
            assert weight_loads(caplog) == []  # in sync with v0: no second load of the same weights
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
            response = await client.post(fleet.router_url + "/generate", json=body)
            assert response.status_code == 200 and response.json()["meta_info"]["weight_version"] == "0"

        publisher.publish(tiny_model(TinyQwen3(seed=2)).state_dict(), version=1)
        await wait_until_serving(fleet, 1, timeout=60)
        assert weight_loads(caplog) == [
            f"weights {channel_dir / 'v1' / view} (view {view}) -> version 1" for view in ("bf16", "fp8")
        ]
        cached = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file())
        assert cached == ["h100-bf16/launch", "h100-fp8/launch"]  # nothing copied


async def test_delta_versions_are_rebuilt_into_the_cache_and_loaded(
    tmp_path: Path, tiny_qwen3_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A channel of an anchor (v0) and a delta (v1: the changed elements of each view's model.safetensors
    against v0's, as the trainer publishes with deltas, docs/weights.md "Deltas between versions"): each
    engine starts from v0 in the channel's directory, and loads v1 rebuilt (anchor v0 + delta v1) into its
    group's cache directory, every file verified against v1's manifest, so it serves v1's weights."""
    from rlfleet.channel import DeltaSource
    from rlfleet.deltas import DELTA_SUFFIX, encode_delta
    from rlfleet.numerics.views import load_view, save_view
    from rlfleet.store import hash_file

    caplog.set_level(logging.INFO, logger="rlfleet.sampler.server")
    channel_dir, cache = tmp_path / "channel", tmp_path / "cache"
    store = FilesystemStore(channel_dir, create=True)
    channel = WeightChannel(store, publisher_id="local/test")
    groups = [GroupSpec("h100-bf16", "h100", "bf16"), GroupSpec("h100-fp8", "h100", "fp8")]
    model = tiny_model(TinyQwen3(seed=1))

    def views_of(version: int) -> dict[str, Path]:
        """Each group's view of the model as it is now, as the publisher writes it (an HF checkpoint)."""
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        directories = {}
        for g in groups:
            directory = tmp_path / f"v{version}" / g.weight_format
            save_view(state, g.weight_format, directory, base_checkpoint=tiny_qwen3_dir)
            directories[g.weight_format] = directory
        return directories

    v0 = views_of(0)
    channel.publish(v0, version=0)
    async with serving_fleet(groups, channel_dir, cache, tiny_qwen3_dir) as fleet:
        import torch

        with torch.no_grad():  # a training step's worth: a few rows change
            model.lm_head.weight[:3] += 0.01
        v1 = views_of(1)
        payloads = {}
        for view, directory in v1.items():
            out = tmp_path / f"v1-{view}{DELTA_SUFFIX}"
            assert (
                encode_delta(v0[view] / "model.safetensors", directory / "model.safetensors", out) is not None
            )
            payloads[view] = DeltaSource(0, {"model.safetensors": out})
        manifest = channel.publish(v1, version=1, deltas=payloads).manifest
        assert all(manifest.views[g.weight_format].delta is not None for g in groups)
        await wait_until_serving(fleet, 1, timeout=60)
        rebuilt = {g.weight_format: cache / g.name / f"v1-{g.weight_format}" for g in groups}
        assert weight_loads(caplog) == sorted(
            f"weights {rebuilt[view]} (view {view}) -> version 1" for view in ("bf16", "fp8")
        )
        for view, directory in rebuilt.items():
            files = manifest.views[view].files
            assert sorted(p.name for p in directory.iterdir()) == sorted(files)
            assert all(hash_file(directory / rel, entry.algorithm) == entry for rel, entry in files.items())
            assert load_view(directory)[1].keys() == load_view(v1[view])[1].keys()
            assert (directory / "model.safetensors").read_bytes() == (
                v1[view] / "model.safetensors"
            ).read_bytes()
