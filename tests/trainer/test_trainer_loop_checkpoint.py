"""The checkpoint the composition root writes before publishing version N holds step N's metrics, so a
trainer killed between that checkpoint and the pointer move resumes with every step in its history
(the report of the resumed run has no hole at N).

Real parts: the composition root (trainer/run.py `run_training`: checkpoint, then publish), the training
loop, the transformers backend on the project's tiny Qwen3, the rollout driver with the copy_digit
environment and its generated prompts, checkpoints on disk. The sampler is a stand-in generate function
(no engine runs here) and the channel a sink that records versions; the kill is that sink raising
while version 2 is published, i.e. after the step-2 checkpoint and before the pointer moves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from support.rollout_drivers import driver_factory
from support.scripted_turns import two_candidate_turn
from support.tiny_models import LOOP_MODEL

from rlfleet.records import SampledTurn
from rlfleet.sampler.protocol import SamplingConfig
from rlfleet.trainer.collapse import CollapseDetector
from rlfleet.trainer.config import RunConfig
from rlfleet.trainer.loop import TrainingLoop
from rlfleet.trainer.publish import checkpoint
from rlfleet.trainer.run import build_backend, run_training


class Killed(BaseException):
    """The process dying (SIGKILL): nothing after it runs, not even the loop's final checkpoint."""


class RecordingSink:
    """The channel's pointer: the versions published, in order; dies while publishing `kill_at`."""

    def __init__(self, latest: int | None = None, kill_at: int | None = None) -> None:
        self.versions: list[int] = [] if latest is None else [latest]
        self.steps: list[int] = []  # the step of each version published here
        self.kill_at = kill_at

    def publish(self, weights: dict[str, torch.Tensor], version: int, *, step: int) -> None:
        if version == self.kill_at:
            raise Killed(f"killed while publishing version {version}")
        self.versions.append(version)
        self.steps.append(step)

    def fence(self) -> None:
        return None

    def latest_version(self) -> int | None:
        return self.versions[-1] if self.versions else None


async def generate(session: str, ids: list[int], sampling: SamplingConfig) -> SampledTurn:
    out = [5, 6, 2][: sampling.max_new_tokens]  # two digits' ids, then EOS
    return two_candidate_turn(ids, out, 32, "cpu-bf16", candidate_mode=sampling.candidate_mode)


@dataclass
class Run:
    """The copy_digit run both tests kill and resume: its config, the tiny Qwen3 it starts from and where
    its checkpoints go."""

    rc: RunConfig
    model: Path
    checkpoints: Path

    def train(self, sink: RecordingSink, resume: dict | None = None) -> TrainingLoop:
        """One trainer process: a backend of its own from the model, the stand-in sampler, the composition
        root publishing into `sink` (resuming from `resume`, a loaded checkpoint)."""
        rc = self.rc
        base = build_backend(rc, backend="torch", source_dir=self.model, max_seq_len=48)
        return run_training(
            rc,
            base.backend,
            sink,
            CollapseDetector(),
            driver_factory(rc, base, generate, max_seq_len=48),
            checkpoint=self.checkpoints,
            resume=resume,
        )

    def killed_at_version_2(self) -> None:
        """A first process, SIGKILLed while it publishes version 2 (after the step-2 checkpoint)."""
        sink = RecordingSink(kill_at=2)
        with pytest.raises(Killed):
            self.train(sink)
        assert sink.versions == [0, 1]  # the pointer never moved to 2


@pytest.fixture
def copy_digit_run(
    tmp_path: Path, tiny_qwen3_factory: Callable[..., Path], example_run: Callable[..., Any]
) -> Callable[[int], Run]:
    """`make(steps)`: a Run of `steps` steps, one prompt of two samples a step, on one bf16 group."""
    model = tiny_qwen3_factory(**LOOP_MODEL)

    def make(steps: int) -> Run:
        rc = example_run(
            steps=steps,
            prompts_per_step=1,
            samples_per_prompt=2,
            max_staleness=None,
            environment="copy_digit",
            dataset=None,
            groups=[("cpu-bf16", "bf16")],
        )
        return Run(rc, model, tmp_path / "checkpoints")

    return make


def test_the_checkpoint_before_version_n_holds_step_n_and_a_killed_run_resumes_without_a_hole(
    copy_digit_run: Callable[[int], Run],
) -> None:
    run = copy_digit_run(3)
    ckpts = run.checkpoints
    run.killed_at_version_2()
    state = checkpoint.load_latest(ckpts)
    assert state is not None and state["step"] == 2
    assert [h["step"] for h in state["history"]] == [1.0, 2.0]  # step 2's metrics are in step 2's checkpoint
    assert all(h["trained_tokens"] > 0 for h in state["history"])

    resumed = RecordingSink(latest=1)
    loop = run.train(resumed, resume=state)  # the restarted process
    assert resumed.versions == [1, 2, 3]  # version 2 republished from the checkpoint, then step 3
    assert [h["step"] for h in loop.state.history] == [1.0, 2.0, 3.0]
    assert loop.state.history[:2] == state["history"]


def test_a_checkpoint_older_than_the_pointer_resumes_and_publishes_above_it(
    copy_digit_run: Callable[[int], Run],
) -> None:
    """The newest checkpoints were lost (damaged, refused): the loaded one is of step 1 while the channel
    is at version 5. The composition root resumes from step 1, publishes its weights as version 6 and
    step 2 as version 7 (version = step + 5, recorded in the checkpoint), and staleness is measured
    against those versions: the stand-in sampler's tokens say version 0, so step 2 (trained while the
    trainer holds version 6) sees them 6 versions behind, not 1."""
    run = copy_digit_run(2)
    ckpts = run.checkpoints
    run.killed_at_version_2()
    state = checkpoint.load_latest(ckpts)
    assert state is not None and (state["step"], state["version_offset"]) == (2, 0)
    older = [
        e for e in checkpoint._read_latest(checkpoint._place(ckpts)[0], "latest")[0].entries
    ]  # newest first
    (ckpts / older[0]["name"]).write_bytes(b"damaged")  # the step-2 checkpoint: refused, step 1 loads
    state = checkpoint.load_latest(ckpts)
    assert state is not None and state["step"] == 1

    ahead = RecordingSink(latest=5)
    loop = run.train(ahead, resume=state)
    assert (ahead.versions, ahead.steps) == ([5, 6, 7], [1, 2])
    assert (loop.state.step, loop.state.version_offset, loop.state.version) == (2, 5, 7)
    assert loop.state.history[-1]["weight_version"] == 7.0 and loop.state.history[-1]["step"] == 2.0
    assert loop.state.history[-1]["staleness_max"] == 6.0
    final = checkpoint.load_latest(ckpts)
    assert final is not None and (final["step"], final["version_offset"]) == (2, 5)
