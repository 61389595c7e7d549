"""`make_driver(position)` as `rlfleet.trainer.run.run_training` takes it, for the tests that run the loop
against a sampler of their own (a stand-in `generate` or a `SamplerClient`)."""

from __future__ import annotations

from collections.abc import Callable

from rlfleet.trainer.config import RunConfig
from rlfleet.trainer.rollout.driver import GenerateFn, RolloutDriver
from rlfleet.trainer.run import BaseModel, rollout_inputs


def driver_factory(
    rc: RunConfig, base: BaseModel, generate: GenerateFn, max_seq_len: int
) -> Callable[[int], RolloutDriver]:
    """Drivers of rc's environment and prompts (with `base`'s tokenizer) over `generate`, each starting
    at the prompt position it is given (where a resumed run goes on)."""

    def make_driver(position: int) -> RolloutDriver:
        env, prompts = rollout_inputs(rc, base)
        return RolloutDriver(
            generate,
            env,
            prompts,
            samples_per_prompt=rc.samples_per_prompt,
            sampling=rc.sampling,
            max_seq_len=max_seq_len,
            start_position=position,
        )

    return make_driver
