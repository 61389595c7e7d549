"""The weight-sync sidecar of a LoRA group against the real reference engine over HTTP (docs/weights.md,
"LoRA"): the engine serves its base view, the sidecar (`SyncConfig(lora=True)`, LoraEngine) obtains each
version's adapter verified and loads it while requests on the one before finish, and what others write
(a flipped byte, a forged adapter config, an adapter the engine cannot hold) never reaches the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rlfleet.channel import POINTER_KEY, Manifest, Pointer, WeightChannel, manifest_key
from rlfleet.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, LORA_VIEW, adapter_config
from rlfleet.numerics.engine_model import load_checkpoint, lora_modules
from rlfleet.sampler.engine_clients import LoraEngine
from rlfleet.sampler.http_app import start_reference_server
from rlfleet.sampler.reference_engine import EngineConfig, LoraSettings, ReferenceEngine
from rlfleet.sampler.sync_state import SyncConfig
from rlfleet.sampler.syncer import Syncer
from rlfleet.store import FilesystemStore, hash_file
from rlfleet.trainer.publish.publisher import WeightPublisher

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

RANK = 4
TARGETS = ["q_proj", "v_proj"]
CONFIG = adapter_config(rank=RANK, alpha=8.0, dropout=0.0, target_modules=TARGETS, base_model="tiny")
GREEDY = {"temperature": 0.0, "max_new_tokens": 6}
PROMPT = [3, 1, 4, 1, 5]


def adapter(shape: Any, seed: int, rank: int = RANK) -> dict[str, torch.Tensor]:
    """A strong adapter of the targets, PEFT's names (each version computes visibly different tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for module, (fan_in, fan_out) in lora_modules(shape).items():
        if module.rsplit(".", 1)[1] in TARGETS:
            out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g)
            out[f"base_model.model.{module}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.5
    return out


class Fleet:
    """A LoRA channel, one engine launched from its bf16 base, and its sidecar."""

    def __init__(self, root: Path, base_checkpoint: Path) -> None:
        (root / "channel").mkdir(parents=True)
        self.store = FilesystemStore(root / "channel")
        self.cache = root / "cache"
        self.publisher = WeightPublisher(
            self.store, views=["bf16"], base_checkpoint=base_checkpoint, lora=CONFIG, keep_versions=None
        )
        self.url = ""

    def publish(self, version: int, **kwargs: Any) -> None:
        self.publisher.publish(adapter(self.shape, version, **kwargs), version=version)

    def start_engine(self, tokens_per_second: float = 200.0) -> ReferenceEngine:
        """The engine as its pod launches it: from the newest version holding the base view, LoRA on."""
        found = WeightChannel(self.store).manifest(0)
        assert "bf16" in found.views
        directory = self.cache / "base"
        WeightChannel(self.store).obtain_view(0, "bf16", directory)
        view, shape, weights = load_checkpoint(directory)
        self.shape = shape
        settings = LoraSettings(
            max_lora_rank=RANK, target_modules=tuple(TARGETS), max_loras_per_batch=3, max_loaded_loras=4
        )
        config = EngineConfig(
            model=shape, weight_format="bf16", weight_version=0, lora=settings, max_tokens_per_second=200
        )
        return ReferenceEngine(config, weights, view)

    def syncer(self, client: httpx.AsyncClient) -> Syncer:
        config = SyncConfig(
            store="unused",
            view="bf16",
            engine_url=self.url,
            group="g",
            replica="pod-0",
            cache_dir=self.cache / "sync",
            lora=True,
            poll_interval=0.05,
        )
        return Syncer(config, self.store, LoraEngine(client))


@asynccontextmanager
async def serving(fleet: Fleet, engine: ReferenceEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        await start_reference_server(engine) as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as client,
    ):
        fleet.url = server.url
        yield client


async def held(client: httpx.AsyncClient) -> list[str]:
    cards = (await client.get("/v1/models")).json()["data"]
    return sorted(c["id"] for c in cards if c.get("parent"))


async def tokens(client: httpx.AsyncClient, adapter_version: int) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "lora_path": f"v{adapter_version}"}
    answer = await client.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()["output_ids"]


@pytest.fixture
def fleet(tmp_path: Path, tiny_qwen3_dir: Path) -> Fleet:
    made = Fleet(tmp_path, tiny_qwen3_dir)
    made.shape = load_checkpoint(tiny_qwen3_dir)[1]
    made.publish(0)
    return made


async def test_each_version_is_loaded_as_an_adapter_and_the_one_before_two_is_unloaded(fleet: Fleet) -> None:
    async with serving(fleet, fleet.start_engine()) as client:
        syncer = fleet.syncer(client)
        outputs = {}
        for version in range(4):
            if version:
                fleet.publish(version)
            assert await syncer.reconcile_once()
            assert syncer.state.applied_version == version
            assert (await client.get("/model_info")).json()["weight_version"] == str(version)
            assert await held(client) == sorted({f"v{version}", f"v{max(0, version - 1)}"})
            outputs[version] = await tokens(client, version)
        assert len({tuple(t) for t in outputs.values()}) == 4  # each version's adapter computes
        # in sync: a second step loads nothing
        assert not await syncer.reconcile_once() and await held(client) == ["v2", "v3"]
        status = syncer.status()
        assert status["mode"] == "lora" and status["view"] == "bf16" and status["applied_version"] == 3
        # the base is never read again: only adapters after the launch
        assert status["last_apply"]["bytes"] == fleet.publisher.last_published[LORA_VIEW].full_bytes


async def test_a_restarted_engine_gets_the_newest_adapter_again(fleet: Fleet) -> None:
    fleet.publish(1)
    async with serving(fleet, fleet.start_engine()) as client:
        syncer = fleet.syncer(client)
        assert await syncer.reconcile_once() and await held(client) == ["v1"]
        before = await tokens(client, 1)
    async with serving(fleet, fleet.start_engine()) as client:  # the engine container restarted
        syncer.engine = LoraEngine(client)
        assert await held(client) == []
        assert await syncer.reconcile_once()
        assert await held(client) == ["v1"] and await tokens(client, 1) == before


async def test_a_request_on_the_version_before_finishes_on_it_while_the_next_loads(fleet: Fleet) -> None:
    """No pause, no abort: a long generation on v0 runs while the sidecar loads v1 (and says 1); it ends
    normally with all its tokens, and they are v0's (the same as v0 gives alone)."""
    async with serving(fleet, fleet.start_engine(tokens_per_second=10.0)) as client:
        syncer = fleet.syncer(client)
        assert await syncer.reconcile_once()
        alone = await tokens(client, 0)
        fleet.publish(1)
        long = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 60}, "lora_path": "v0"}
        running = asyncio.ensure_future(client.post("/generate", json=long))
        await asyncio.sleep(0.1)  # the request is in flight (60 tokens at 10 per second: about 6 s)
        assert await syncer.reconcile_once()
        assert not running.done(), "the generation on v0 ended before v1 was loaded: nothing overlapped"
        assert (await client.get("/model_info")).json()["weight_version"] == "1"
        assert await held(client) == ["v0", "v1"]
        answer = (await running).json()
        assert answer["meta_info"]["finish_reason"]["type"] == "length"
        assert answer["output_ids"][: len(alone)] == alone and len(answer["output_ids"]) == 60


def _rewrite(fleet: Fleet, version: int, rel: str, data: bytes, *, fix_manifest: bool) -> None:
    """Replace a stored file of `version`'s adapter; with `fix_manifest` also its digest, as a writer with
    the store's credentials could (the pointer's manifest sha256 too)."""

    path = fleet.store.root / f"v{version}" / LORA_VIEW / rel
    path.chmod(0o644)
    path.write_bytes(data)
    if not fix_manifest:
        return
    channel = WeightChannel(fleet.store)
    manifest = channel.manifest(version)
    view = manifest.views[LORA_VIEW]
    files = {**view.files, rel: hash_file(path)}
    forged = dataclasses.replace(manifest, views={LORA_VIEW: dataclasses.replace(view, files=files)})
    data_m = forged.to_bytes()
    fleet.store.put(manifest_key(version), data_m)
    pointer = channel.latest()
    assert pointer is not None
    raw = json.loads(pointer.to_bytes())
    raw["manifest_sha256"] = hashlib.sha256(data_m).hexdigest()
    current = fleet.store.read_pointer(POINTER_KEY)
    assert current is not None and fleet.store.compare_and_swap(
        POINTER_KEY, current.token, json.dumps(raw).encode()
    )
    assert Pointer.from_bytes(json.dumps(raw).encode()).version == version
    assert Manifest.from_bytes(data_m).version == version


@pytest.mark.parametrize(
    ("attack", "reason"),
    [("flipped-byte", "checksum"), ("not-a-lora-config", "checksum"), ("rank-above-the-engine", "engine")],
)
async def test_what_others_write_never_reaches_the_engine(fleet: Fleet, attack: str, reason: str) -> None:
    """A flipped byte of the adapter (digest refused), a consistent version whose adapter_config.json is
    not a LoRA config (refused before the engine), an adapter of a rank the engine's pool cannot hold (the
    engine refuses it): each counted by its reason, the engine keeps serving v0's adapter and takes v2."""
    async with serving(fleet, fleet.start_engine()) as client:
        syncer = fleet.syncer(client)
        assert await syncer.reconcile_once()
        before = await tokens(client, 0)
        if attack == "rank-above-the-engine":
            fleet.publisher.lora = adapter_config(
                rank=2 * RANK, alpha=8.0, dropout=0.0, target_modules=TARGETS
            )
            fleet.publish(1, rank=2 * RANK)
            fleet.publisher.lora = CONFIG
        else:
            fleet.publish(1)
            if attack == "flipped-byte":
                stored = (fleet.store.root / "v1" / LORA_VIEW / ADAPTER_WEIGHTS_FILE).read_bytes()
                flipped = stored[:-7] + bytes([stored[-7] ^ 1]) + stored[-6:]
                _rewrite(fleet, 1, ADAPTER_WEIGHTS_FILE, flipped, fix_manifest=False)
            else:
                forged = {**CONFIG, "peft_type": "PROMPT_TUNING"}
                _rewrite(fleet, 1, ADAPTER_CONFIG_FILE, json.dumps(forged).encode(), fix_manifest=True)
        assert not await syncer.reconcile_once()
        assert syncer.state.failures[reason] == 1 and syncer.state.applied_version == 0
        assert await held(client) == ["v0"] and await tokens(client, 0) == before
        assert (await client.get("/model_info")).json()["weight_version"] == "0"
        fleet.publish(2)
        assert await syncer.reconcile_once() and syncer.state.applied_version == 2
        assert "v2" in await held(client)
