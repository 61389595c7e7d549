"""`rlfleet trainer run` (the trainer pod's entrypoint) as a REAL process against reference samplers.

Real parts: the fleet host of local mode (rlfleet/local/fleet.py: real reference sampler servers over HTTP,
the router, the real weight-sync loops that apply whatever the channel's pointer names first), a
filesystem weight store, and the entrypoint started as `rlfleet trainer run` in a subprocess with the
resolved RLJob YAML the operator would mount. The base model is the project's tiny Qwen3 checkpoint
on disk (rlfleet/tiny_qwen3.py, `save_pretrained` + tokenizer; `spec.model.path`, resolved by
rlfleet/model_source.py), trained by the transformers backend (`trainer.backend: torch`). Asserted:
version 0 of EVERY view is published from the base checkpoint before step 1's version, steps advance
to totalSteps, checkpoints land next to the channel, the process exits 0."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from support.claim_window import kill_inside_the_claim_window
from support.ports import free_port
from support.processes import RLFLEET, start_trainer
from support.waits import wait_for

from rlfleet.channel import WeightChannel, manifest_key
from rlfleet.local.fleet import FleetSpec, GroupSpec
from rlfleet.local.main import FleetProcess
from rlfleet.model_source import read_safetensors_dir
from rlfleet.numerics.views import load_view
from rlfleet.store import FilesystemStore
from rlfleet.trainer.publish import checkpoint

REPO = Path(__file__).resolve().parents[2]
MAX_SEQ_LEN = 64
STEPS = 3


def job_manifest(tmp_path: Path, base: Path, channel: Path, steps: int = STEPS) -> Path:
    doc = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
    spec = doc["spec"]
    spec["model"] = {"name": "tiny-qwen3", "path": str(base), "maxSeqLen": MAX_SEQ_LEN}
    spec["trainer"] = {
        "accelerator": "b200",
        "replicas": 1,
        "gpusPerReplica": 1,
        "backend": "torch",
        "totalSteps": steps,
        "optimizer": {"learningRate": 1.0e-3},
    }
    spec["rollout"].update(
        {
            "promptsPerStep": 2,
            "samplesPerPrompt": 2,
            "maxNewTokens": 4,
            "topK": 16,
            "environment": "copy_digit",
            "maxTurns": 1,
        }
    )
    spec["correction"]["scHeadSize"] = 16
    spec["samplerGroups"] = [
        {"name": "h100-bf16", "accelerator": "h100", "replicas": 1, "weightFormat": "bf16"},
        {"name": "h100-fp8", "accelerator": "h100", "replicas": 1, "weightFormat": "fp8"},
    ]
    spec["weightChannel"] = {
        "store": {"type": "filesystem", "path": str(channel)},
        "retention": {"keepVersions": 10},
    }
    path = tmp_path / "rljob.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


BF16_AND_FP8 = (GroupSpec("h100-bf16", "h100", "bf16"), GroupSpec("h100-fp8", "h100", "fp8"))


def local_fleet(
    tmp_path: Path, channel: Path, model: Path, groups: tuple[GroupSpec, ...] = BF16_AND_FP8
) -> tuple[str, FleetProcess]:
    """The sampler fleet of `groups` started on this machine (rlfleet/local/fleet.py: reference engines,
    their weight-sync loops, the router) on the channel at `channel`: the router's URL, known before any
    sampler is up as on a cluster, and the fleet (`wait_ready`, `stop`)."""
    router_port = free_port()
    spec = FleetSpec(
        groups=list(groups),
        store=str(channel),
        cache_dir=str(tmp_path / "cache"),
        model_path=str(model),
        seed=0,
        router_port=router_port,
    )
    (tmp_path / "fleet.json").write_text(spec.to_json())
    return f"http://127.0.0.1:{router_port}", FleetProcess(
        tmp_path / "fleet.json", tmp_path / "fleet.log", secrets.token_hex(8)
    )


@pytest.mark.slow
def test_trainer_entrypoint_publishes_version_0_of_every_view_then_trains(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    base = tiny_qwen3_dir  # the default sizes: every projection a multiple of 128, so the fp8 view publishes
    base_weights = read_safetensors_dir(base)  # bf16, as save_pretrained wrote them
    channel_dir = tmp_path / "channel"
    channel_dir.mkdir()
    # As on a cluster: the samplers wait for the channel's first version, which only the trainer publishes.
    router_url, fleet = local_fleet(tmp_path, channel_dir, base)
    try:
        assert WeightChannel(FilesystemStore(channel_dir)).latest() is None
        trainer_run = start_trainer(
            job_manifest(tmp_path, base, channel_dir), router_url, tmp_path, stdout=subprocess.PIPE
        )
        try:
            urls = fleet.wait_ready()  # ready only once the engines loaded the trainer's version 0
            assert urls["router"] == router_url
            _, trainer_stderr = trainer_run.communicate(timeout=300)
        finally:
            if trainer_run.poll() is None:
                trainer_run.kill()
                trainer_run.communicate()
    finally:
        fleet.stop()
    assert trainer_run.returncode == 0, trainer_stderr[-3000:]

    channel = WeightChannel(FilesystemStore(channel_dir))
    assert channel.versions() == list(range(STEPS + 1))
    v0, v1 = channel.manifest(0), channel.manifest(1)
    assert sorted(v0.views) == ["bf16", "fp8"] and sorted(v1.views) == ["bf16", "fp8"]
    assert v0.published_at <= v1.published_at
    log = trainer_stderr
    assert log.index("published the trainer's weights as version 0 before step 1") < log.index(
        "published weights v1 "
    )
    # version 0 is the base checkpoint's weights (bf16 in, bf16 view out: exact)
    _, v0_bf16 = load_view(channel.obtain_view(0, "bf16", tmp_path / "dl" / "v0").directory)
    assert sorted(v0_bf16) == sorted(base_weights)
    for name, tensor in base_weights.items():
        assert torch.equal(v0_bf16[name], tensor.to(torch.bfloat16).float()), name
    # checkpoints go next to the channel, and every step trained on rollouts
    state = checkpoint.load_latest(channel_dir / "checkpoints")
    assert state is not None and state["step"] == STEPS
    assert [int(h["step"]) for h in state["history"]] == [1, 2, 3]
    assert all(h["trained_tokens"] > 0 for h in state["history"])
    assert state["data_position"] >= STEPS * 2

    # Restarted after its last step (a StatefulSet restarts a container that exits 0): it neither trains
    # again nor exits into a restart loop; it exports the finished run (step, `rlfleet_trainer_finished`)
    # until stopped, and publishes nothing (no router needed: the fleet is gone).
    port = free_port()
    restarted = start_trainer(job_manifest(tmp_path, base, channel_dir), "http://127.0.0.1:9", tmp_path, port)
    try:
        metrics = wait_for(
            "the restarted trainer's finished gauge", lambda: _scrape(port, restarted), timeout=240
        )
    finally:
        restarted.terminate()
        _, stderr = restarted.communicate(timeout=60)
    assert f'rlfleet_trainer_step{{key="",scope="fleet"}} {float(STEPS)}' in metrics
    assert f"training finished at step {STEPS} (spec.trainer.totalSteps {STEPS})" in stderr
    assert "resuming from the checkpoint" not in stderr
    assert channel.versions() == list(range(STEPS + 1))


@pytest.mark.slow
def test_trainer_entrypoint_resumes_after_a_full_store_and_a_sigkill_inside_the_claim_window(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """The trainer pod's life when its store fails it, each time restarted as its StatefulSet would:
    1. the volume is full when step 2's checkpoint is written (its temporary file is /dev/full, as in
       test_a_full_volume_fails_a_checkpoint_with_enospc...): one line naming the store, no traceback, the
       channel still at version 1;
    2. SIGKILLed INSIDE the claim window of version 3 (claims/v3, v3's files and manifest written, the
       pointer at 2: tests/support/claim_window.py holds the pointer's lock so the kill lands there every time);
    3. the restart resumes from the step-3 checkpoint, publishes version 3 again over its own claim (the
       same publisher id and writer lease) and version 4, and exits 0.
    Every version 0-4 is then the trainer's, complete, and every file of every view verifies."""
    steps = 4
    channel_dir = tmp_path / "channel"
    checkpoints = channel_dir / "checkpoints"
    checkpoints.mkdir(parents=True)
    manifest = job_manifest(tmp_path, tiny_qwen3_dir, channel_dir, steps=steps)
    channel = WeightChannel(FilesystemStore(channel_dir), publisher_id="test-observer")

    def trainer() -> subprocess.Popen:
        return start_trainer(manifest, router_url, tmp_path)

    router_url, fleet = local_fleet(tmp_path, channel_dir, tiny_qwen3_dir)
    runs: list[subprocess.Popen] = []
    try:
        (checkpoints / "ckpt-00000002-g1.pt.tmp").symlink_to(
            "/dev/full"
        )  # -g1: the writer lease's first generation
        runs.append(trainer())
        fleet.wait_ready()
        _, full = runs[0].communicate(timeout=300)
        assert runs[0].returncode == 3, full[-3000:]  # the full store's own exit code (trainer/failures.py)
        said = [line for line in full.splitlines() if line.startswith("rlfleet trainer run: ")]
        assert len(said) == 1 and str(channel_dir) in said[0] and "No space left on device" in said[0], full[
            -3000:
        ]
        assert "Traceback" not in full
        assert channel.latest().version == 1  # type: ignore[union-attr]
        # the failed write removed its temporary file (here: the link to /dev/full): room again
        assert not (checkpoints / "ckpt-00000002-g1.pt.tmp").is_symlink()
        assert sorted(p.name for p in checkpoints.iterdir()) == [
            ".latest.lock",
            "ckpt-00000001-g1.pt",
            "latest",
        ]

        runs.append(trainer())
        kill_inside_the_claim_window(runs[1], channel_dir, version=3)
        killed = checkpoint.load_latest(checkpoints)
        assert killed is not None and killed["step"] == 3  # the checkpoint of step 3 comes before version 3

        runs.append(trainer())
        _, resumed = runs[2].communicate(timeout=300)
        assert runs[2].returncode == 0, resumed[-3000:]
    finally:
        for run in runs:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.communicate()
        fleet.stop()
    assert "resuming from the checkpoint at step 3 " in resumed, resumed[-3000:]
    assert "version 3: taking over the claim of this publisher of an interrupted publish" in resumed
    assert channel.versions() == list(range(steps + 1))
    pointer = channel.latest()
    assert pointer is not None and pointer.version == steps and pointer.publisher.startswith("trainer/")
    for version in range(steps + 1):
        m = channel.manifest(version)
        assert m.publisher == pointer.publisher and sorted(m.views) == ["bf16", "fp8"]
        listed = {f"v{version}/{view}/{rel}" for view, vm in m.views.items() for rel in vm.stored_files()}
        assert set(channel.store.list(f"v{version}/")) == listed | {
            manifest_key(version)
        }  # nothing else left
        for view in m.views:
            channel.obtain_view(version, view, tmp_path / "dl" / f"{version}-{view}", manifest=m)  # verifies
    final = checkpoint.load_latest(checkpoints)
    assert final is not None and final["step"] == steps
    assert [int(h["step"]) for h in final["history"]] == list(range(1, steps + 1))


def _scrape(port: int, proc: subprocess.Popen) -> str | None:
    import urllib.error
    import urllib.request

    assert proc.poll() is None, f"the restarted trainer exited ({proc.returncode})"
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except (urllib.error.URLError, OSError):
        return None
    return text if "rlfleet_trainer_finished 1.0" in text else None


def test_trainer_entrypoint_refuses_a_model_path_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "channel").mkdir()
    run = subprocess.run(
        [
            RLFLEET,
            "trainer",
            "run",
            "--config",
            str(job_manifest(tmp_path, tmp_path / "empty", tmp_path / "channel")),
            "--router-url",
            "http://127.0.0.1:9",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert (
        "has no config.json (not a Hugging Face checkpoint)" in run.stderr and "Traceback" not in run.stderr
    )


def test_composition_root_publishes_version_0_of_every_view_as_a_complete_hf_checkpoint(
    tmp_path: Path, tiny_qwen3_dir: Path, example_run: Callable[..., Any]
) -> None:
    """With an HF base (the project's tiny Qwen3, hf backend) version 0 of every view is in the channel,
    each a complete HF checkpoint from the base (config.json with the view's quantization config,
    tokenizer), BEFORE the rollout source is even built. `rc.steps = 0`: no rollout is needed, and the
    stand-in driver below is never asked for one (it records only that it was built after version 0).
    The nvfp4 view's `input_scale` of every linear is amax / (448 * 6), amax of transformers' model
    loaded with the weights the backend publishes, on the publisher's calibration batch (exact)."""
    from rlfleet.store import open_store
    from rlfleet.trainer.collapse import CollapseDetector
    from rlfleet.trainer.publish.publisher import WeightPublisher
    from rlfleet.trainer.run import ChannelSink, build_backend, run_training

    source = tiny_qwen3_dir
    rc = example_run(
        steps=0,
        prompts_per_step=1,
        max_staleness=None,
        groups=[("h100-bf16", "bf16"), ("h100-fp8", "fp8"), ("b200-nvfp4", "nvfp4")],
    )
    base = build_backend(rc, backend="torch", source_dir=source)
    store = open_store(str(tmp_path / "channel"))
    (tmp_path / "channel").mkdir()
    assert rc.views == ["bf16", "fp8", "nvfp4"]
    publisher = WeightPublisher(
        store, views=rc.views, follow_subscribers=False, base_checkpoint=base.base_checkpoint
    )
    channel = publisher.channel
    seen: dict[str, object] = {}

    class NoRollouts:  # stand-in driver: steps=0 never takes a rollout
        next_position = 0

        def start(self) -> None:
            seen["started"] = True

        def stop(self) -> None:
            seen["stopped"] = True

    def make_driver(position: int) -> NoRollouts:
        latest = channel.latest()
        seen["version_when_built"] = None if latest is None else latest.version
        return NoRollouts()

    sink = ChannelSink(publisher)  # calibrates nvfp4's activation amax on the published weights
    run_training(
        rc,
        base.backend,
        sink,
        CollapseDetector(),
        make_driver,
        checkpoint=tmp_path / "channel" / "checkpoints",
    )
    assert seen == {"version_when_built": 0, "started": True, "stopped": True}
    manifest = channel.manifest(0)
    assert sorted(manifest.views) == ["bf16", "fp8", "nvfp4"]
    for view in ("bf16", "fp8", "nvfp4"):
        got = channel.obtain_view(0, view, tmp_path / "dl" / view).directory
        config = json.loads((got / "config.json").read_text())
        assert config["model_type"] == "qwen3"
        assert ("quantization_config" in config) == (view != "bf16")
        assert (got / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()

    from transformers import AutoModelForCausalLM

    from rlfleet.numerics import formats
    from rlfleet.numerics.views import calibrate_activation_amax, calibration_batch, read_view_tensors

    reference = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    weights = base.backend.weights()
    assert {t.dtype for t in weights.values()} == {torch.float32}
    reference.load_state_dict(weights, strict=True)  # untied: every tensor, lm_head included
    amax = calibrate_activation_amax(reference, [calibration_batch(base.vocab_size)])
    config, tensors = read_view_tensors(tmp_path / "dl" / "nvfp4")
    modules = [n.removesuffix(".weight") for n in config["quantized"]]
    linears = [n for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert sorted(modules) == sorted(linears) and len(modules) == 14  # 2 layers x q k v o gate up down
    for module in modules:
        assert torch.equal(tensors[f"{module}.input_scale"], formats.nvfp4_global_scale(amax[module])), module
