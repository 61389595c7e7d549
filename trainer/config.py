"""RLJob -> `RunConfig`: everything the training composition root (trainer/run.py `run_training`)
needs, resolved from an RLJob, for the cluster trainer (`rlfleet trainer run`) and local mode (`local=True`
swaps in the manifest's `local` block)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunConfig:
    """Everything the training loop needs, resolved from an RLJob (local or cluster)."""

    job_name: str
    steps: int
    prompts_per_step: int
    samples_per_prompt: int
    sampling: dict[str, Any]
    correction_mode: str
    mis_low: float
    mis_high: float
    max_staleness: int | None
    environment: str
    max_turns: int
    dataset: str | None
    seed: int
    model: dict[str, Any]  # local: the tiny Qwen3 (rlfleet.tiny_qwen3.TinyQwen3 fields); cluster: {}
    learning_rate: float
    weight_decay: float
    max_grad_norm: float
    groups: list[dict[str, Any]] = field(default_factory=list)
    safety: Any = None


def resolve_run(job: Any, local: bool = True) -> RunConfig:
    """RLJob -> RunConfig. `local` swaps in the `local` block (sizes, tiny model, seed, LR)."""
    from rlfleet.trainer.objective import CORRECTION_MODES

    spec = job.spec
    lo = spec.local
    replay = CORRECTION_MODES[spec.correction.mode][1]
    vocab = lo.model.vocab_size if local else None
    head = spec.correction.sc_head_size if vocab is None else min(spec.correction.sc_head_size, vocab)
    sampling = {
        "temperature": spec.rollout.temperature,
        "top_p": spec.rollout.top_p,
        "top_k": spec.rollout.top_k,
        "max_new_tokens": lo.max_new_tokens if local else spec.rollout.max_new_tokens,
        # replay needs the exact sampling support; the other modes score against the full-vocabulary q
        # and, for score centering, its top-K head
        "candidate_mode": "support" if replay else "head",
        "head_size": head,
    }
    model = lo.model.model_dump() | {"seed": lo.seed} if local else {}  # rlfleet.tiny_qwen3.TinyQwen3 fields
    opt = spec.trainer.optimizer
    return RunConfig(
        job_name=job.name,
        steps=lo.steps if local else (spec.trainer.total_steps or 10**12),
        prompts_per_step=lo.prompts_per_step if local else spec.rollout.prompts_per_step,
        samples_per_prompt=lo.samples_per_prompt if local else spec.rollout.samples_per_prompt,
        sampling=sampling,
        correction_mode=spec.correction.mode,
        mis_low=spec.correction.mis_low,
        mis_high=spec.correction.mis_high,
        max_staleness=spec.staleness.max_steps,
        environment=spec.rollout.environment,
        max_turns=spec.rollout.max_turns,
        dataset=spec.rollout.dataset,
        seed=lo.seed,
        model=model,
        learning_rate=float(lo.learning_rate) if local else opt.learning_rate,  # local: sized for the tiny model
        weight_decay=opt.weight_decay,
        max_grad_norm=opt.max_grad_norm,
        groups=[
            {"name": g.name, "accelerator": g.accelerator, "weight_format": g.weight_format,
             "kv_cache_dtype": g.kv_cache_dtype, "quarantined": g.quarantined}
            for g in spec.sampler_groups
            if g.replicas > 0
        ],
        safety=spec.safety,
    )


def build_environment(rc: RunConfig, tokenizer: Any = None) -> Any:
    """`tokenizer`: the model's (trainer/run.py `load_tokenizer`), for environments that take one."""
    from rlfleet.trainer.environments import load_environment

    env = copy.copy(load_environment(rc.environment, tokenizer=tokenizer))  # never mutate a shared built-in instance
    if hasattr(env, "max_turns") and env.max_turns != 1:
        env.max_turns = rc.max_turns
    return env
