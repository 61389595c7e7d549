"""Facts read from a Hugging Face model config (config.json as a mapping). Torch-free and importing
nothing of rlfleet, so that every side may decide with them: the operator's catalog (through
`rlfleet.catalog.checkpoint_engine_flags`), the sampler's weight sync, the views and the trainer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def is_moe_config(config: Mapping[str, Any]) -> bool:
    """Whether an HF config describes a mixture-of-experts model (Qwen3-MoE: `num_experts` or, as
    transformers 5 writes it, `num_local_experts`)."""
    experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")
    return bool(experts and int(experts) > 1)
