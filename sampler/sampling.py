"""Sampling exactly as SGLang's torch reference (`top_k_top_p_min_p_sampling_from_probs_torch`).

Per row: probs = softmax(logits / T); sort descending; keep rank < top_k; keep where the EXCLUSIVE
cumulative sum (cumsum - p) <= top_p, so the token that crosses top_p is kept; then min-p keeps
p >= min_p * p_max; sample from the kept probabilities renormalised. The kept set is always a prefix
of the sorted order, returned sorted by probability desc with log q renormalised inside it: these are
the values the sample was really drawn from.

Deviations, stated: sorting is stable (ties ordered by token id) where SGLang's GPU sort leaves tie
order unspecified; the draw is an inverse-CDF lookup with one uniform per token from a per-request
generator (seeded by `sampling_seed`, so a request is reproducible whatever it is batched with) instead
of torch.multinomial. Temperature 0 is greedy the SGLang way: temperature 1 and top_k 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SAMPLING_EPS = 1e-6


@dataclass
class RowParams:
    temperature: float
    top_p: float
    top_k: int  # -1 = whole vocabulary
    min_p: float

    def normalised(self) -> RowParams:
        if self.temperature < SAMPLING_EPS:  # SGLang: greedy = temperature 1, top_k 1
            return RowParams(1.0, self.top_p, 1, self.min_p)
        return self


@dataclass
class SampleResult:
    token_ids: torch.Tensor  # int64 [B] sampled ids
    logprobs: torch.Tensor  # float32 [B] full-vocab log q(y) at the temperature (before truncation)
    sorted_ids: torch.Tensor  # int64 [B, V] ids by probability desc
    sorted_logprobs: torch.Tensor  # float32 [B, V] full-vocab log q in that order (the head for top_logprobs)
    kept: torch.Tensor  # int64 [B] size of the kept prefix
    kept_logprobs: torch.Tensor  # float32 [B, V] log q renormalised inside the kept prefix (-inf beyond)
    sampled_rank: torch.Tensor  # int64 [B] position of y in the sorted order (< kept)


def sample(logits: torch.Tensor, params: list[RowParams], uniforms: torch.Tensor) -> SampleResult:
    """logits float32 [B, V], one RowParams and one uniform in [0, 1) per row -> SampleResult."""
    bsz, vocab = logits.shape
    ps = [p.normalised() for p in params]
    temps = torch.tensor([p.temperature for p in ps], dtype=torch.float32)[:, None]
    top_ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in ps], dtype=torch.int64)[:, None]
    top_ps = torch.tensor([p.top_p for p in ps], dtype=torch.float32)[:, None]
    min_ps = torch.tensor([p.min_p for p in ps], dtype=torch.float32)[:, None]

    logprobs_full = torch.log_softmax(logits.float() / temps, dim=-1)  # [B, V]
    probs = logprobs_full.exp()
    probs_sort, idx = probs.sort(dim=-1, descending=True, stable=True)  # [B, V]
    probs_sum = probs_sort.cumsum(dim=-1)
    rank = torch.arange(vocab)[None, :]
    keep = rank < top_ks
    keep &= (probs_sum - probs_sort) <= top_ps  # exclusive cumsum: the crossing token stays
    keep &= probs_sort >= probs_sort[:, :1] * min_ps
    keep[:, 0] = True  # the most likely token is always kept (also guards top_p rounding)
    kept = keep.sum(dim=-1)  # [B]; keep is a prefix: every condition is monotone in rank

    lp_sorted = logprobs_full.gather(1, idx)  # [B, V]
    masked = lp_sorted.masked_fill(~keep, float("-inf"))
    kept_lp = masked - torch.logsumexp(masked, dim=-1, keepdim=True)  # renormalised inside the kept set
    cdf = kept_lp.exp().cumsum(dim=-1)  # [B, V], reaches ~1 at the end of the kept prefix
    target = uniforms.float()[:, None] * cdf[:, -1:]
    pos = torch.searchsorted(cdf, target, right=True).squeeze(1)
    pos = torch.minimum(pos, kept - 1)  # fp slack can never step outside the kept set
    y = idx.gather(1, pos[:, None]).squeeze(1)
    return SampleResult(
        token_ids=y,
        logprobs=logprobs_full.gather(1, y[:, None]).squeeze(1),
        sorted_ids=idx,
        sorted_logprobs=lp_sorted,
        kept=kept,
        kept_logprobs=kept_lp,
        sampled_rank=pos,
    )
