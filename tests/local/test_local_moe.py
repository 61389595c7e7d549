"""Local mode on the tiny Qwen3-MoE (RLJob `local.model.architecture: qwen3_moe`): the trainer builds
and warm-starts transformers' Qwen3MoeForCausalLM, trains it with the router's load-balancing loss,
publishes its views, and every group's reference engine serves them; the run completes as a dense one."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open
from test_local_run import EXAMPLE, local_run_command  # the local tests' one copy

from rlfleet.channel import WeightChannel
from rlfleet.store import FilesystemStore

STEPS = 3


@pytest.mark.timeout(300)
def test_a_local_run_trains_and_serves_the_tiny_qwen3_moe(tmp_path: Path) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["local"]["model"]["architecture"] = "qwen3_moe"  # the example's warm start kept
    manifest = tmp_path / "rljob.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    cmd = local_run_command(manifest, tmp_path / "run", steps=STEPS)
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report" / "metrics.json").read_text())
    local = doc["spec"]["local"]
    assert report["summary"]["steps"] == STEPS
    # every step trained on rollouts the groups' engines sampled from the MoE's published versions
    assert (
        report["summary"]["rollouts_trained"] == STEPS * local["promptsPerStep"] * local["samplesPerPrompt"]
    )
    groups = {g["weightFormat"] for g in doc["spec"]["samplerGroups"]}
    channel = WeightChannel(FilesystemStore(tmp_path / "run" / "channel"))
    for (
        view
    ) in groups:  # the last version's view, downloaded (rebuilt where it is stored as a delta) and verified
        published = channel.obtain_view(STEPS, view, tmp_path / "published" / view).directory
        config = json.loads((published / "config.json").read_text())
        assert config["model_type"] == "qwen3_moe" and config["num_experts_per_tok"] == 2, view
        with safe_open(str(published / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert (
            "model.layers.1.mlp.experts.3.down_proj.weight" in names
            and "model.layers.0.mlp.gate.weight" in names
        )
    # the samplers returned each token's routed experts and the trainer measured its routing against them
    # (trainer/backends/routing.py): in the report, fleet-wide and per group, and its plot
    compared = [row for row in report["steps"] if row.get("routing_tokens", 0) > 0]
    assert compared, "no step compared the samplers' routing with the trainer's"
    for row in compared:
        assert 0.0 <= row["routing_mismatch_layers"] <= row["routing_mismatch_tokens"] <= 1.0
        names = [
            g["name"] for g in doc["spec"]["samplerGroups"] if row.get(f"group/{g['name']}/routing_tokens")
        ]
        assert sum(row[f"group/{n}/routing_tokens"] for n in names) == row["routing_tokens"]
        print("routing", {k: v for k, v in row.items() if "routing" in k})
    assert (tmp_path / "run" / "report" / "routing.png").exists()
