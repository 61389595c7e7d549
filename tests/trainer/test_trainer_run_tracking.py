"""`run_training` and the experiment tracker (trainer/tracking.py) on the smallest real composition:
the transformers trainer backend on a tiny Qwen3, the in-process samplers (rlfleet/local/emulated.py: the
reference engine without HTTP), the async rollout driver."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.tiny_models import LOOP_MODEL


@pytest.fixture
def model_dir(tiny_qwen3_factory, one_torch_thread) -> Path:
    """The loop tests' tiny Qwen3 (no fp8 view published: small sizes); torch on one thread."""
    return tiny_qwen3_factory(**LOOP_MODEL)


class RecordingTracker:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []
        self.closed = 0

    def log(self, step, metrics):
        self.logged.append((step, dict(metrics)))

    def close(self):
        self.closed += 1


def _composition_root_parts(model_dir: Path, example_run):
    """The loop tests' smallest real setup (tests/trainer/test_trainer_loop.py): the transformers
    trainer backend on a tiny Qwen3 checkpoint, emulated low-precision samplers of its shape, the async
    rollout driver, tool_add prompts."""
    import torch

    from rlfleet.local.emulated import EmulatedFleet, EmulatedSampler, SnapshotSink
    from rlfleet.numerics.engine_model import ModelShape
    from rlfleet.sampler.protocol import SamplingConfig
    from rlfleet.trainer.backends.backend_hf import HFBackend, OptimConfig
    from rlfleet.trainer.envs.environments import ToolAddEnv
    from rlfleet.trainer.envs.prompts import GeneratedPromptSource
    from rlfleet.trainer.objective import ObjectiveConfig
    from rlfleet.trainer.rollout.driver import RolloutDriver

    torch.manual_seed(0)
    shape = ModelShape.from_checkpoint(model_dir)
    fleet = EmulatedFleet([EmulatedSampler("g-bf16", "bf16", "auto", shape, seed=0)])
    backend = HFBackend.from_pretrained(
        model_dir, ObjectiveConfig.from_correction("sc-mis-topp"), optim=OptimConfig(learning_rate=1e-3)
    )

    class FleetSink(SnapshotSink):  # versions go to the emulated samplers
        def publish(self, weights, version, *, step):
            super().publish(weights, version, step=step)
            fleet.load_weights(weights, version)

    sampling = SamplingConfig(
        temperature=1.0, top_p=0.97, top_k=16, max_new_tokens=4, candidate_mode="support"
    )

    def make_driver(position):
        return RolloutDriver(
            fleet.generate,
            ToolAddEnv(max_turns=3),
            GeneratedPromptSource("tool_add", 0),
            samples_per_prompt=2,
            sampling=sampling,
            max_seq_len=shape.max_position_embeddings,
            start_position=position,
            max_ahead_prompts=4,
        )

    rc = example_run(
        steps=3, prompts_per_step=2, max_staleness=None, groups=[("g-bf16", "bf16")], sampling=sampling
    )
    return rc, backend, FleetSink(), make_driver


def test_run_training_logs_every_step_to_the_tracker_and_closes_it(
    tmp_path: Path, model_dir: Path, example_run
) -> None:
    from rlfleet.trainer.collapse import CollapseDetector
    from rlfleet.trainer.run import run_training

    rc, backend, sink, make_driver = _composition_root_parts(model_dir, example_run)
    tracker = RecordingTracker()
    hooked: list[dict] = []
    loop = run_training(
        rc,
        backend,
        sink,
        CollapseDetector(),
        make_driver,
        checkpoint=tmp_path / "ckpt",
        on_step=lambda m, d, g: hooked.append(dict(m)),
        tracker=tracker,
    )
    assert [step for step, _ in tracker.logged] == [1, 2, 3] == [int(h["step"]) for h in loop.state.history]
    assert [metrics for _, metrics in tracker.logged] == hooked  # the very dicts the on_step hook got
    assert {"step", "reward_mean", "kl_k3", "grad_norm"} <= set(tracker.logged[0][1])
    assert tracker.closed == 1


def test_run_training_closes_the_tracker_on_error(tmp_path: Path, model_dir: Path, example_run) -> None:
    from rlfleet.trainer.collapse import CollapseDetector
    from rlfleet.trainer.run import run_training

    rc, backend, sink, _ = _composition_root_parts(model_dir, example_run)
    tracker = RecordingTracker()

    def broken_driver(position):
        raise RuntimeError("no rollouts")

    with pytest.raises(RuntimeError, match="no rollouts"):
        run_training(
            rc,
            backend,
            sink,
            CollapseDetector(),
            broken_driver,
            checkpoint=tmp_path / "ckpt",
            tracker=tracker,
        )
    assert tracker.logged == [] and tracker.closed == 1


def test_run_training_misconfigured_tracking_is_a_start_error(
    tmp_path: Path, model_dir: Path, monkeypatch, example_run
) -> None:
    from rlfleet.trainer.collapse import CollapseDetector
    from rlfleet.trainer.run import TrainingStartError, run_training

    rc, backend, sink, make_driver = _composition_root_parts(model_dir, example_run)
    monkeypatch.setenv("RLFLEET_TRACKING", "neptune:x")
    with pytest.raises(TrainingStartError, match="unknown kind 'neptune'"):
        run_training(rc, backend, sink, CollapseDetector(), make_driver, checkpoint=tmp_path / "ckpt")
    assert sink.latest_version() is None  # refused before version 0 was published
