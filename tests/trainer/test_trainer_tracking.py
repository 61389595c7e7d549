"""Experiment tracking (trainer/tracking.py): the spec / RLFLEET_TRACKING factory, its clear errors,
the fan-out, and each backend for real where its package is installed (TensorBoard event files read
back with tensorboard's own reader; W&B offline; MLflow on a local file store). Where a package is
absent (this machine has none of the three), the factory's error naming the extra is what is tested."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import pytest

from rlfleet.trainer.tracking import KINDS, MultiTracker, TrackingError, open_tracker, parse_spec

HAVE = {kind: find_spec(module) is not None for kind, (module, _) in KINDS.items()}


def test_no_spec_tracks_nothing() -> None:
    assert open_tracker(env={}).trackers == []
    assert (
        open_tracker("", env={"RLFLEET_TRACKING": "tensorboard:/x"}).trackers == []
    )  # an explicit spec wins


def test_parse_spec() -> None:
    assert parse_spec("tensorboard:/tmp/tb, wandb:proj,mlflow:file:///tmp/ml") == [
        ("tensorboard", "/tmp/tb"), ("wandb", "proj"), ("mlflow", "file:///tmp/ml")]  # fmt: skip
    with pytest.raises(TrackingError, match="unknown kind 'neptune'"):
        parse_spec("neptune:x")
    with pytest.raises(TrackingError, match=r"expected tensorboard:<DIR>"):
        parse_spec("tensorboard")


@pytest.mark.parametrize("kind", sorted(k for k, have in HAVE.items() if not have))
def test_missing_package_is_a_clear_error_naming_the_extra(kind: str, tmp_path: Path) -> None:
    module, extra = KINDS[kind]
    with pytest.raises(TrackingError) as err:
        open_tracker(env={"RLFLEET_TRACKING": f"{kind}:{tmp_path}"})
    assert f"the {module!r} package is not installed: pip install 'rlfleet[{extra}]'" in str(err.value)


def test_multi_tracker_fans_out_and_closes() -> None:
    class Recording:
        def __init__(self) -> None:
            self.logged: list = []
            self.closed = False

        def log(self, step, metrics):
            self.logged.append((step, dict(metrics)))

        def close(self):
            self.closed = True

    a, b = Recording(), Recording()
    multi = MultiTracker([a, b])
    multi.log(3, {"kl_k3": 0.5})
    multi.close()
    assert a.logged == b.logged == [(3, {"kl_k3": 0.5})] and a.closed and b.closed


@pytest.mark.skipif(not HAVE["tensorboard"], reason="tensorboard not installed (extra tracking-tensorboard)")
def test_tensorboard_writes_event_files_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = open_tracker(f"tensorboard:{tmp_path}", env={})
    tracker.log(1, {"kl_k3": 0.25, "group/h100-fp8/oor_share": 0.5, "bad": float("nan")})
    tracker.log(2, {"kl_k3": 0.5})
    tracker.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("kl_k3")] == [(1, 0.25), (2, 0.5)]
    assert "bad" not in acc.Tags()["scalars"]


@pytest.mark.skipif(not HAVE["mlflow"], reason="mlflow not installed (extra tracking-mlflow)")
def test_mlflow_local_file_store(tmp_path: Path) -> None:
    import mlflow

    tracker = open_tracker(f"mlflow:{tmp_path.as_uri()}", env={})
    tracker.log(1, {"kl_k3": 0.25})
    run_id = tracker.trackers[0].run_id
    tracker.close()
    history = mlflow.MlflowClient(tracking_uri=tmp_path.as_uri()).get_metric_history(run_id, "kl_k3")
    assert [(m.step, m.value) for m in history] == [(1, 0.25)]


@pytest.mark.skipif(not HAVE["wandb"], reason="wandb not installed (extra tracking-wandb)")
def test_wandb_offline(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    tracker = open_tracker("wandb:rlfleet-test", env={})
    tracker.log(1, {"kl_k3": 0.25})
    tracker.close()
    assert list(tmp_path.rglob("*.wandb"))


@pytest.fixture
def model_dir(tiny_qwen3_factory, one_torch_thread) -> Path:
    """The loop tests' tiny Qwen3 (no fp8 view published: small sizes); torch on one thread."""
    return tiny_qwen3_factory(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=48)


class RecordingTracker:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []
        self.closed = 0

    def log(self, step, metrics):
        self.logged.append((step, dict(metrics)))

    def close(self):
        self.closed += 1


def _composition_root_parts(model_dir: Path):
    """The loop tests' smallest real setup (tests/trainer/test_trainer_loop.py): the transformers
    trainer backend on a tiny Qwen3 checkpoint, emulated low-precision samplers of its shape, the async
    rollout driver, tool_add prompts."""
    from types import SimpleNamespace

    import torch

    from rlfleet.numerics.engine_model import ModelShape
    from rlfleet.trainer.backend_hf import HFBackend, OptimConfig
    from rlfleet.trainer.environments import ToolAddEnv
    from rlfleet.trainer.objective import ObjectiveConfig
    from rlfleet.trainer.prompts import GeneratedPromptSource
    from rlfleet.trainer.rollout import RolloutDriver
    from rlfleet_experiments.ablation import SnapshotSink
    from rlfleet_experiments.emulated import EmulatedFleet, EmulatedSampler

    torch.manual_seed(0)
    shape = ModelShape.from_checkpoint(model_dir)
    groups = [{"name": "g-bf16", "weight_format": "bf16"}]
    fleet = EmulatedFleet([EmulatedSampler("g-bf16", "bf16", "auto", shape, seed=0)])
    backend = HFBackend.from_pretrained(model_dir, ObjectiveConfig.from_correction("sc-mis-topp"),
                                        optim=OptimConfig(learning_rate=1e-3))

    class FleetSink(SnapshotSink):  # versions go to the emulated samplers
        def publish(self, weights, version):
            super().publish(weights, version)
            fleet.load_weights(weights, version)

    sampling = {"temperature": 1.0, "top_p": 0.97, "top_k": 16, "max_new_tokens": 4, "candidate_mode": "support"}

    def make_driver(position):
        return RolloutDriver(fleet.generate, ToolAddEnv(max_turns=3), GeneratedPromptSource("tool_add", 0),
                             samples_per_prompt=2, sampling=sampling, max_seq_len=shape.max_position_embeddings,
                             start_position=position, max_ahead_prompts=4)

    rc = SimpleNamespace(steps=3, prompts_per_step=2, max_staleness=None, groups=groups)
    return rc, backend, FleetSink(), make_driver


def test_run_training_logs_every_step_to_the_tracker_and_closes_it(tmp_path: Path, model_dir: Path) -> None:
    from rlfleet.trainer.collapse import CollapseDetector
    from rlfleet.trainer.run import run_training

    rc, backend, sink, make_driver = _composition_root_parts(model_dir)
    tracker = RecordingTracker()
    hooked: list[dict] = []
    loop = run_training(rc, backend, sink, CollapseDetector(), make_driver, checkpoint=tmp_path / "ckpt",
                        on_step=lambda m, d, g: hooked.append(dict(m)), tracker=tracker)
    assert [step for step, _ in tracker.logged] == [1, 2, 3] == [int(h["step"]) for h in loop.state.history]
    assert [metrics for _, metrics in tracker.logged] == hooked  # the very dicts the on_step hook got
    assert {"step", "reward_mean", "kl_k3", "grad_norm"} <= set(tracker.logged[0][1])
    assert tracker.closed == 1


def test_run_training_closes_the_tracker_on_error(tmp_path: Path, model_dir: Path) -> None:
    from rlfleet.trainer.collapse import CollapseDetector
    from rlfleet.trainer.run import run_training

    rc, backend, sink, _ = _composition_root_parts(model_dir)
    tracker = RecordingTracker()

    def broken_driver(position):
        raise RuntimeError("no rollouts")

    with pytest.raises(RuntimeError, match="no rollouts"):
        run_training(rc, backend, sink, CollapseDetector(), broken_driver, checkpoint=tmp_path / "ckpt",
                     tracker=tracker)
    assert tracker.logged == [] and tracker.closed == 1


def test_run_training_misconfigured_tracking_is_a_start_error(tmp_path: Path, model_dir: Path, monkeypatch) -> None:
    from rlfleet.trainer.collapse import CollapseDetector
    from rlfleet.trainer.run import TrainingStartError, run_training

    rc, backend, sink, make_driver = _composition_root_parts(model_dir)
    monkeypatch.setenv("RLFLEET_TRACKING", "neptune:x")
    with pytest.raises(TrainingStartError, match="unknown kind 'neptune'"):
        run_training(rc, backend, sink, CollapseDetector(), make_driver, checkpoint=tmp_path / "ckpt")
    assert sink.latest_version() is None  # refused before version 0 was published
