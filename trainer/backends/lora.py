"""LoRA on the torch backend (RLJob `trainer.lora`, docs/weights.md "LoRA"): the transformers model gets
PEFT's LoRA layers and its own weights are frozen, so the optimizer holds (and checkpoints keep) only the
adapter; every published version is the adapter alone, named as PEFT's `get_peft_model_state_dict` names
it, which is what `adapter_model.safetensors` holds and what `PeftModel.from_pretrained` and SGLang load.

PEFT is the one authority on the adapter's layout: it injects the layers (`get_peft_model`) and names the
tensors (`get_peft_model_state_dict`); this module only checks the targets first and gathers full tensors
for it (under FSDP2 each rank holds a shard).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict

from rlfleet.api.lora_spec import LoraSpec
from rlfleet.hf_config import is_moe_config
from rlfleet.lora import MLP_MODULES

MOE_MLP_MESSAGE = (
    "on a mixture of experts gate_proj/up_proj/down_proj are its experts; SGLang 0.5.23 loads expert "
    "adapters only in its own fused layout: use attention targets"
)
INIT_SEED = 0
"""The seed of the adapter's initial lora_A (lora_B starts at zero, so the initial model is the base
whatever the seed): one fixed seed makes every FSDP2 rank initialise the same adapter (fully_shard keeps
each rank's own slice of its own copy) and a run reproducible."""


def lora_config(spec: LoraSpec) -> LoraConfig:
    """PEFT's LoraConfig of `spec`: the settings rlfleet/lora.py `adapter_config` writes for the engines."""
    return LoraConfig(
        r=spec.rank,
        # PEFT annotates int, but scales by lora_alpha / r in float: a fractional alpha (the API allows it) stays exact
        lora_alpha=spec.alpha,  # type: ignore[arg-type]
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        bias="none",
    )


def check_targets(model: torch.nn.Module, targets: Iterable[str]) -> None:
    """Refuse (ValueError, one line) targets the engines cannot serve or the model does not have: the MLP
    projections of a mixture of experts (transformers fuses its experts into 3-D parameters, and SGLang
    0.5.23 loads expert adapters only in its own fused layout), and a module name no Linear layer of the
    model ends with (PEFT would otherwise fail deep inside or silently skip it)."""
    wanted = list(targets)
    config = getattr(model, "config", None)
    if config is not None and is_moe_config(config.to_dict()):
        mlp = [t for t in wanted if t in MLP_MODULES]
        if mlp:
            raise ValueError(f"LoRA target(s) {mlp}: {MOE_MLP_MESSAGE}")
    linear = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    missing = [t for t in wanted if t not in linear]
    if missing:
        raise ValueError(
            f"LoRA target(s) {missing} are not modules of {type(model).__name__}; "
            f"its linear modules: {sorted(linear)}"
        )


def wrap(model: torch.nn.Module, spec: LoraSpec) -> PeftModel:
    """Inject `spec`'s LoRA layers into `model` IN PLACE and freeze its own weights (PEFT's get_peft_model);
    the returned PeftModel wraps the same modules and is what names the adapter's tensors. `model` itself
    stays the module to forward and shard: PeftModelForCausalLM's forward adds nothing for LoRA."""
    check_targets(model, spec.target_modules)
    with torch.random.fork_rng(devices=[]):  # the caller's CPU random stream is left as it was
        torch.manual_seed(INIT_SEED)
        peft = get_peft_model(model, lora_config(spec))
    frozen_trainable = [n for n, p in peft.named_parameters() if p.requires_grad and "lora_" not in n]
    assert not frozen_trainable, frozen_trainable  # bias="none": PEFT trains the adapter alone
    return peft


def adapter_tensors(
    peft: PeftModel, full: Callable[[torch.Tensor], torch.Tensor], keep: bool = True
) -> dict[str, torch.Tensor]:
    """The adapter's tensors, fp32 on CPU, named by PEFT's `get_peft_model_state_dict` (e.g.
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r]).
    `full(parameter)` is the parameter's full tensor (under FSDP2 a collective: every rank calls this, in
    the same order); `keep` False (FSDP2 ranks other than 0) gathers and returns {}."""
    gathered: dict[str, torch.Tensor] = {}
    for name, param in peft.named_parameters():
        if not param.requires_grad:  # the frozen base
            continue
        tensor = full(param)
        if keep:
            gathered[name] = tensor.detach().to("cpu", torch.float32).clone()
    if not keep:
        return {}
    return get_peft_model_state_dict(peft, state_dict=gathered, save_embedding_layers=False)
