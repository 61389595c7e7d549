"""The `SampledTurn`s a test's stand-in sampler answers with: the ids it was scripted to produce, with a q
known exactly, at weight version 0, finished by "stop"."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlfleet.records import SUPPORT_MODE, SampledTurn


def certain_turn(prompt_ids: Sequence[int], output_ids: Sequence[int], group: str = "g") -> SampledTurn:
    """Each output id sampled with q = 1: it is its own whole support."""
    out = np.asarray(output_ids)
    n = len(out)
    return SampledTurn(
        prompt_ids=np.asarray(prompt_ids),
        output_ids=out,
        logprobs=np.zeros(n),
        sampled_logprobs=np.zeros(n),
        support_offsets=np.arange(n + 1),
        support_ids=out,
        support_logprobs=np.zeros(n),
        weight_versions=np.zeros(n, dtype=np.int64),
        group=group,
        finish_reason="stop",
    )


def two_candidate_turn(
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    vocab_size: int,
    group: str,
    candidate_mode: str = SUPPORT_MODE,
) -> SampledTurn:
    """Each output id y sampled with q 0.6 against one other candidate, (y + 1) % vocab_size, at 0.4;
    log q(y) over the whole vocabulary is log 0.5."""
    out = np.asarray(output_ids)
    n = len(out)
    other = (out + 1) % vocab_size
    return SampledTurn(
        prompt_ids=np.asarray(prompt_ids),
        output_ids=out,
        logprobs=np.full(n, np.log(0.5)),
        sampled_logprobs=np.full(n, np.log(0.6)),
        support_offsets=np.arange(0, 2 * n + 1, 2),
        support_ids=np.stack([out, other], 1).reshape(-1),
        support_logprobs=np.tile(np.log([0.6, 0.4]), n).astype(np.float32),
        weight_versions=np.zeros(n, dtype=np.int64),
        candidate_mode=candidate_mode,
        group=group,
        finish_reason="stop",
    )
