"""The `torch` backend: TinyGPT on CPU (the reference trainer), AdamW, the corrected objective.

The trainer keeps fp32 master weights and computes in fp32 on CPU (bf16 matmuls on CPU would only add
noise to a reference); what it PUBLISHES is the BF16 view, so every sampler group, even the bf16 one,
sees weights rounded away from the trainer's, plus its own emulated kernels: exactly the mismatch
the objective corrects.

Logits: the row of a sampled token at position s is the model's output at s - 1, divided by the
sampling temperature (method.md: z_t are trainer logits / T), gathered to [T, V] for the objective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlfleet.numerics.tinygpt import TinyGPT, TinyGPTConfig
from rlfleet.records import SUPPORT_MODE
from rlfleet.trainer.batching import FlatBatch
from rlfleet.trainer.objective import LossOutput, ObjectiveConfig, TokenBatch, policy_loss


@dataclass
class OptimConfig:
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    betas: tuple[float, float] = (0.9, 0.99)

    def adamw(self, params: Any) -> torch.optim.AdamW:
        """The one optimizer both torch-side backends (TinyGPT and HF) train with."""
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


class TorchBackend:
    name = "torch"

    def __init__(
        self,
        model_config: TinyGPTConfig,
        objective: ObjectiveConfig,
        optim: OptimConfig | None = None,
        temperature: float = 1.0,
        threads: int | None = None,
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.model_config = model_config
        self.model = TinyGPT(model_config)
        self.objective = objective
        self.optim_config = optim or OptimConfig()
        self.temperature = temperature
        self.optimizer = self.optim_config.adamw(self.model.parameters())

    def row_logits(self, flat: FlatBatch) -> torch.Tensor:
        """Logits [T, V] (divided by the temperature) at the rows of the sampled tokens."""
        logits = self.model(torch.from_numpy(flat.input_ids))  # [B, S, V]
        rows = logits[torch.from_numpy(flat.row_seq), torch.from_numpy(flat.row_pos)]  # [T, V]
        return rows / self.temperature

    def train_step(self, flat: FlatBatch, group_index: dict[str, int]) -> tuple[LossOutput, float]:
        """One optimizer step on the batch; returns the objective's output and the pre-clip grad norm."""
        self.model.train()
        batch = to_token_batch(flat, group_index)
        out = policy_loss(self.row_logits(flat), batch, self.objective)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_config.max_grad_norm))
        if np.isfinite(grad_norm):
            self.optimizer.step()
        return out, grad_norm

    def weights(self) -> dict[str, torch.Tensor]:
        """HF-named fp32 state dict (the publisher makes the views)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
