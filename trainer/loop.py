"""The training loop, top to bottom. Fully asynchronous: the rollout driver (its own thread) keeps
sampling with whatever weights the samplers serve; the trainer takes complete prompt groups from the
buffer, trains one step on them, publishes a new weight version, and never waits for samplers to
catch up. Staleness is measured per token and corrected by the objective, not prevented.

One step:
1. take `prompts_per_step` complete prompt groups from the buffer (blocks until they exist);
2. (optional) drop groups older than `max_staleness` versions (counted);
3. GRPO advantages per group, flatten to one row per sampled token (rollout/batching.py);
4. forward + corrected loss + backward + clip + AdamW (the backend);
5. metrics: the objective's (fleet / per group / per staleness bucket) + per view + rollout side;
6. collapse detector -> alert / quarantine a group / pause;
7. publish the new weights as version = step + version offset (the channel; the composition root's
   `publish` checkpoints first, trainer/run.py: model, optimizer, step, version offset, data position,
   detector).

Versions: the initial weights are version 0; after k optimizer steps the trainer holds version k + the
version offset, which is 0 unless the trainer resumed from a checkpoint older than the channel's pointer
(its newer checkpoints damaged): trainer/run.py then publishes above the pointer, and version = step + offset
from there on (recorded in every checkpoint, and each version's manifest records its step). A token sampled
with version v and trained on at trainer version k has staleness k - v.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from rlfleet.store import Store
from rlfleet.trainer.advantages import uniform_group_fraction
from rlfleet.trainer.collapse import CollapseDetector, Decision
from rlfleet.trainer.metrics import finite, invalid_token_metrics, objective_metrics, rollout_metrics
from rlfleet.trainer.objective import LossOutput
from rlfleet.trainer.publish import checkpoint as ckpt
from rlfleet.trainer.rollout.batching import FlatBatch, flatten_groups
from rlfleet.trainer.rollout.driver import PromptGroup, RolloutStallError

log = logging.getLogger(__name__)


class Backend(Protocol):
    """What the loop needs of a trainer backend (trainer/backends/backend_hf.py `HFBackend`,
    trainer/backends/backend_megatron.py `MegatronBackend`)."""

    def train_step(self, flat: FlatBatch, group_index: dict[str, int]) -> tuple[LossOutput, float]: ...

    def weights(self) -> dict[str, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RolloutSource(Protocol):
    """Where the loop takes complete prompt groups from: trainer/rollout/driver.py `RolloutDriver` (HTTP, its own
    thread), or the ablation's lockstep in-process samplers (experiments/ablation.py `LockstepRollouts`)."""

    @property
    def next_position(self) -> int:
        """The data position: the next prompt index never dispatched (a checkpoint records it)."""
        ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def check(self) -> None:
        """Raise what the source failed with, if it did."""

    def take(self, n: int, timeout: float, stop: threading.Event) -> list[PromptGroup]:
        """Up to `n` complete prompt groups (fewer after `timeout` seconds or once `stop` is set)."""
        ...


@dataclass
class LoopConfig:
    total_steps: int
    prompts_per_step: int
    max_staleness: int | None = None  # None: unbounded (fully asynchronous)
    checkpoint_dir: Path | Store | None = (
        None  # a directory, or the channel's store (trainer/publish/checkpoint.py)
    )
    checkpoint_fence: ckpt.WriterFence | None = None  # the channel's writer lease: fenced like publishes
    take_timeout: float = 900.0  # seconds without a complete group before the run fails


def split_by_staleness(
    groups: list[PromptGroup], trainer_version: int, max_staleness: int | None
) -> tuple[list[PromptGroup], list[PromptGroup]]:
    """(kept, dropped): a group is dropped when its oldest token is more than `max_staleness`
    versions behind the trainer; None keeps everything (fully asynchronous)."""
    if max_staleness is None:
        return list(groups), []
    kept = [g for g in groups if g.staleness(trainer_version) <= max_staleness]
    dropped = [g for g in groups if g.staleness(trainer_version) > max_staleness]
    return kept, dropped


class InvariantError(AssertionError):
    """A loop invariant broke (a rollout trained twice, ...): a bug, never silently continued."""


@dataclass
class LoopState:
    step: int = 0  # optimizer steps done
    version_offset: int = 0  # the trainer's weight version is step + version_offset (module docstring)
    history: list[dict[str, float]] = field(default_factory=list)
    trained_uids: set[str] = field(default_factory=set)
    dropped_stale_groups: int = 0
    paused: bool = False
    pause_reason: str = ""

    @property
    def version(self) -> int:
        """The weight version the trainer holds (what it publishes after this step)."""
        return self.step + self.version_offset


class TrainingLoop:
    def __init__(
        self,
        config: LoopConfig,
        backend: Backend,
        driver: RolloutSource | None,  # None until the composition root has published version `step`
        publish: Callable[[int, dict[str, torch.Tensor]], None],
        detector: CollapseDetector,
        group_names: list[str],
        group_views: dict[str, str],
        on_step: Callable[[dict[str, float], Decision, list[PromptGroup]], None] | None = None,
        on_quarantine: Callable[[list[str]], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.cfg = config
        self.backend = backend
        self.driver = driver
        self.publish = publish
        self.detector = detector
        self.group_names = list(group_names)
        self.group_index = {g: i for i, g in enumerate(self.group_names)}
        self.group_views = group_views
        self.on_step = on_step
        self.on_quarantine = on_quarantine
        self.stop = stop or threading.Event()
        self.state = LoopState()
        self.last_checkpoint_position: int | None = None

    @property
    def source(self) -> RolloutSource:
        if self.driver is None:
            raise InvariantError("the loop took rollouts or checkpointed before its rollout source was set")
        return self.driver

    # ---------------------------------------------------------------- checkpoint / resume
    def checkpoint(self) -> Path | None:
        if self.cfg.checkpoint_dir is None:
            return None
        position = self.source.next_position  # prompts before it are trained or discarded on resume
        self.last_checkpoint_position = position
        return ckpt.save_checkpoint(
            self.cfg.checkpoint_dir,
            {
                "step": self.state.step,
                "version_offset": self.state.version_offset,
                "backend": self.backend.state_dict(),
                "data_position": position,
                "detector": self.detector.state_dict(),
                "history": self.state.history,
                "trained_uids": sorted(self.state.trained_uids),
                "dropped_stale_groups": self.state.dropped_stale_groups,
                "buffer_policy": "discard-unconsumed",
            },
            fence=self.cfg.checkpoint_fence,
        )

    def restore(self, state: dict[str, Any]) -> None:
        """Load a checkpoint BEFORE starting the driver; the driver must start at `data_position`."""
        self.backend.load_state_dict(state["backend"])
        self.detector.load_state_dict(state["detector"])
        self.state.step = int(state["step"])
        self.state.version_offset = int(state.get("version_offset", 0))  # 0: a checkpoint of an older run
        self.state.history = list(state["history"])
        self.state.trained_uids = set(state["trained_uids"])
        self.state.dropped_stale_groups = int(state["dropped_stale_groups"])

    # ---------------------------------------------------------------- one step
    def _take(self) -> tuple[list[PromptGroup], float]:
        t0 = time.monotonic()
        groups: list[PromptGroup] = []
        while len(groups) < self.cfg.prompts_per_step and not self.stop.is_set():
            self.source.check()
            got = self.source.take(self.cfg.prompts_per_step - len(groups), timeout=1.0, stop=self.stop)
            kept, dropped = split_by_staleness(got, self.state.version, self.cfg.max_staleness)
            groups.extend(kept)
            self.state.dropped_stale_groups += len(dropped)
            if not got and time.monotonic() - t0 > self.cfg.take_timeout:
                raise RolloutStallError(f"no complete rollout group for {self.cfg.take_timeout:.0f}s")
        return groups, time.monotonic() - t0

    def train_step(self, groups: list[PromptGroup]) -> tuple[dict[str, float], Decision]:
        version = self.state.version
        uids = [r.uid for g in groups for r in g.rollouts]
        dup = set(uids) & self.state.trained_uids
        if dup or len(set(uids)) != len(uids):
            raise InvariantError(f"rollouts trained twice: {sorted(dup)[:5]}")
        flat = flatten_groups(groups, trainer_version=version)
        t0 = time.monotonic()
        loss_out, grad_norm = self.backend.train_step(flat, self.group_index)
        t_train = time.monotonic() - t0
        self.state.trained_uids.update(uids)
        self.state.step += 1

        rollouts = [r for g in groups for r in g.rollouts]
        metrics = objective_metrics(loss_out, self.group_names, self.group_views)
        metrics.update(
            rollout_metrics(
                [r.scored for r in rollouts],
                [r.completion_ids() for r in rollouts],
                [r.group for r in rollouts],
            )
        )
        metrics.update(
            invalid_token_metrics(
                flat.sampled_by_group, flat.dropped_by_group, flat.invalid_reasons_by_group, metrics
            )
        )
        metrics.update(
            {
                "loss": float(loss_out.loss.detach()),
                "grad_norm": grad_norm,
                "trained_tokens": float(flat.num_tokens),
                "dropped_invalid_tokens": float(flat.dropped_invalid_tokens),
                "dropped_stale_groups": float(self.state.dropped_stale_groups),
                "uniform_group_fraction": uniform_group_fraction(
                    [[r.scored.reward for r in g.rollouts] for g in groups]
                ),
                "staleness_mean": float(flat.staleness.mean()) if flat.num_tokens else 0.0,
                "staleness_max": float(flat.staleness.max()) if flat.num_tokens else 0.0,
                "time/train": t_train,
                "data_position": float(self.source.next_position),
            }
        )
        metrics = finite(metrics)
        metrics["step"] = float(self.state.step)
        metrics["weight_version"] = float(self.state.version)
        decision = self.detector.observe(self.state.step, metrics)
        metrics["collapse_alerts"] = float(len(decision.alerts))
        return metrics, decision

    # ---------------------------------------------------------------- the loop
    def run(self) -> LoopState:
        """Run until `total_steps` (counting steps restored from a checkpoint), a pause, or `stop`."""
        while self.state.step < self.cfg.total_steps and not self.stop.is_set():
            groups, t_wait = self._take()
            if self.stop.is_set() or len(groups) < self.cfg.prompts_per_step:
                break
            metrics, decision = self.train_step(groups)
            metrics["time/wait_rollouts"] = t_wait
            # in the history before `publish`, which checkpoints first (trainer/run.py): the step-N
            # checkpoint holds step N's metrics, so a trainer killed before the pointer moves resumes
            # with every step in its report. `time/publish` joins the entry once known (the next
            # checkpoint has it; the step-N one cannot).
            self.state.history.append(metrics)
            t0 = time.monotonic()
            self.publish(self.state.version, self.backend.weights())
            metrics["time/publish"] = time.monotonic() - t0
            if decision.quarantine and self.on_quarantine is not None:
                self.on_quarantine(decision.quarantine)
            if self.on_step is not None:  # the step's groups too: per-group figures of the live table
                self.on_step(metrics, decision, groups)
            if decision.pause:
                self.state.paused = True
                self.state.pause_reason = "; ".join(a.message for a in decision.alerts)
                log.warning(
                    "collapse detector paused training at step %d: %s",
                    self.state.step,
                    self.state.pause_reason,
                )
                break
        return self.state
