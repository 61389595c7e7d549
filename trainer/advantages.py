"""GRPO advantages: reward minus the group mean (std normalisation optional), detached constants.

A group is all samples of one prompt. method.md: group normalisation does not remove the drift of
uncorrected PG under mismatch; the objective's SC term does. These are plain numpy functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def grpo_advantages(rewards: np.ndarray, normalize_std: bool = False, eps: float = 1e-6) -> np.ndarray:
    """rewards float [G] of one group -> advantages float32 [G].

    A_i = r_i - mean(r); with `normalize_std`, divided by (std(r) + eps) (population std). A group
    with identical rewards gets all-zero advantages (no signal, no update).
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D array, got shape {r.shape}")
    adv = r - r.mean()
    if normalize_std:
        adv = adv / (r.std() + eps)
    return adv.astype(np.float32)


def uniform_group_fraction(group_rewards: Sequence[Sequence[float]]) -> float:
    """Share of prompt groups whose rewards are all equal, so every advantage in them is 0 and they
    train nothing (rewards float per group, >= 1 group). Near 1 with a low reward, learning has
    stopped: a policy that became deterministic on its decision tokens scores alike in every sample,
    the absorbing state uncorrected pg reaches under staleness (docs/ablation.md, "Third search")."""
    if not group_rewards:
        raise ValueError("need at least one group")
    return float(np.mean([np.ptp(np.asarray(r, dtype=np.float64)) == 0.0 for r in group_rewards]))


def token_advantages(advantages: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per-trajectory advantages float [B] and token counts int [B] -> per-token float32 [sum(lengths)]."""
    return np.repeat(np.asarray(advantages, dtype=np.float32), np.asarray(lengths, dtype=np.int64))
