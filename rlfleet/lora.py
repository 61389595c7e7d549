"""LoRA in the weight channel, the engines and the router: the names every side agrees on (core: no torch).

With `trainer.lora` (docs/api.md) the base weights never change: each sampler group serves its own
quantized base view (bf16, fp8, nvfp4: published once) and every version is a bf16 adapter in PEFT's
layout, the `lora` view (`adapter_config.json` + `adapter_model.safetensors`), loaded by the engine at run
time under the name `adapter_name(version)` (SGLang 0.5.23 `/load_lora_adapter`). A request names its
adapter (`/generate` `lora_path`), so a version is loaded while requests on the one before finish, and
every token's version is its request's adapter's (docs/weights.md, "LoRA").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

LORA_VIEW = "lora"
"""The channel view that holds a version's adapter (PEFT layout); base views are the weight formats'."""
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"

# The projections a LoRA adapter may target (transformers' Qwen3 / Qwen3-MoE module names, as PEFT's
# target_modules and SGLang's --lora-target-modules name them).
ATTENTION_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES: tuple[str, ...] = ATTENTION_MODULES + MLP_MODULES
DEFAULT_TARGET_MODULES: tuple[str, ...] = ATTENTION_MODULES

ADAPTER_REQUEST_HEADER = "X-RLFleet-Adapter"
"""Request header to the router: `newest` has the router name, in the body's `lora_path`, the newest adapter
the replica it chose serves (a lagging group's requests run on its own newest version, never wait)."""
ADAPTER_NEWEST = "newest"
ADAPTER_VERSION_HEADER = "X-RLFleet-Adapter-Version"
"""Response header of the router: the version of the adapter the request ran on (every token's version)."""

_ADAPTER_NAME = re.compile(r"^v(0|[1-9][0-9]{0,17})$")


def adapter_name(version: int) -> str:
    """The engine's name of version `version`'s adapter: `v<N>`."""
    if version < 0:
        raise ValueError(f"a weight version is >= 0, got {version}")
    return f"v{version}"


def adapter_version(name: str) -> int | None:
    """The version an adapter name stands for (None: not an rlfleet adapter name)."""
    match = _ADAPTER_NAME.match(name)
    return int(match.group(1)) if match else None


def adapter_config(
    *,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: Sequence[str],
    base_model: str = "",
) -> dict[str, Any]:
    """PEFT's adapter_config.json of an rlfleet adapter (what `LoraConfig.save_pretrained` writes for these
    settings, and what SGLang's LoRAConfig and PEFT's `LoraConfig.from_pretrained` read)."""
    unknown = sorted(set(target_modules) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(f"unknown LoRA target module(s) {unknown}; known: {list(TARGET_MODULES)}")
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(rank),
        "lora_alpha": float(alpha),
        "lora_dropout": float(dropout),
        "target_modules": sorted(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
