"""LoRA settings of an RLJob's trainer (`trainer.lora`) and of the SamplerGroups that serve its adapters."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, model_validator

from rlfleet.api.common import ApiModel, cel_rules
from rlfleet.lora import DEFAULT_TARGET_MODULES, TARGET_MODULES

LoraTargetModule = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
assert get_args(LoraTargetModule) == TARGET_MODULES  # rlfleet/lora.py is the one list
LORA_TARGETS_RULE = "self.targetModules.all(m, self.targetModules.exists_one(n, n == m))"
LORA_TARGETS_MESSAGE = "trainer.lora.targetModules: each module at most once"
LORA_BACKEND_RULE = "!has(self.lora) || self.backend == 'torch'"
LORA_BACKEND_MESSAGE = (
    "trainer.lora needs backend torch: the megatron backend trains full weights only (megatron-core's LoRA "
    "is Megatron-Bridge's PEFT, which this project does not use: docs/architecture.md)"
)
MAX_LORA_RANK = 256


class LoraSpec(ApiModel):
    """LoRA: train low-rank adapters of the frozen base instead of every weight (PEFT on the torch backend). Every sampler group quantizes the base ONCE into its own format and each later version is only the bf16 adapter, loaded by the engines at run time while requests on the previous one finish (docs/weights.md, "LoRA")."""

    model_config = cel_rules(
        {"rule": LORA_TARGETS_RULE, "message": LORA_TARGETS_MESSAGE, "fieldPath": ".targetModules"}
    )

    rank: int = Field(default=16, ge=1, le=MAX_LORA_RANK)
    """Adapter rank r (SGLang's --max-lora-rank of every group)."""
    alpha: float = Field(default=32.0, gt=0.0, le=4096.0)
    """LoRA alpha: the adapter's update is scaled by alpha / rank."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training (the engines never drop)."""
    target_modules: list[LoraTargetModule] = Field(
        default_factory=lambda: list(DEFAULT_TARGET_MODULES),  # type: ignore[arg-type]  # the same names
        min_length=1,
        max_length=len(TARGET_MODULES),
    )
    """Projections that get an adapter: attention (q_proj, k_proj, v_proj, o_proj) and, on a dense model, the MLP (gate_proj, up_proj, down_proj). On a mixture of experts the MLP names are its experts, which the trainer refuses at start (SGLang 0.5.23 loads expert adapters only in its own fused layout)."""

    @model_validator(mode="after")
    def _check_targets(self) -> LoraSpec:
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(LORA_TARGETS_MESSAGE)
        return self
