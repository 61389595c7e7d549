"""GRPO advantages: reward minus the group mean (std normalisation optional), detached constants.

A group is all samples of one prompt. method.md: group normalisation does not remove the drift of
uncorrected PG under mismatch; the objective's SC term does. These are plain numpy functions.
"""

from __future__ import annotations

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


def token_advantages(advantages: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per-trajectory advantages float [B] and token counts int [B] -> per-token float32 [sum(lengths)]."""
    return np.repeat(np.asarray(advantages, dtype=np.float32), np.asarray(lengths, dtype=np.int64))
