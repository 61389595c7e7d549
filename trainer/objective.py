"""The corrected policy-gradient objective: SC + MIS + top-p mask replay (docs/method.md).

Per valid token t with sampled token y, detached advantage A, candidates C (the sampler's support S
or a top-K head H of its full-vocabulary q):

    loss_t = -A [ sg(w_y) log p(y) - sum_{v in C} sg(c_v) log p(v) ]

    w_y = 1 (pg, sc) or f(r_y) (mis, sc_mis), with r = p / q and f(r) = r inside [mis_low, mis_high], else 0
    c_v = 0 (pg, mis)
        = q_v f(r_v)              support mode (f = 1 for sc); exact, because q lives on C
        = q_v f(r_v) - alpha p_v  head mode: the tail outside H is modelled as q = rho * p with
                                  rho = (1 - sum_H q) / (1 - sum_H p) (both masses clamped >= 1e-6),
                                  alpha = rho (sc) or 1[1/mis_high <= rho <= 1/mis_low] (sc_mis)

With `replay` (support mode only) p is replaced by p_S, the trainer's softmax renormalised inside
the sampler's support, and logits outside the support get no gradient. The loss is a token mean
over the valid, loss-masked tokens of the call.

Memory: the trainer hands the final hidden states [T, H] and the output embedding [V, H]; the logits
are made tile by tile (`chunk_tokens` x `chunk_vocab`) in forward and again in backward
(trainer/vocab_parallel.py `fused_log_softmax_at`), so no [T, V] tensor exists, not even the
gradient of the logits: backward turns each tile straight into the gradients of the hidden states
and of the weight.

Framework-agnostic: plain torch, no other rlfleet import. Tensor parallel: pass the vocabulary shard
of the output embedding [V / tp, H] and the tensor-parallel process group; the loss and metrics are
replicated, the weight shard's gradient exact, the hidden states' gradient a per-shard partial sum
the caller reduces (megatron's output-layer input mapping does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlfleet.trainer.vocab_parallel import compute_dtype, fused_log_softmax_at

# (ids [T, M], normalise) -> (log p at ids, or the logits at ids without normalise; lse [T]; entropy [T])
Projection = Callable[[Tensor, bool], tuple[Tensor, Tensor, Tensor]]

MODES = ("pg", "mis", "sc", "sc_mis")
STALENESS_BUCKETS = ("0-1", "2-3", "4-5", "6+")
# RLJob `correction.mode` (rlfleet.api) -> (objective mode, replay).
CORRECTION_MODES = {
    "none": ("pg", False),
    "mis": ("mis", False),
    "sc": ("sc", False),
    "sc-mis": ("sc_mis", False),
    "sc-mis-topp": ("sc_mis", True),
}
LOG_RATIO_CLAMP = 20.0  # |log r| cap: keeps exp() finite; anything beyond is out of any MIS band
MASS_FLOOR = 1e-6  # method.md: clamp both tail masses of rho at >= 1e-6


@dataclass
class TokenBatch:
    """T generated tokens (any number of sequences, flattened), as the sampler produced them."""

    tokens: Tensor  # int64 [T] sampled token ids y
    advantages: Tensor  # float [T] detached advantages A
    loss_mask: Tensor  # bool or 0/1 float [T]; tokens with mask 0 are ignored entirely
    sampler_logprobs: Tensor  # float [T] log q(y); in support mode renormalised inside the support
    candidate_ids: Tensor  # int64 [T, K] candidate ids, -1 = padding
    candidate_logprobs: Tensor  # float [T, K] log q over the candidates, -inf = padding
    candidates_are_support: bool  # True: candidates are the exact sampling support (q sums to 1 on it)
    group_ids: Tensor | None = None  # int64 [T] sampler group of each token (for per-group metrics)
    staleness: Tensor | None = None  # int64 [T] trainer version - weight version used (>= 0)
    old_logprobs: Tensor | None = None  # float [T] log p_old(y) for the optional PPO clip

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def select(self, rows: Tensor) -> TokenBatch:
        """The batch restricted to `rows` (int64 token indices or a bool mask over the T tokens):
        every tensor field is per token ([T] or [T, K]), so each is indexed alike; the flag is kept."""
        picked = {f.name: getattr(self, f.name) for f in fields(self)}
        indexed: dict[str, Any] = {k: v[rows] for k, v in picked.items() if isinstance(v, Tensor)}
        return replace(self, **indexed)

    def to(self, device: torch.device | str) -> TokenBatch:
        """The batch with every tensor field on `device` (the flag kept)."""
        moved: dict[str, Any] = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return replace(self, **moved)


@dataclass(frozen=True)
class ObjectiveConfig:
    mode: str = "sc_mis"  # pg | mis | sc | sc_mis
    mis_low: float = 0.2  # MIS band [mis_low, mis_high] on r = p / q
    mis_high: float = 5.0
    replay: bool = False  # renormalise p inside the sampler's support; needs candidates_are_support
    ppo_clip: bool = False  # clip the sampled-token term against batch.old_logprobs (batch reuse)
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    chunk_tokens: int = (
        512  # rows of one logits tile of the fused lm_head (extra memory ~ chunk_tokens x chunk_vocab)
    )
    chunk_vocab: int = 8192  # vocabulary columns of one logits tile

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"ObjectiveConfig.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 0.0 <= self.mis_low < self.mis_high:
            raise ValueError(f"need 0 <= mis_low < mis_high, got [{self.mis_low}, {self.mis_high}]")
        if not (0.0 <= self.clip_eps_low < 1.0 and self.clip_eps_high >= 0.0):
            raise ValueError(
                f"need 0 <= clip_eps_low < 1 and clip_eps_high >= 0, got {self.clip_eps_low}, {self.clip_eps_high}"
            )
        if self.chunk_tokens < 1 or self.chunk_vocab < 1:
            raise ValueError(
                f"chunk_tokens and chunk_vocab must be >= 1, got {self.chunk_tokens}, {self.chunk_vocab}"
            )

    @classmethod
    def from_correction(cls, correction_mode: str, **overrides: object) -> ObjectiveConfig:
        """Config for an RLJob `correction.mode` (none | mis | sc | sc-mis | sc-mis-topp)."""
        if correction_mode not in CORRECTION_MODES:
            raise ValueError(
                f"unknown correction mode {correction_mode!r}; expected one of {', '.join(CORRECTION_MODES)}"
            )
        mode, replay = CORRECTION_MODES[correction_mode]
        return cls(mode=mode, replay=replay, **overrides)  # type: ignore[arg-type]

    @property
    def uses_mis(self) -> bool:
        return self.mode in ("mis", "sc_mis")

    @property
    def uses_centering(self) -> bool:
        return self.mode in ("sc", "sc_mis")


@dataclass
class LossOutput:
    loss: Tensor  # scalar: token mean over the valid tokens (0 with a grad_fn if there are none)
    metrics: dict[str, float]  # batch metrics (see docs/objective.md)
    per_group: dict[int, dict[str, float]] = field(default_factory=dict)  # group id -> metrics
    per_staleness: dict[str, dict[str, float]] = field(default_factory=dict)  # "0-1".."6+" -> metrics
    loss_sum: Tensor | None = None  # scalar: sum over valid tokens, for a token mean across micro-batches
    num_valid_tokens: int = 0


# ----------------------------------------------------------------------------------------------
# Input checks: inconsistent config or shapes are programming errors -> ValueError, immediately.
# ----------------------------------------------------------------------------------------------


def _check_inputs(num_tokens: int, batch: TokenBatch, config: ObjectiveConfig) -> None:
    if config.replay and not batch.candidates_are_support:
        raise ValueError(
            "replay=True needs candidates_are_support=True (a head of q is not a sampling support)"
        )
    _check_batch_shapes(batch, num_tokens=num_tokens)
    _check_batch_values(batch, config)


def _check_projection(hidden: Tensor, weight: Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [T, H] and the output weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[1]} != the output weight's {weight.shape[1]}")
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"hidden and weight must be floating point, got {hidden.dtype}, {weight.dtype}")


def _check_batch_shapes(batch: TokenBatch, num_tokens: int) -> None:
    """Every per-token field is [T] and the candidates [T, K], T the logits' token count."""
    for name in (
        "tokens",
        "advantages",
        "loss_mask",
        "sampler_logprobs",
        "group_ids",
        "staleness",
        "old_logprobs",
    ):
        value = getattr(batch, name)
        if value is not None and tuple(value.shape) != (num_tokens,):
            raise ValueError(f"batch.{name} must have shape [T] = ({num_tokens},), got {tuple(value.shape)}")
    if batch.candidate_ids.dim() != 2 or batch.candidate_ids.shape[0] != num_tokens:
        raise ValueError(
            f"batch.candidate_ids must be [T, K] with T = {num_tokens}, got {tuple(batch.candidate_ids.shape)}"
        )
    if batch.candidate_logprobs.shape != batch.candidate_ids.shape:
        raise ValueError(
            f"batch.candidate_logprobs {tuple(batch.candidate_logprobs.shape)} must match candidate_ids {tuple(batch.candidate_ids.shape)}"
        )


def _check_batch_values(batch: TokenBatch, config: ObjectiveConfig) -> None:
    """Integer ids, old logprobs when PPO clipping asks for them, no negative staleness."""
    for name in ("tokens", "candidate_ids", "group_ids", "staleness"):
        value = getattr(batch, name)
        if value is not None and value.is_floating_point():
            raise ValueError(f"batch.{name} must be an integer tensor, got {value.dtype}")
    if config.ppo_clip and batch.old_logprobs is None:
        raise ValueError("ppo_clip=True needs batch.old_logprobs")
    if batch.staleness is not None and bool((batch.staleness < 0).any()):
        raise ValueError("batch.staleness must be >= 0 (trainer version - weight version)")


# ----------------------------------------------------------------------------------------------
# Record screening: malformed sampler records are excluded and counted, never raised.
# ----------------------------------------------------------------------------------------------


@dataclass
class _Screened:
    valid: Tensor  # bool [T] usable tokens (loss-masked in and well-formed)
    present: Tensor  # bool [T, K] real (non-padding) candidates of valid tokens
    ids: Tensor  # int64 [T, 1 + K] y then the candidates; every entry a legal id (padding -> 0)
    log_q_y: Tensor  # [T] log q(y), 0 where invalid
    log_q_cand: Tensor  # [T, K] log q over candidates, -inf at padding
    advantages: Tensor  # [T] 0 where invalid
    old_logprobs: Tensor | None  # [T] 0 where invalid


def _screen_records(
    batch: TokenBatch, config: ObjectiveConfig, vocab_size: int, dtype: torch.dtype
) -> _Screened:
    tokens = batch.tokens.long()
    cand_ids = batch.candidate_ids.long()
    log_q_cand = batch.candidate_logprobs.to(dtype)
    log_q_y = batch.sampler_logprobs.to(dtype)
    advantages = batch.advantages.to(dtype)

    present = cand_ids >= 0  # [T, K]
    # A real candidate needs a legal id and a log q that is not NaN or +inf (-inf, i.e. q = 0, is fine).
    bad_candidate = present & (
        (cand_ids >= vocab_size) | torch.isnan(log_q_cand) | (log_q_cand == float("inf"))
    )
    # Duplicate ids would count one token's probability twice.
    sorted_ids = torch.where(present, cand_ids, -1).sort(dim=1).values
    duplicate = ((sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (sorted_ids[:, 1:] >= 0)).any(dim=1)

    valid = batch.loss_mask > 0
    valid &= (tokens >= 0) & (tokens < vocab_size)
    valid &= torch.isfinite(log_q_y)  # NaN, +inf and q(y) = 0 (-inf) are all unusable
    valid &= torch.isfinite(advantages)
    valid &= ~bad_candidate.any(dim=1) & ~duplicate
    has_candidates = present.any(dim=1)
    if batch.candidates_are_support:
        # The sampled token must lie in the support it was sampled from, and q(y) must be positive.
        y_in_support = ((cand_ids == tokens[:, None]) & present & (log_q_cand > float("-inf"))).any(dim=1)
        valid &= has_candidates & y_in_support
    elif config.uses_centering:
        valid &= has_candidates  # an empty head would silently drop the correction
    old = None
    if config.ppo_clip:
        old = batch.old_logprobs.to(dtype)  # type: ignore[union-attr]
        valid &= torch.isfinite(old)
        old = torch.where(valid, old, 0.0)

    present &= valid[:, None]
    safe_tokens = torch.where(valid, tokens, 0)
    safe_cand = torch.where(present, cand_ids, 0)
    return _Screened(
        valid=valid,
        present=present,
        ids=torch.cat([safe_tokens[:, None], safe_cand], dim=1),
        log_q_y=torch.where(valid, log_q_y, 0.0),
        log_q_cand=torch.where(present, log_q_cand, float("-inf")),
        advantages=torch.where(valid, advantages, 0.0),
        old_logprobs=old,
    )


# ----------------------------------------------------------------------------------------------
# Trainer log-probabilities: full vocabulary (chunked, possibly sharded) or replayed inside S.
# ----------------------------------------------------------------------------------------------


@dataclass
class _TrainerLogprobs:
    log_p_y: Tensor  # [T] differentiable, 0 where invalid
    log_p_cand: Tensor  # [T, K] differentiable, 0 at padding / invalid rows
    entropy: Tensor  # [T] entropy of p (or of p_S under replay), detached
    valid: Tensor  # bool [T] screening AND finite trainer values


def _full_vocab_logprobs(project: Projection, rec: _Screened) -> _TrainerLogprobs:
    log_p, lse, entropy = project(rec.ids, True)  # [T, 1 + K], [T], [T]
    log_p_y, log_p_cand = log_p[:, 0], log_p[:, 1:]
    # NaN/inf trainer logits and candidates the trainer finds impossible (-inf) make the token unusable.
    cand_finite = torch.isfinite(log_p_cand.detach()) | ~rec.present
    valid = rec.valid & torch.isfinite(lse) & torch.isfinite(log_p_y.detach()) & cand_finite.all(dim=1)
    present = rec.present & valid[:, None]
    # torch.where (not multiplication by 0) so that excluded entries get an exact zero gradient.
    return _TrainerLogprobs(
        log_p_y=torch.where(valid, log_p_y, 0.0),
        log_p_cand=torch.where(present, log_p_cand, 0.0),
        entropy=torch.where(valid, entropy, 0.0),
        valid=valid,
    )


def _replayed_logprobs(project: Projection, rec: _Screened) -> _TrainerLogprobs:
    z_ids = project(rec.ids, False)[0]  # [T, 1+K], only these logits get gradient
    z_y, z_cand = z_ids[:, 0], z_ids[:, 1:]
    finite = torch.isfinite(z_ids.detach())
    valid = rec.valid & finite[:, 0] & (finite[:, 1:] | ~rec.present).all(dim=1)
    present = rec.present & valid[:, None]
    # p_S = softmax over the support only. Invalid rows get a dummy one-entry support (logit 0) so
    # that every row stays finite; their loss weight is 0.
    dummy = (~valid)[:, None] & (torch.arange(z_cand.shape[1], device=z_cand.device) == 0)
    z_support = torch.where(present, z_cand, float("-inf"))
    z_support = torch.where(dummy, 0.0, z_support)
    if z_support.shape[1] == 0:  # K = 0: nothing is valid in support mode; keep shapes sane
        lse_support = torch.zeros_like(z_y)
    else:
        lse_support = torch.logsumexp(z_support, dim=1)  # [T]
    log_p_cand = torch.where(present, z_support - lse_support[:, None], 0.0)
    p_cand = log_p_cand.detach().exp() * present
    entropy = -(p_cand * log_p_cand.detach()).sum(dim=1)
    return _TrainerLogprobs(
        log_p_y=torch.where(valid, z_y - lse_support, 0.0),
        log_p_cand=log_p_cand,
        entropy=entropy,
        valid=valid,
    )


# ----------------------------------------------------------------------------------------------
# The loss.
# ----------------------------------------------------------------------------------------------


def _mis_weight(log_ratio: Tensor, config: ObjectiveConfig) -> Tensor:
    """f(r) = r inside [mis_low, mis_high], else 0 (detached input, any shape)."""
    ratio = log_ratio.exp()
    return torch.where((ratio >= config.mis_low) & (ratio <= config.mis_high), ratio, 0.0)


def policy_loss(
    hidden: Tensor,
    output_weight: Tensor,
    batch: TokenBatch,
    config: ObjectiveConfig,
    process_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
) -> LossOutput:
    """The corrected policy loss for the final hidden states [T, H] of the T sampled tokens' logit
    positions and the output embedding (lm_head) [V, H] (or its vocabulary shard [V / tp, H] with
    `process_group`), the logits being hidden @ output_weight.T / `temperature` (the sampling
    temperature). The logits are made tile by tile and never held whole (trainer/vocab_parallel.py).
    Differentiable in both inputs; with a process group the hidden states' gradient is this shard's
    partial sum, for the caller to reduce over the group. See the module docstring for the formula."""
    _check_projection(hidden, output_weight)
    world = dist.get_world_size(process_group) if process_group is not None else 1
    rank = dist.get_rank(process_group) if process_group is not None else 0
    local_vocab = output_weight.shape[0]

    def project(ids: Tensor, normalise: bool) -> tuple[Tensor, Tensor, Tensor]:
        return fused_log_softmax_at(
            hidden,
            output_weight,
            ids,
            rank * local_vocab,
            process_group,
            temperature,
            config.chunk_tokens,
            config.chunk_vocab,
            normalise,
        )

    return corrected_loss(
        project, hidden.shape[0], world * local_vocab, compute_dtype(hidden.dtype), batch, config
    )


def corrected_loss(
    project: Projection,
    num_tokens: int,
    vocab_size: int,
    dtype: torch.dtype,
    batch: TokenBatch,
    config: ObjectiveConfig,
) -> LossOutput:
    """The loss, given how the trainer's log-probabilities at ids are made (`project`: the fused lm_head
    of `policy_loss`; the tests' reference on materialised logits passes its own)."""
    _check_inputs(num_tokens, batch, config)
    rec = _screen_records(batch, config, vocab_size, dtype)
    lp = _replayed_logprobs(project, rec) if config.replay else _full_vocab_logprobs(project, rec)
    valid, present = lp.valid, rec.present & lp.valid[:, None]
    advantages = torch.where(valid, rec.advantages, 0.0)

    # Detached per-token quantities: ratios and the coefficients w_y, c_v.
    log_p_y = lp.log_p_y.detach()
    log_ratio_y = torch.where(valid, log_p_y - rec.log_q_y, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    weight_y = _mis_weight(log_ratio_y, config) if config.uses_mis else torch.ones_like(log_ratio_y)

    log_p_cand = lp.log_p_cand.detach()
    p_cand = log_p_cand.exp() * present  # [T, K], 0 at padding
    q_cand = rec.log_q_cand.exp() * present
    tail_ratio = None if batch.candidates_are_support else _tail_ratio(q_cand, p_cand)
    coef_cand = (
        _centering_coefficients(log_p_cand, rec, q_cand, p_cand, present, tail_ratio, config, dtype)
        if config.uses_centering
        else torch.zeros_like(p_cand)
    )

    # The differentiable part: sampled-token term minus the centering term.
    centering = (coef_cand * lp.log_p_cand).sum(dim=1)  # [T]
    per_token, clipped = _per_token_loss(lp.log_p_y, rec, advantages, weight_y, centering, valid, config)
    per_token = torch.where(valid, per_token, 0.0)
    num_valid = int(valid.sum())
    loss_sum = per_token.sum()
    loss = loss_sum / max(num_valid, 1)  # all invalid: an exact 0 still connected to the logits

    # Metrics (detached).
    per_token_metrics = _per_token_metrics(
        log_ratio_y=log_ratio_y,
        log_p_y=log_p_y,
        log_q_y=rec.log_q_y,
        entropy=lp.entropy,
        coef_cand=coef_cand if config.uses_centering else None,
        p_cand=p_cand,
        full_vocab=not config.replay,
        tail_ratio=tail_ratio,
        clipped=clipped,
        support_size=(rec.log_q_cand > float("-inf")).sum(dim=1) if batch.candidates_are_support else None,
        config=config,
    )
    invalid = (batch.loss_mask > 0) & ~valid
    metrics = _summarise(per_token_metrics, valid, invalid, torch.ones_like(valid))
    per_group = _per_group_metrics(per_token_metrics, valid, invalid, batch.group_ids)
    per_staleness = _per_staleness_metrics(per_token_metrics, valid, invalid, batch.staleness)
    return LossOutput(
        loss=loss,
        metrics=metrics,
        per_group=per_group,
        per_staleness=per_staleness,
        loss_sum=loss_sum,
        num_valid_tokens=num_valid,
    )


def _tail_ratio(q_cand: Tensor, p_cand: Tensor) -> Tensor:
    """rho: how much more tail mass q has than p outside the head."""
    q_tail = (1.0 - q_cand.sum(dim=1)).clamp(min=MASS_FLOOR)
    p_tail = (1.0 - p_cand.sum(dim=1)).clamp(min=MASS_FLOOR)
    return q_tail / p_tail


def _centering_coefficients(
    log_p_cand: Tensor,
    rec: _Screened,
    q_cand: Tensor,
    p_cand: Tensor,
    present: Tensor,
    tail_ratio: Tensor | None,
    config: ObjectiveConfig,
    dtype: torch.dtype,
) -> Tensor:
    """c_v of the centering term over the candidates (detached, [T, K]) for the sc and sc_mis modes."""
    coef_cand = q_cand
    if config.mode == "sc_mis":
        log_ratio_cand = (log_p_cand - rec.log_q_cand).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        coef_cand = q_cand * _mis_weight(log_ratio_cand, config) * present
    if tail_ratio is not None:
        # Tail modelled as q = rho p: its sum_v q f grad log p(v) equals -alpha sum_H p grad log p(v).
        if config.mode == "sc":
            alpha = tail_ratio
        else:
            alpha = ((tail_ratio >= 1.0 / config.mis_high) & (tail_ratio * config.mis_low <= 1.0)).to(dtype)
        coef_cand = coef_cand - alpha[:, None] * p_cand
    return coef_cand


def _per_token_loss(
    log_p_y: Tensor,
    rec: _Screened,
    advantages: Tensor,
    weight_y: Tensor,
    centering: Tensor,
    valid: Tensor,
    config: ObjectiveConfig,
) -> tuple[Tensor, Tensor | None]:
    """The differentiable per-token loss (before masking), and with PPO clipping which tokens clipped."""
    if not config.ppo_clip:
        return -advantages * (weight_y * log_p_y - centering), None
    log_s = (log_p_y - rec.old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # type: ignore[operator]
    s = log_s.exp()
    s_clipped = s.clamp(1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high)
    surrogate = torch.minimum(s * advantages, s_clipped * advantages)
    clipped = (s_clipped * advantages < s * advantages).detach() & valid
    return -(weight_y * surrogate - advantages * centering), clipped


def _per_group_metrics(
    per_token_metrics: dict[str, Tensor], valid: Tensor, invalid: Tensor, group_ids: Tensor | None
) -> dict[int, dict[str, float]]:
    per_group: dict[int, dict[str, float]] = {}
    if group_ids is not None:
        for group_id in torch.unique(group_ids).tolist():
            per_group[int(group_id)] = _summarise(per_token_metrics, valid, invalid, group_ids == group_id)
    return per_group


def _per_staleness_metrics(
    per_token_metrics: dict[str, Tensor], valid: Tensor, invalid: Tensor, staleness: Tensor | None
) -> dict[str, dict[str, float]]:
    """Metrics per staleness bucket that has tokens."""
    per_staleness: dict[str, dict[str, float]] = {}
    if staleness is not None:
        bucket = staleness_bucket_index(staleness)
        for index, name in enumerate(STALENESS_BUCKETS):
            selected = bucket == index
            if bool(selected.any()):
                per_staleness[name] = _summarise(per_token_metrics, valid, invalid, selected)
    return per_staleness


# ----------------------------------------------------------------------------------------------
# Metrics.
# ----------------------------------------------------------------------------------------------


def staleness_bucket_index(staleness: Tensor) -> Tensor:
    """0-1 -> 0, 2-3 -> 1, 4-5 -> 2, 6+ -> 3 (int64 [T])."""
    return (staleness.long() // 2).clamp(max=len(STALENESS_BUCKETS) - 1)


def _per_token_metrics(
    *,
    log_ratio_y: Tensor,
    log_p_y: Tensor,
    log_q_y: Tensor,
    entropy: Tensor,
    coef_cand: Tensor | None,
    p_cand: Tensor,
    full_vocab: bool,
    tail_ratio: Tensor | None,
    clipped: Tensor | None,
    support_size: Tensor | None,
    config: ObjectiveConfig,
) -> dict[str, Tensor]:
    """Per-token values [T] whose (selected) sums give every metric; see _summarise."""
    ratio = log_ratio_y.exp()
    values = {
        "kl_k3": (ratio - 1.0) - log_ratio_y,  # KL(q || p) estimator, log-ratio clamped at +-20
        "oor_low": (ratio < config.mis_low).to(ratio.dtype),
        "oor_high": (ratio > config.mis_high).to(ratio.dtype),
        "logprob_abs_diff": (log_p_y - log_q_y).abs(),
        "ratio": ratio,
        "ratio_sq": ratio * ratio,
        "entropy": entropy,
    }
    if coef_cand is not None:
        # L1 norm over the vocabulary of the centering term's gradient w.r.t. the logits (per unit
        # advantage): d/dz_u sum_v c_v log p(v) = c_u - (sum_v c_v) p_u. 0 when q = p; 2 TV(q, p_S)
        # for exact SC under replay.
        coef_sum = coef_cand.sum(dim=1, keepdim=True)
        norm = (coef_cand - coef_sum * p_cand).abs().sum(dim=1)
        if full_vocab:  # the vocabulary outside the candidates carries -(sum c) p_u
            norm = norm + coef_sum[:, 0].abs() * (1.0 - p_cand.sum(dim=1)).clamp(min=0.0)
        values["sc_correction"] = norm
    if tail_ratio is not None:
        values["sc_tail_ratio"] = tail_ratio
    if clipped is not None:
        values["ppo_clip_fraction"] = clipped.to(ratio.dtype)
    if support_size is not None:
        # a one-token sampling support: under replay p_S = 1 there, so that position gets no gradient
        # whatever its advantage (docs/objective.md, the limit of replay)
        values["single_token_support"] = (support_size == 1).to(ratio.dtype)
    return values


# Metrics that are plain token means of a per-token value (the oor_* shares are too, summed below);
# backends combine them across ranks weighted by num_tokens (trainer/backends/backend_common.py combine_metrics).
TOKEN_MEAN_METRICS = (
    "kl_k3",
    "logprob_abs_diff",
    "entropy",
    "sc_correction",
    "sc_tail_ratio",
    "ppo_clip_fraction",
    "single_token_support",
)
# Every metric that is a token mean (the oor_* shares included): what backends combine across ranks and
# what the per-view breakdown averages, both weighted by num_tokens.
MEAN_METRICS = (*TOKEN_MEAN_METRICS, "oor_low", "oor_high", "oor_fraction")


def _summarise(
    values: dict[str, Tensor], valid: Tensor, invalid: Tensor, selected: Tensor
) -> dict[str, float]:
    """Metrics over the valid tokens of `selected` (bool [T]); counts for the rest."""
    use = valid & selected
    count = int(use.sum())
    out = {"num_tokens": float(count), "invalid_tokens": float((invalid & selected).sum())}
    if count == 0:
        return out
    sums = {name: float(torch.where(use, value, 0.0).sum()) for name, value in values.items()}
    for name in TOKEN_MEAN_METRICS:
        if name in sums:
            out[name] = sums[name] / count
    out["oor_low"] = sums["oor_low"] / count
    out["oor_high"] = sums["oor_high"] / count
    out["oor_fraction"] = out["oor_low"] + out["oor_high"]
    # Normalised effective sample size of the importance ratios r_y: (sum r)^2 / (n sum r^2), in (0, 1].
    out["ess"] = sums["ratio"] ** 2 / (count * sums["ratio_sq"]) if sums["ratio_sq"] > 0 else 0.0
    if "sc_tail_ratio" in values:
        out["sc_tail_ratio_max"] = float(torch.where(use, values["sc_tail_ratio"], 0.0).max())
    return out
