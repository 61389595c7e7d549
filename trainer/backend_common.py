"""What both trainer backends (trainer/backend_hf.py, trainer/backend_megatron.py) share: the optimizer
configuration and the conversion of a FlatBatch into the objective's TokenBatch.

The trainer keeps fp32 master weights; what it PUBLISHES is the BF16 (or quantized) view, so every
sampler group, even a bf16 one, sees weights rounded away from the trainer's, plus its own kernels:
exactly the mismatch the objective corrects (docs/objective.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlfleet.records import SUPPORT_MODE
from rlfleet.trainer.batching import FlatBatch
from rlfleet.trainer.objective import TokenBatch


@dataclass
class OptimConfig:
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    betas: tuple[float, float] = (0.9, 0.99)

    def adamw(self, params: Any) -> torch.optim.AdamW:
        """The one optimizer the transformers backend (and megatron's fp32 master copy) train with."""
        return torch.optim.AdamW(params, lr=self.learning_rate, weight_decay=self.weight_decay, betas=self.betas)


def to_token_batch(flat: FlatBatch, group_index: dict[str, int]) -> TokenBatch:
    """FlatBatch (numpy, CSR candidates) -> the objective's TokenBatch (torch, padded [T, K])."""
    t = flat.num_tokens
    counts = np.diff(flat.cand_offsets)
    k = int(counts.max()) if t else 0
    cand_ids = np.full((t, k), -1, dtype=np.int64)
    cand_lq = np.full((t, k), -np.inf, dtype=np.float32)
    if t and k:
        rows = np.repeat(np.arange(t), counts)
        cols = np.arange(len(flat.cand_ids)) - np.repeat(flat.cand_offsets[:-1], counts)
        cand_ids[rows, cols] = flat.cand_ids
        cand_lq[rows, cols] = flat.cand_logq
    support = flat.candidate_mode == SUPPORT_MODE
    # In support mode the objective compares with q renormalised inside the support; in head mode with
    # the full-vocabulary q.
    logq = flat.logq_support if support else flat.logq
    return TokenBatch(
        tokens=torch.from_numpy(flat.target_ids),
        advantages=torch.from_numpy(flat.advantages),
        loss_mask=torch.ones(t, dtype=torch.bool),
        sampler_logprobs=torch.from_numpy(np.ascontiguousarray(logq, dtype=np.float32)),
        candidate_ids=torch.from_numpy(cand_ids),
        candidate_logprobs=torch.from_numpy(cand_lq),
        candidates_are_support=support,
        group_ids=torch.tensor([group_index.get(g, len(group_index)) for g in flat.groups], dtype=torch.long),
        staleness=torch.from_numpy(flat.staleness),
    )
