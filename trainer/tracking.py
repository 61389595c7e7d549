"""Experiment tracking besides Prometheus: the per-step flat metrics (trainer/metrics.py) to
TensorBoard, Weights & Biases or MLflow. Optional: nothing is tracked unless configured, and each
backend's package comes from its own extra (`pip install 'rlfleet[tracking-tensorboard]'`,
`tracking-wandb`, `tracking-mlflow`); a configured backend whose package is missing is a clear
error at start-up, never a failure mid-run.

Configuration: a spec string, from the caller or the environment variable RLFLEET_TRACKING, a comma
separated list of `kind:target`:
- `tensorboard:DIR`   event files under DIR (torch.utils.tensorboard, needs `tensorboard`);
- `wandb:PROJECT`     a W&B run in PROJECT (offline with WANDB_MODE=offline);
- `mlflow:URI`        an MLflow run at tracking URI: a tracking server (http(s)://...) or a local
                      file store (a directory path or file://; MLflow 3 refuses that store unless
                      MLFLOW_ALLOW_FILE_STORE=true); experiment from MLFLOW_EXPERIMENT_NAME, default
                      "rlfleet". A URI MLflow refuses is a TrackingError at start-up, in MLflow's words.
Metric keys are the flat keys as they are (`kl_k3`, `group/<name>/oor_share`, ...); every backend
accepts "/" (TensorBoard and W&B group by it). Non-finite values are dropped, as for Prometheus.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from rlfleet.trainer.metrics import finite

ENV_VAR = "RLFLEET_TRACKING"
KINDS: dict[str, tuple[str, str]] = {  # kind -> (module it needs, extra that installs it)
    "tensorboard": ("tensorboard", "tracking-tensorboard"),
    "wandb": ("wandb", "tracking-wandb"),
    "mlflow": ("mlflow", "tracking-mlflow"),
}


MLFLOW_BATCH_LIMIT = 1000  # metrics per MLflow log_batch request (the server's limit)


class TrackingError(ValueError):
    """Tracking is misconfigured or its package is missing (clear, one line)."""


class Tracker(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in finite(dict(metrics)).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(
        self, project: str, run_name: str | None = None, config: Mapping[str, Any] | None = None
    ) -> None:
        import wandb

        self.run = wandb.init(project=project, name=run_name, config=dict(config or {}))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(finite(dict(metrics)), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, tracking_uri: str, experiment: str | None = None, run_name: str | None = None) -> None:
        import mlflow
        from mlflow.exceptions import MlflowException

        name = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME", "rlfleet")
        try:  # the client opens its store here: an unknown scheme or a refused file store fails now
            self.client = mlflow.MlflowClient(tracking_uri=tracking_uri)
            found = self.client.get_experiment_by_name(name)
            experiment_id = found.experiment_id if found is not None else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        except MlflowException as exc:
            raise TrackingError(f"tracking 'mlflow:{tracking_uri}': {exc.message.strip()}") from None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, step) for key, value in finite(dict(metrics)).items()]
        for i in range(0, len(batch), MLFLOW_BATCH_LIMIT):  # a fleet's breakdown can exceed one batch
            self.client.log_batch(self.run_id, metrics=batch[i : i + MLFLOW_BATCH_LIMIT])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class MultiTracker:
    """Fans one step out to every configured tracker; with none it does nothing (tracking is optional)."""

    def __init__(self, trackers: Sequence[Tracker] = ()) -> None:
        self.trackers = list(trackers)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def parse_spec(spec: str) -> list[tuple[str, str]]:
    """`kind:target,...` -> [(kind, target)], each checked."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        kind, sep, target = part.partition(":")
        if kind not in KINDS:
            raise TrackingError(
                f"tracking {part!r}: unknown kind {kind!r} (expected one of {', '.join(KINDS)})"
            )
        if not sep or not target:
            raise TrackingError(
                f"tracking {part!r}: expected {kind}:<{'DIR' if kind == 'tensorboard' else 'target'}>"
            )
        out.append((kind, target))
    return out


def _require(kind: str) -> None:
    module, extra = KINDS[kind]
    try:
        importlib.import_module(module)
    except ImportError:
        raise TrackingError(
            f"tracking {kind!r} is configured but the {module!r} package is not installed: "
            f"pip install 'rlfleet[{extra}]'"
        ) from None


def open_tracker(
    spec: str | None = None, run_name: str | None = None, env: Mapping[str, str] | None = None
) -> MultiTracker:
    """The trackers of `spec` (default: $RLFLEET_TRACKING); an empty MultiTracker when none is set."""
    if spec is None:
        spec = (os.environ if env is None else env).get(ENV_VAR, "")
    parsed = parse_spec(spec)
    for kind, _ in parsed:  # every package is checked before anything is opened
        _require(kind)
    trackers: list[Tracker] = []
    for kind, target in parsed:
        if kind == "tensorboard":
            trackers.append(TensorBoardTracker(target))
        elif kind == "wandb":
            trackers.append(WandbTracker(target, run_name=run_name))
        else:
            trackers.append(MlflowTracker(target, run_name=run_name))
    return MultiTracker(trackers)
