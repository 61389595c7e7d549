"""Routing mismatch of a mixture of experts: how often the experts a sampler's router chose for a token
differ from the ones the trainer's router chooses for it at the same weights (docs/objective.md,
"Routing mismatch").

Small numeric differences (the published bf16 / fp8 / nvfp4 view, the engine's kernels) can move a
token's router logits across the top-k boundary: a discontinuous train/sample mismatch that dense
models do not have. Per compared token the top-k expert SETS of every layer are compared (the order
SGLang or the trainer lists the ids in does not matter):

- `routing_mismatch_tokens`: share of compared tokens where the set of at least one layer differs;
- `routing_mismatch_layers`: share of compared (token, layer) pairs whose sets differ;
- `routing_tokens`: how many tokens were compared (the weight of both means when parts are combined,
  trainer/backends/backend_common.py `combine_metrics`).

Compared tokens: trained tokens whose sampler returned routing and that were sampled with the weight
version the trainer holds at the step (older tokens differ by the update too, not by numerics).
"""

from __future__ import annotations

import numpy as np

ROUTING_COUNT = "routing_tokens"
ROUTING_MEANS = ("routing_mismatch_tokens", "routing_mismatch_layers")


def routing_mismatch(
    trainer_experts: np.ndarray, sampler_experts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Two [tokens, layers, top_k] arrays of expert ids -> (bool [tokens]: some layer's set differs,
    float64 [tokens]: the share of the token's layers whose sets differ)."""
    if trainer_experts.shape != sampler_experts.shape or trainer_experts.ndim != 3:
        raise ValueError(
            f"routed experts must both be [tokens, layers, top_k], got {trainer_experts.shape} and {sampler_experts.shape}"
        )
    # top-k ids are distinct within a set, so equal sorted rows <=> equal sets
    differs = (np.sort(trainer_experts, axis=-1) != np.sort(sampler_experts, axis=-1)).any(
        axis=-1
    )  # [tokens, layers]
    if differs.shape[1] == 0:
        raise ValueError("routed experts with no layer")
    return differs.any(axis=1), differs.mean(axis=1, dtype=np.float64)


def routing_metrics(
    token_differs: np.ndarray, layer_share: np.ndarray, selected: np.ndarray
) -> dict[str, float]:
    """The routing metrics over the `selected` (bool) tokens; {} when none is selected (no metric, not 0)."""
    count = int(selected.sum())
    if count == 0:
        return {}
    return {
        ROUTING_COUNT: float(count),
        "routing_mismatch_tokens": float(token_differs[selected].sum()) / count,
        "routing_mismatch_layers": float(layer_share[selected].sum()) / count,
    }


def combine_routing_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Routing metrics of disjoint token sets -> the union's (counts add, means weighted by the count;
    exact); {} when no part compared a token."""
    count = sum(p.get(ROUTING_COUNT, 0.0) for p in parts)
    if not count:
        return {}
    out = {ROUTING_COUNT: count}
    for k in ROUTING_MEANS:
        out[k] = sum(p.get(k, 0.0) * p.get(ROUTING_COUNT, 0.0) for p in parts) / count
    return out


__all__ = ["ROUTING_COUNT", "ROUTING_MEANS", "combine_routing_metrics", "routing_metrics", "routing_mismatch"]
