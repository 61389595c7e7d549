"""The warm start of the tiny Qwen3 (RLJob `local.model.warmStart`, `rlfleet model tiny-qwen3
--warm-start`): before RL, the seeded random init is supervised for a few seconds on demonstrations of
a built-in task, deliberately noisy, so RL starts as real pipelines do (from a pretrained / SFT model
that solves the task sometimes) but low enough that RL has something to raise (docs/local.md, "The
demo's warm start").

Why: from a random model RL on `tool_add` has pass@k ~ 0 (the model must copy two digits of the prompt
into a call and then the tool's result into the answer); docs/local.md records the setups that did not
get task success off 0%.

How: demonstrations built from the environment's own rules (the task's prompt generator, `ToolAddEnv`
answering the call, trainer/envs/environments.py), trained through the trainer's own torch backend
(trainer/backends/backend_hf.py) with the `pg` objective at advantage 1 on the model's tokens, which is exactly
cross-entropy: no second training loop. The recipe (steps, batch, learning rate) and the knob
(`WARM_START_NOISE`) are in rlfleet/tiny_qwen3.py, part of the model's cache key. Why this lives here and
not in rlfleet/tiny_qwen3.py: that module is imported by the sampler side, which may not import the
trainer (pyproject.toml's import contracts); it takes this module's `train_warm_start` as a hook.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlfleet.records import HEAD_MODE
from rlfleet.tiny_qwen3 import (
    ARCHITECTURES,
    VOCAB_SIZE,
    WARM_START_NOISE,
    WARM_START_RECIPE,
    WARM_START_TASKS,
    TinyQwen3,
    build_tiny_qwen3,
    cached_tiny_qwen3,
)
from rlfleet.trainer.backends.backend_common import OptimConfig
from rlfleet.trainer.backends.backend_hf import HFBackend
from rlfleet.trainer.envs.environments import ToolAddEnv
from rlfleet.trainer.envs.environments import ToyVocab as V
from rlfleet.trainer.envs.prompts import GeneratedPromptSource, Prompt
from rlfleet.trainer.objective import ObjectiveConfig
from rlfleet.trainer.rollout.batching import FlatBatch


def tool_add_demonstration(
    prompt: Prompt, rng: np.random.Generator, noise: float
) -> tuple[list[int], list[int]]:
    """One tool_add episode as the protocol wants it, imperfect on purpose: (ids, positions of the model's
    tokens). The call copies the prompt's two digits and the answer copies the tool's result, each copy
    replaced, independently with probability `noise`, by a uniformly random digit; the result between
    them is what the environment itself answers to that call (`ToolAddEnv.step`), so a noisy argument
    gives a well-formed call with the wrong sum, as it would in a rollout."""

    def copy(digit: int) -> int:
        noisy = rng.random() < noise
        drawn = int(rng.integers(10))  # drawn either way: every demonstration takes the same draws
        return drawn if noisy else digit

    env = ToolAddEnv()
    state = env.start(prompt)
    call = [V.CALL, V.digit(copy(int(prompt.meta["a"]))), V.digit(copy(int(prompt.meta["b"]))), V.END_CALL]
    result = env.step(prompt, state, call, "stop").append_ids  # RESULT s END_RESULT
    answer = [V.digit(copy(V.value(result[1]))), V.EOS]
    ids = [*prompt.input_ids, *call, *result, *answer]
    start = len(prompt.input_ids)
    trained = [*range(start, start + len(call)), *range(len(ids) - len(answer), len(ids))]
    return ids, trained


def demonstration_batch(demonstrations: list[tuple[list[int], list[int]]]) -> FlatBatch:
    """Demonstrations -> the trainer's FlatBatch with advantage 1 on every model token: under the `pg`
    objective (trainer/objective.py, no correction: loss -A log p(y)) a train step is then a
    cross-entropy step on those tokens. The sampler's fields are placeholders the pg objective reads only
    for its metrics (q(y) = 1, no candidates)."""
    lens = np.array([len(ids) for ids, _ in demonstrations], dtype=np.int64)
    input_ids = np.zeros((len(demonstrations), int(lens.max())), dtype=np.int64)
    row_seq: list[int] = []
    row_pos: list[int] = []
    targets: list[int] = []
    for b, (ids, trained) in enumerate(demonstrations):
        input_ids[b, : len(ids)] = ids
        row_seq += [b] * len(trained)
        row_pos += [p - 1 for p in trained]  # the logit at position p - 1 predicts the token at p
        targets += [ids[p] for p in trained]
    n = len(targets)
    return FlatBatch(
        input_ids=input_ids,
        seq_lens=lens,
        row_seq=np.array(row_seq, dtype=np.int64),
        row_pos=np.array(row_pos, dtype=np.int64),
        target_ids=np.array(targets, dtype=np.int64),
        advantages=np.ones(n, dtype=np.float32),
        logq=np.zeros(n, dtype=np.float32),
        logq_support=np.zeros(n, dtype=np.float32),
        cand_offsets=np.zeros(n + 1, dtype=np.int64),
        cand_ids=np.zeros(0, dtype=np.int64),
        cand_logq=np.zeros(0, dtype=np.float32),
        candidate_mode=HEAD_MODE,
        versions=np.zeros(n, dtype=np.int64),
        staleness=np.zeros(n, dtype=np.int64),
        groups=np.array(["warm-start"] * n, dtype=object),
    )


def train_warm_start(model: Any, spec: TinyQwen3) -> None:
    """Supervise `model` in place on `spec.warm_start`'s demonstrations (rlfleet/tiny_qwen3.py
    `WarmStart`): WARM_START_RECIPE.steps AdamW steps, each on WARM_START_RECIPE.batch fresh
    demonstrations (prompts from the task's generator at `spec.seed`, noise from the seed's own
    stream). On one CPU thread, so the same spec gives the same weights whatever the machine's
    thread count."""
    if spec.warm_start != "tool_add":
        raise ValueError(f"no warm start for {spec.warm_start!r} (have {', '.join(WARM_START_TASKS[1:])})")
    recipe = WARM_START_RECIPE
    prompts = GeneratedPromptSource(spec.warm_start, spec.seed)
    rng = np.random.default_rng([spec.seed, recipe.stream])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        backend = HFBackend(
            model,
            ObjectiveConfig(mode="pg"),
            OptimConfig(learning_rate=recipe.learning_rate),
            device="cpu",
            distributed=False,
        )
        for step in range(recipe.steps):
            first = step * recipe.batch
            demonstrations = [
                tool_add_demonstration(prompts.get(i), rng, spec.warm_start_noise)
                for i in range(first, first + recipe.batch)
            ]
            backend.train_step(demonstration_batch(demonstrations), {})
    finally:
        torch.set_num_threads(threads)


def cached_model(cache_root: str | Path, spec: TinyQwen3) -> Path:
    """The tiny Qwen3 of `spec`, warm-started when it says so, built once under `cache_root`
    (`cached_tiny_qwen3`): what local mode trains."""
    return cached_tiny_qwen3(cache_root, spec, warm_start=train_warm_start)


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="rlfleet model tiny-qwen3",
        description="Write the project's tiny Qwen3 checkpoint (rlfleet/tiny_qwen3.py), optionally warm-started.",
    )
    parser.add_argument("--out", required=True, help="directory to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    parser.add_argument(
        "--architecture",
        choices=ARCHITECTURES,
        default="qwen3",
        help="qwen3 (dense) or qwen3_moe (routed experts, rlfleet/tiny_qwen3.py MOE_SIZES)",
    )
    parser.add_argument(
        "--warm-start",
        choices=WARM_START_TASKS,
        default="none",
        help="supervise the seeded init on this task's noisy demonstrations first (docs/local.md)",
    )
    parser.add_argument(
        "--warm-start-noise",
        type=float,
        default=WARM_START_NOISE,
        help=f"share of the demonstrations' copied digits replaced by random ones (default {WARM_START_NOISE})",
    )
    args = parser.parse_args(argv)
    try:
        spec = TinyQwen3(
            vocab_size=args.vocab_size,
            seed=args.seed,
            warm_start=args.warm_start,
            warm_start_noise=args.warm_start_noise,
            architecture=args.architecture,
        )
        path = build_tiny_qwen3(args.out, spec, warm_start=train_warm_start)
    except ValueError as e:
        print(f"rlfleet model tiny-qwen3: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
