"""Experiment tracking (trainer/tracking.py): the spec / RLFLEET_TRACKING factory, its clear errors,
the fan-out, and each backend for real where its package is installed (TensorBoard event files read
back with tensorboard's own reader; W&B offline; MLflow on a local file store). Where a package is
absent (this machine has none of the three), the factory's error naming the extra is what is tested.
`run_training`'s use of the tracker, on in-process samplers: tests/experiments/test_experiments_trainer_tracking.py."""

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
