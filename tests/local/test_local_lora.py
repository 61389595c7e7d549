"""examples/rljob-lora.yaml in local mode (docs/weights.md "LoRA"): the trainer trains PEFT adapters, the
channel stores each base view once and every version as the adapter, each group's reference engine serves
its own quantized base and loads every version's adapter through its sidecar, the router names each
replica's newest adapter, and the report compares the bytes per version with full fine-tuning's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlfleet.channel import WeightChannel, lora_bases
from rlfleet.local import main as local
from rlfleet.lora import ADAPTER_WEIGHTS_FILE, LORA_VIEW
from rlfleet.store import FilesystemStore
from rlfleet.trainer.publish.checkpoint import load_checkpoint_file

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rljob-lora.yaml"
STEPS = 4
GROUPS = {"bf16", "fp8", "nvfp4"}

pytestmark = pytest.mark.timeout(900)


def test_the_lora_example_trains_adapters_that_every_group_serves_on_its_own_base(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert local.cli([str(EXAMPLE), "--local", "--out", str(out), "--steps", str(STEPS)]) == 0
    printed = capsys.readouterr().out

    channel = WeightChannel(FilesystemStore(out / "channel"))
    pointer = channel.latest()
    assert pointer is not None and pointer.version == STEPS
    first = channel.manifest(0)
    assert set(first.views) == GROUPS | {LORA_VIEW}  # version 0: the bases, once, and the first adapter
    assert lora_bases(first) == dict.fromkeys(sorted(GROUPS), 0)
    kept = channel.versions()
    assert kept[0] == 0 and kept[-1] == STEPS  # retention keeps the bases' version
    for version in kept[1:]:
        manifest = channel.manifest(version)
        assert set(manifest.views) == {LORA_VIEW}, version
        assert lora_bases(manifest) == dict.fromkeys(sorted(GROUPS), 0)

    # the newest adapter is the trainer's: every tensor of the checkpoint's adapter, rounded to bf16
    stored = load_file(str(out / "channel" / f"v{STEPS}" / LORA_VIEW / ADAPTER_WEIGHTS_FILE))
    checkpoint = load_checkpoint_file(sorted((out / "checkpoints").glob("*.pt"))[-1])
    model = checkpoint["backend"]["model"]  # the PEFT model's own names: "<module>.lora_A.default.weight"
    peft_name = {f"base_model.model.{n.replace('.default.weight', '.weight')}": n for n in model}
    assert sorted(stored) == sorted(peft_name)
    assert all(torch.equal(stored[name], model[peft_name[name]].to(torch.bfloat16)) for name in stored)

    summary = json.loads((out / "report" / "metrics.json").read_text())["summary"]
    assert summary["driver"]["failed_groups"] == 0 and summary["driver"]["generate_errors"] == 0
    assert set(summary["groups"]) == GROUPS
    assert all(g["trained_tokens"] > 0 for g in summary["groups"].values())
    lora = summary["lora"]
    adapter_bytes = first.views[LORA_VIEW].bytes
    assert lora["adapter_bytes_per_version"] == adapter_bytes
    assert lora["full_fine_tuning_bytes_per_version"] == sum(first.views[v].bytes for v in GROUPS)
    assert f"LoRA: each of {STEPS + 1} versions stored {adapter_bytes / 1e3:.1f} KB" in printed

    # each group's sidecar loaded adapters into its running engine: version 0's (before any rollout), then
    # later ones (a sidecar behind folds versions: it applies the newest), and never a whole view again
    log = (out / "fleet.log").read_text()
    assert log.count("applied weights v0 (lora)") == len(GROUPS)
    later = {int(v) for v in re.findall(r"applied weights v(\d+) \(lora\)", log)} - {0}
    assert later and max(later) <= STEPS, later
    assert not re.search(r"applied weights v\d+ \((?!lora)", log)
