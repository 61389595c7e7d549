"""Token records: what a sampler produced, token-exact, as the trainer must score it.

This is the contract between the sampler side (which fills it from SGLang's `meta_info`), the rollout
driver (which assembles trajectories) and the objective (which turns a batch into a `TokenBatch`).
Arrays are numpy so that the core and the operator never import torch.

Support sets are stored CSR-style: the support of output token i is
`support_ids[support_offsets[i]:support_offsets[i+1]]` (sorted by probability, descending) with the
matching `support_logprobs` (renormalised inside the support in `support` mode; a top-K head of the
full-vocabulary distribution in `head` mode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# How the candidate sets of a turn relate to the sampler's distribution q.
SUPPORT_MODE = "support"  # candidates are the exact sampling support (top-k ∩ top-p); q sums to 1 on it
HEAD_MODE = "head"  # candidates are a top-K head of the full-vocabulary q (output_top_logprobs)


@dataclass
class SampledTurn:
    """One `/generate` call: the ids sent, the ids produced, and q as the sampler really used it."""

    prompt_ids: np.ndarray  # int32 [P]   the input_ids sent, verbatim (never re-tokenised)
    output_ids: np.ndarray  # int32 [n]   sampled token ids
    logprobs: np.ndarray  # float32 [n] full-vocab log q(y) at the sampling temperature (before top-k/p)
    sampled_logprobs: np.ndarray  # float32 [n] log q_S(y) renormalised inside the support (NaN if absent)
    support_offsets: np.ndarray  # int32 [n + 1] CSR row pointers into support_ids / support_logprobs
    support_ids: np.ndarray  # int32 [nnz] candidate ids per token, sorted by probability desc
    support_logprobs: np.ndarray  # float32 [nnz] log q over the candidates (see candidate_mode)
    weight_versions: np.ndarray  # int64 [n] weight version that produced each token
    candidate_mode: str = SUPPORT_MODE  # SUPPORT_MODE or HEAD_MODE
    finish_reason: str = ""  # "stop" | "length" | "abort" | ...
    group: str = ""  # sampler group name
    replica: str = ""  # replica (pod / server) that produced it
    valid: np.ndarray | None = None  # bool [n]; None until validated
    invalid_reasons: dict[str, int] = field(default_factory=dict)  # reason -> count of tokens

    @property
    def num_tokens(self) -> int:
        return int(self.output_ids.shape[0])
