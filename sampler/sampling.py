"""One sampler step exactly as SGLang 0.5.23's `Sampler.forward` with `--sampling-backend pytorch`
(the default here), or with the kept sets of its CUDA default `flashinfer` (`backend="flashinfer"`).

SGLang picks the pytorch backend wherever FlashInfer is absent (srt/arg_groups/overrides.py
`_sampling_backend_default`), i.e. on every CPU device, so this is the SGLang path the reference
server can run and the one the contract tests hold it against (tests/sglang_contract/
test_sglang_reference_sampler.py runs SGLang's own functions on the same logits). Per batch:

- all rows greedy (top_k <= 1 after normalisation): argmax of the raw logits; logprobs are
  log_softmax(logits) WITHOUT temperature (SGLang's `is_all_greedy` branch); the mask is the token
  alone with logprob 0;
- otherwise: probs = softmax(logits / T) (float32); `top_k_top_p_min_p_sampling_from_probs_torch`:
  descending sort, zero ranks >= top_k, zero where the EXCLUSIVE cumsum of the full sorted
  distribution > top_p (the crossing token stays; top_p = 1 still compares, so a float32 cumsum that
  overshoots 1 drops tail tokens), then min-p: zero p < p_max * min_p; draw from the zeroed weights;
  logprobs are log(probs) (before truncation). The kept set is the positive weights (a probability
  that underflowed to 0 is never in it), in sort order, with log(w / sum w) as support logprobs
  (`Sampler._build_sampling_mask_output`); a support over `--sampling-mask-max-tokens` is OVERFLOW,
  a sampled token outside it INVALID.

Every logprob is clamped at float32's min like SGLang's `OutputLogprobProcessor.compute_logprobs`.

`backend="flashinfer"` reproduces the CUDA path's captured support (`flashinfer_filtered_probs`):
no top-p filter when no row has top_p < 1, ties at the top-k / top-p cutoffs kept (so a support can
exceed top_k and overflow the cap: a 400 mid-request), and with min_p > 0 the sequential top-k ->
top-p on the renormalised probabilities -> min-p. SGLang's composition of the kernels is checked
against its code with the kernels emulated (they are CUDA-only; semantics from FlashInfer's docs).

Deviation, stated: the draw is `torch.multinomial` per row with the request's own generator (seeded
by `sampling_seed`, so a request is reproducible whatever it is batched with); SGLang draws the whole
batch from the global generator and ignores `sampling_seed` unless deterministic inference is on.
Only the draw differs: kept sets, orders and logprobs are SGLang's, to the bit on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

SAMPLING_EPS = 1e-6  # SGLang sampling_params._SAMPLING_EPS
TOP_K_ALL = 1 << 30  # SGLang sampling_params.TOP_K_ALL: top_k -1 means the whole vocabulary


class MaskStatus(IntEnum):
    """SGLang's SamplingMaskStatus (srt/layers/logits_processor.py)."""

    OK = 0
    OVERFLOW = 1
    INVALID = 2


@dataclass(frozen=True)
class RowParams:
    temperature: float
    top_p: float
    top_k: int  # -1 or TOP_K_ALL = whole vocabulary
    min_p: float

    def normalised(self) -> RowParams:
        """SGLang's SamplingParams.__post_init__: temperature < 1e-6 is greedy (T 1, top_k 1), -1 is ALL."""
        if 0 <= self.temperature < SAMPLING_EPS:
            return RowParams(1.0, self.top_p, 1, self.min_p)
        if self.top_k == -1:
            return RowParams(self.temperature, self.top_p, TOP_K_ALL, self.min_p)
        return self


@dataclass
class SampleResult:
    token_ids: torch.Tensor  # int64 [B] sampled ids
    logprobs: torch.Tensor  # float32 [B, V] what output_token_logprobs / output_top_logprobs read
    mask_ids: torch.Tensor  # int32 [B, P] kept ids by weight desc (P = min(cap, V)); valid up to lengths
    mask_lengths: torch.Tensor  # int32 [B] realised support size, clamped at P
    selected_logprobs: torch.Tensor  # float32 [B] log q_S(y) (selected mode)
    support_logprobs: torch.Tensor  # float32 [B, P] log q_S over the mask (support mode)
    statuses: torch.Tensor  # int32 [B] MaskStatus

    def token_logprob(self, b: int) -> float:
        return float(self.logprobs[b, int(self.token_ids[b])])

    def top_logprobs(self, nums: list[int]) -> list[list[list] | None]:
        """Per row [[logprob, id, None], ...] of its top nums[b] (None where 0): SGLang's get_top_logprobs
        takes one topk of the batch's largest k and slices it, which fixes the order of ties."""
        max_k = max(nums, default=0)
        if max_k <= 0:
            return [None] * len(nums)
        values, indices = self.logprobs.topk(max_k, dim=-1)
        vals, idx = values.tolist(), indices.tolist()
        return [
            [[v, i, None] for v, i in zip(vals[b][:k], idx[b][:k], strict=True)] if k > 0 else None
            for b, k in enumerate(nums)
        ]

    def mask(self, b: int) -> tuple[list[int], list[float]]:
        n = int(self.mask_lengths[b])
        return self.mask_ids[b, :n].tolist(), self.support_logprobs[b, :n].tolist()


SAMPLING_BACKENDS = ("pytorch", "flashinfer")


def sample(
    logits: torch.Tensor,
    params: list[RowParams],
    generators: list[torch.Generator | None],
    mask_max_tokens: int = 4096,
    backend: str = "pytorch",
) -> SampleResult:
    """logits float32 [B, V], one RowParams and one generator per row -> SampleResult. `backend`:
    SGLang's --sampling-backend whose kept sets to reproduce (see `flashinfer_filtered_probs`)."""
    bsz, vocab = logits.shape
    ps = [p.normalised() for p in params]
    logits = logits.float().clone()
    if all(p.top_k <= 1 for p in ps):  # SGLang: sampling_info.is_all_greedy
        ids = torch.argmax(logits, -1)
        logprobs = torch.log_softmax(logits, dim=-1)
        logprobs.clamp_(min=torch.finfo(logprobs.dtype).min)
        packed = min(mask_max_tokens, vocab)
        mask_ids = torch.zeros(bsz, packed, dtype=torch.int32)
        mask_ids[:, 0] = ids.to(torch.int32)
        return SampleResult(
            token_ids=ids,
            logprobs=logprobs,
            mask_ids=mask_ids,
            mask_lengths=torch.ones(bsz, dtype=torch.int32),
            selected_logprobs=torch.zeros(bsz, dtype=torch.float32),
            support_logprobs=torch.zeros(bsz, packed, dtype=torch.float32),
            statuses=torch.zeros(bsz, dtype=torch.int32),
        )
    temperatures = torch.tensor([p.temperature for p in ps], dtype=torch.float32).view(-1, 1)
    top_ks = torch.tensor([p.top_k for p in ps], dtype=torch.int64)
    top_ps = torch.tensor([p.top_p for p in ps], dtype=torch.float32)
    min_ps = torch.tensor([p.min_p for p in ps], dtype=torch.float32)
    logits.div_(temperatures)
    probs = torch.softmax(logits, dim=-1)
    need_min_p = any(p.min_p > 0 for p in ps)
    order: torch.Tensor | None = None
    if backend == "flashinfer":  # full-vocabulary weights, packed by torch.topk (SGLang's token_ids=None)
        weights = flashinfer_filtered_probs(
            probs,
            top_ks,
            top_ps,
            min_ps,
            any(p.top_k != TOP_K_ALL for p in ps),
            any(p.top_p != 1.0 for p in ps),
            need_min_p,
        )
    else:
        weights, order = filtered_probs(probs, top_ks, top_ps, min_ps, need_min_p)
    sampled_index = torch.cat(
        [torch.multinomial(weights[b : b + 1], 1, generator=generators[b]) for b in range(bsz)]
    )  # [B, 1]
    selected_weight = torch.gather(weights, 1, sampled_index).view(-1)
    token_ids = sampled_index.view(-1) if order is None else torch.gather(order, 1, sampled_index).view(-1)
    logprobs = torch.log(probs)
    logprobs.clamp_(min=torch.finfo(logprobs.dtype).min)
    mask_ids, lengths, selected, support, statuses = pack_mask(
        token_ids, weights, order, selected_weight, mask_max_tokens
    )
    return SampleResult(
        token_ids=token_ids.long(),
        logprobs=logprobs,
        mask_ids=mask_ids,
        mask_lengths=lengths,
        selected_logprobs=selected,
        support_logprobs=support,
        statuses=statuses,
    )


def filtered_probs(
    probs: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    need_min_p_sampling: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The filter of SGLang's `top_k_top_p_min_p_sampling_from_probs_torch` (the same torch ops in the
    same order) -> (sorted weights with the dropped ones zeroed [B, V], int32 token ids in that order)."""
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    probs_sort[torch.arange(0, probs_sort.shape[-1]).view(1, -1) >= top_ks.view(-1, 1)] = 0.0
    probs_sort[(probs_sum - probs_sort) > top_ps.view(-1, 1)] = 0.0
    if need_min_p_sampling:
        min_p_thresholds = probs_sort[:, 0] * min_ps
        probs_sort[probs_sort < min_p_thresholds.view(-1, 1)] = 0.0
    return probs_sort, probs_idx.to(torch.int32)


def top_k_renorm_prob(probs: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """FlashInfer's top_k_renorm_probs (a CUDA kernel, emulated): keep the probabilities >= the k-th
    largest (ties at the cutoff all stay, so more than k can remain), zero the rest, renormalise."""
    k = top_ks.clamp(max=probs.shape[-1]).long().view(-1, 1)
    kth = probs.sort(dim=-1, descending=True).values.gather(1, k - 1)
    kept = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def top_p_renorm_prob(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """FlashInfer's top_p_renorm_probs (a CUDA kernel, emulated): "mask out the probabilities less than
    threshold where the cumulative sum of probs[probs >= threshold] is top_p" (its docs), i.e. keep
    p >= the probability at which the sorted cumsum reaches top_p (ties stay), renormalise."""
    ordered = probs.sort(dim=-1, descending=True).values
    reach = (ordered.cumsum(dim=-1) < top_ps.view(-1, 1)).sum(dim=-1).clamp(max=probs.shape[-1] - 1)
    threshold = ordered.gather(1, reach.view(-1, 1))
    kept = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def flashinfer_filtered_probs(
    probs: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    need_top_k_sampling: bool,
    need_top_p_sampling: bool,
    need_min_p_sampling: bool,
) -> torch.Tensor:
    """The support SGLang's CUDA default (`--sampling-backend flashinfer`) captures
    (`Sampler._sample_from_probs`): with min-p, top-k, then top-p on the renormalised top-k
    probabilities, then p < p_max * min_p (sequential); otherwise the joint top-k and top-p supports,
    each filter only when some row of the batch needs it (top_p = 1 everywhere: no top-p filter).
    Full-vocabulary weights [B, V]; the kernels are the emulations above."""
    if not (need_top_k_sampling or need_top_p_sampling or need_min_p_sampling):
        return probs
    if need_min_p_sampling:
        renormed = top_p_renorm_prob(top_k_renorm_prob(probs, top_ks), top_ps)
        thresholds = renormed.max(dim=-1).values * min_ps
        return renormed.masked_fill(renormed < thresholds.view(-1, 1), 0)
    filtered = probs
    if need_top_k_sampling:
        filtered = top_k_renorm_prob(probs, top_ks)
    if need_top_p_sampling:
        top_p_probs = top_p_renorm_prob(probs, top_ps)
        filtered = top_p_probs if filtered is probs else filtered.masked_fill(top_p_probs <= 0, 0)
    return filtered


def pack_mask(
    sampled: torch.Tensor,
    weights: torch.Tensor,
    token_ids: torch.Tensor | None,
    selected_weight: torch.Tensor,
    mask_max_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's `Sampler._build_sampling_mask_output`: `token_ids` are the ids of sorted weights (the
    pytorch producer) or None (full-vocabulary weights, packed by torch.topk) -> (ids [B, P], lengths
    [B], selected logprobs [B], support logprobs [B, P], statuses [B])."""
    sampled_tokens = sampled.view(-1, 1)
    if token_ids is None:
        sampled_in_capture = torch.gather(weights, 1, sampled_tokens.long()).squeeze(1) > 0
    else:
        sampled_in_capture = (token_ids == sampled_tokens.to(torch.int32)).any(dim=-1)
    support = weights > 0
    support_mass = torch.where(support, weights, torch.zeros_like(weights)).sum(dim=-1, dtype=torch.float32)
    selected_logprobs = torch.log(selected_weight.float() / support_mass)
    invalid = ~(
        sampled_in_capture & (selected_weight > 0) & (support_mass > 0) & torch.isfinite(selected_logprobs)
    )
    realized_lengths = support.sum(dim=-1, dtype=torch.int32)
    overflow = realized_lengths > mask_max_tokens
    statuses = torch.where(
        invalid,
        int(MaskStatus.INVALID),
        torch.where(overflow, int(MaskStatus.OVERFLOW), int(MaskStatus.OK)),
    ).to(torch.int32)
    packed_size = min(mask_max_tokens, weights.shape[-1])
    if token_ids is None:
        packed_weights, packed_positions = torch.topk(
            weights, k=packed_size, dim=-1, largest=True, sorted=True
        )
        packed_ids = packed_positions.to(torch.int32)
    else:
        packed_ids = token_ids[:, :packed_size].contiguous()
        packed_weights = weights[:, :packed_size]
    support_logprobs = torch.log(packed_weights.float() / support_mass.unsqueeze(-1))
    return packed_ids, realized_lengths.clamp(max=packed_size), selected_logprobs, support_logprobs, statuses
