"""A LoRA job's channel (docs/weights.md, "LoRA"): each version is the adapter (the `lora` view, PEFT's
layout), each base view is stored once from the base checkpoint, manifests name where their bases are,
and retention keeps those versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlfleet.channel import LORA_BASE_KEY, ChannelError, Manifest, SubscriberReport, WeightChannel, lora_bases
from rlfleet.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, LORA_VIEW, adapter_config
from rlfleet.store import FilesystemStore
from rlfleet.trainer.publish.publisher import WeightPublisher

RANK = 4
CONFIG = adapter_config(
    rank=RANK, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"], base_model="tiny"
)


def adapter(seed: int) -> dict[str, torch.Tensor]:
    """PEFT-named adapter tensors of the project's tiny Qwen3 (hidden 128, 2 layers, q/v 128 wide)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        for module in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(RANK, 128, generator=g)
            out[f"{prefix}.lora_B.weight"] = torch.randn(128, RANK, generator=g)
    return out


@pytest.fixture
def store(tmp_path: Path) -> FilesystemStore:
    (tmp_path / "channel").mkdir()
    return FilesystemStore(tmp_path / "channel")


def lora_publisher(store: FilesystemStore, base: Path, **kwargs: object) -> WeightPublisher:
    return WeightPublisher(
        store, views=["bf16", "fp8"], base_checkpoint=base, lora=CONFIG, keep_versions=None, **kwargs
    )


def test_version_zero_holds_the_bases_and_every_later_version_only_the_adapter(
    store: FilesystemStore, tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    publisher = lora_publisher(store, tiny_qwen3_dir)
    first = publisher.publish(adapter(0), version=0)
    second = publisher.publish(adapter(1), version=1)
    assert sorted(first.manifest.views) == ["bf16", "fp8", LORA_VIEW]
    assert sorted(second.manifest.views) == [LORA_VIEW]
    assert lora_bases(first.manifest) == {"bf16": 0, "fp8": 0}
    assert lora_bases(second.manifest) == {"bf16": 0, "fp8": 0}
    # the adapter in PEFT's layout, bf16, the config as given
    files = second.manifest.views[LORA_VIEW].files
    assert sorted(files) == [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE]
    local = tmp_path / "adapter"
    WeightChannel(store).obtain_view(1, LORA_VIEW, local)
    assert json.loads((local / ADAPTER_CONFIG_FILE).read_text()) == CONFIG
    stored = load_file(str(local / ADAPTER_WEIGHTS_FILE))
    expected = adapter(1)
    assert sorted(stored) == sorted(expected)
    for name, tensor in expected.items():
        assert stored[name].dtype == torch.bfloat16
        assert torch.equal(stored[name], tensor.to(torch.bfloat16))
    # a version is a few KB where the bases were the whole model
    full = sum(first.manifest.views[v].bytes for v in ("bf16", "fp8"))
    assert second.bytes == second.manifest.views[LORA_VIEW].bytes
    assert second.bytes * 20 < full
    assert publisher.last_published[LORA_VIEW].kind == "anchor"


def test_a_base_view_a_subscriber_adds_later_is_stored_once_at_the_next_version(
    store: FilesystemStore, tiny_qwen3_dir: Path
) -> None:
    publisher = lora_publisher(store, tiny_qwen3_dir)
    publisher.publish(adapter(0), version=0)
    WeightChannel(store).report(SubscriberReport("b200", "pod-0", "nvfp4", None, []))
    added = publisher.publish(adapter(1), version=1)
    after = publisher.publish(adapter(2), version=2)
    assert sorted(added.manifest.views) == [LORA_VIEW, "nvfp4"]
    assert lora_bases(added.manifest) == {"bf16": 0, "fp8": 0, "nvfp4": 1}
    assert sorted(after.manifest.views) == [LORA_VIEW]
    assert lora_bases(after.manifest) == {"bf16": 0, "fp8": 0, "nvfp4": 1}


def test_a_restarted_trainer_finds_the_bases_and_does_not_store_them_again(
    store: FilesystemStore, tiny_qwen3_dir: Path
) -> None:
    lora_publisher(store, tiny_qwen3_dir).publish(adapter(0), version=0)
    restarted = lora_publisher(store, tiny_qwen3_dir)
    result = restarted.publish(adapter(1), version=1)
    assert sorted(result.manifest.views) == [LORA_VIEW]
    assert lora_bases(result.manifest) == {"bf16": 0, "fp8": 0}


def test_retention_keeps_the_versions_holding_the_kept_versions_bases(
    store: FilesystemStore, tiny_qwen3_dir: Path
) -> None:
    publisher = lora_publisher(store, tiny_qwen3_dir)
    channel = WeightChannel(store)
    publisher.publish(adapter(0), version=0)
    channel.report(SubscriberReport("b200", "pod-0", "nvfp4", None, []))
    for version in range(1, 5):
        publisher.publish(adapter(version), version=version)
    deleted = channel.retain(1, stale_after_seconds=None)
    # v4 kept (the pointer); v0 holds bf16 and fp8, v1 holds nvfp4: both bases of v4
    assert channel.versions() == [0, 1, 4]
    assert deleted == [2, 3]


def test_a_lora_version_needs_its_number_and_a_base_checkpoint(
    store: FilesystemStore, tiny_qwen3_dir: Path
) -> None:
    with pytest.raises(ValueError, match="needs base_checkpoint"):
        WeightPublisher(store, views=["bf16"], lora=CONFIG)
    with pytest.raises(ValueError, match="needs its number"):
        lora_publisher(store, tiny_qwen3_dir).publish(adapter(0))
    with pytest.raises(ValueError, match="not LoRA adapter tensors"):
        lora_publisher(store, tiny_qwen3_dir).publish({"model.norm.weight": torch.ones(128)}, version=0)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ([0], "not a mapping"),
        ({"fp16": 0}, "entry 'fp16'"),
        ({"bf16": "0"}, "entry 'bf16'"),
        ({"bf16": True}, "entry 'bf16'"),
        ({"bf16": 6}, "not an earlier version"),
        ({"bf16": -1}, "not an earlier version"),
    ],
)
def test_a_forged_lora_base_entry_is_refused_with_one_line(entry: object, message: str) -> None:
    manifest = Manifest(5, "2026-12-07T00:00:00Z", "p", {}, {LORA_BASE_KEY: entry})
    with pytest.raises(ChannelError, match=message):
        lora_bases(manifest)


def test_the_operator_reads_the_bases_and_the_model_through_a_lora_version(
    store: FilesystemStore, tiny_qwen3_dir: Path
) -> None:
    from rlfleet.operator.channel_read import read_channel
    from rlfleet.operator.channel_status import weightchannel_status

    publisher = lora_publisher(store, tiny_qwen3_dir)
    for version in range(3):
        publisher.publish(adapter(version), version=version)
    spec = {"store": {"type": "filesystem", "path": str(store.root)}}
    read = read_channel(spec, None, want_model=True)
    assert read.error is None and read.status is not None
    assert read.status.lora_base == {"bf16": 0, "fp8": 0}
    assert [a.view for a in read.status.artifacts] == [LORA_VIEW]
    # the model's heads come from the base view's config.json, at version 0
    assert read.model is not None and read.model["attentionHeads"] == 2 and read.model["version"] == 2
    status = weightchannel_status({"metadata": {"name": "j-weights", "generation": 1}}, read.status, None)
    assert status["loraBase"] == {"bf16": 0, "fp8": 0} and status["latestVersion"] == 2
