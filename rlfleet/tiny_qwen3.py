"""The project's tiny Qwen3 checkpoint: a real Qwen3-architecture Hugging Face checkpoint small enough
for CPU tests and local runs (`rlfleet model tiny-qwen3 --out DIR`), dense (`architecture: qwen3`) or
mixture-of-experts (`qwen3_moe`: every decoder layer's MLP is `num_experts` routed SwiGLU experts of
which each token uses the top `num_experts_per_tok`, no shared expert, as Qwen3-MoE).

Built locally, no download: transformers' `Qwen3ForCausalLM` (or `Qwen3MoeForCausalLM`) with tiny sizes, initialised from a seed
and saved with `save_pretrained` (config.json + model.safetensors + generation_config.json), plus a
word-level tokenizer built with the `tokenizers` library over the toy environments' alphabet
(trainer/envs/environments.py `ToyVocab`: ids 0..9 are PAD BOS EOS SEP CALL END_CALL RESULT END_RESULT ERR
and one spare, 10..19 the digits, the rest fillers) saved as tokenizer.json + tokenizer_config.json with
a chat template, and `SHA256SUMS` (so the directory can be uploaded as an s3:// model source, see
rlfleet/model_source.py). The same seed gives the same bytes.

`warm_start` (RLJob `local.model.warmStart`): the seeded init supervised on a task's deliberately noisy
demonstrations before RL (docs/local.md, "The demo's warm start"). The spec, the knob and the recipe are
here; the training is rlfleet/trainer/warm_start.py, passed in as the `WarmStart` hook.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

VOCAB_SIZE = 64
SIZES = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 256,
}
"""Every fused member (q, k, v: 128 rows; gate, up: 256) is a multiple of SGLang's 128 FP8 block, so every
view (bf16, fp8 block-128, nvfp4) of this model is publishable and loadable (rlfleet/numerics/views.py)."""
ARCHITECTURES = ("qwen3", "qwen3_moe")
"""RLJob `local.model.architecture`: the dense Qwen3 or the Qwen3-MoE (transformers' model_type)."""
MOE_SIZES = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "decoder_sparse_step": 1,
}
"""The Qwen3-MoE's experts (Hugging Face config names): each expert's gate and up (128 rows each) and its
down projection's input (128) are multiples of the 128 FP8 block, as the dense sizes are; every layer is
sparse (decoder_sparse_step 1, no mlp_only_layers). The router (num_experts x hidden) stays unquantized
in every view, as SGLang keeps it."""
ROUTER_AUX_LOSS_COEF = 0.001
"""Qwen3-MoE's load-balancing coefficient (its released configs' router_aux_loss_coef)."""
LOGIT_STD = 2.0
"""std of the untrained model's logits (see `init_weights`)."""
SPECIAL = ["<pad>", "<s>", "</s>", "<sep>", "<call>", "</call>", "<result>", "</result>", "<err>", "<unk>"]
"""ids 0..9: ToyVocab's PAD, BOS, EOS, SEP, CALL, END_CALL, RESULT, END_RESULT, ERR, and the unknown token."""
WARM_START_TASKS = ("none", "tool_add")
"""RLJob `local.model.warmStart`: none (the seeded random init) or a built-in task to supervise it on first."""
WARM_START_NOISE = 0.5
"""The demonstrations' imperfection (the warm start's one knob, fixed): each digit a tool_add demonstration
copies (the call's two arguments, the answer) is, independently with this probability, a uniformly random
digit instead. A model that fits them samples each copied digit right with probability 1 - 0.9 x noise
(0.55), so its sampled task success is low but not zero (docs/local.md, "The demo's warm start": at 0.6
RL on the demo's seed 0 learned to call with a few fixed digits instead of copying)."""


@dataclass(frozen=True)
class WarmStartRecipe:
    """How the warm start trains (fixed; part of the cache key of a warm-started model)."""

    steps: int = 100
    """AdamW steps, each on `batch` fresh demonstrations (about 5 s of one CPU core)."""
    batch: int = 64
    learning_rate: float = 1e-3
    stream: int = 1
    """The noise's random stream beside the seed: np.random.default_rng([seed, stream])."""


WARM_START_RECIPE = WarmStartRecipe()
CHAT_TEMPLATE = (
    "{% for message in messages %}<s> {{ message['role'] }} {{ message['content'] }} <sep> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def vocabulary(vocab_size: int = VOCAB_SIZE) -> dict[str, int]:
    """token -> id: the specials, the digits 0..9 at ids 10..19, fillers `w<i>` after them."""
    if vocab_size < 32:
        raise ValueError(f"vocab_size must be >= 32 (the toy environments' alphabet), got {vocab_size}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({str(d): 10 + d for d in range(10)})
    vocab.update({f"w{i}": i for i in range(20, vocab_size)})
    return vocab


def build_tokenizer(directory: Path, vocab_size: int = VOCAB_SIZE) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocabulary(vocab_size), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        sep_token="<sep>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


@dataclass(frozen=True)
class TinyQwen3:
    """The sizes and init of a tiny Qwen3 (RLJob `local.model`; Hugging Face config names)."""

    vocab_size: int = VOCAB_SIZE
    hidden_size: int = SIZES["hidden_size"]
    intermediate_size: int = SIZES["intermediate_size"]
    num_hidden_layers: int = SIZES["num_hidden_layers"]
    num_attention_heads: int = SIZES["num_attention_heads"]
    num_key_value_heads: int = SIZES["num_key_value_heads"]
    head_dim: int = SIZES["head_dim"]
    max_position_embeddings: int = SIZES["max_position_embeddings"]
    tie_word_embeddings: bool = False
    logit_std: float = LOGIT_STD
    seed: int = 0
    warm_start: str = "none"
    warm_start_noise: float = WARM_START_NOISE
    architecture: str = "qwen3"
    num_experts: int = MOE_SIZES["num_experts"]
    """The MoE fields below are qwen3_moe's (ignored by the dense qwen3)."""
    num_experts_per_tok: int = MOE_SIZES["num_experts_per_tok"]
    moe_intermediate_size: int = MOE_SIZES["moe_intermediate_size"]
    decoder_sparse_step: int = MOE_SIZES["decoder_sparse_step"]
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to 1 (Qwen3-MoE does)."""
    router_aux_loss_coef: float = ROUTER_AUX_LOSS_COEF
    output_router_logits: bool = True
    """The model returns its router logits and the load-balancing loss, which the trainer adds to the
    policy loss times router_aux_loss_coef (docs/objective.md, "Mixture of experts")."""

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture must be one of {', '.join(ARCHITECTURES)}, got {self.architecture!r}"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}"
            )
        if self.warm_start not in WARM_START_TASKS:
            raise ValueError(
                f"warm start must be one of {', '.join(WARM_START_TASKS)}, got {self.warm_start!r}"
            )
        if not 0.0 <= self.warm_start_noise <= 1.0:
            raise ValueError(f"warm start noise must be in [0, 1], got {self.warm_start_noise}")
        if self.warm_start != "none" and self.max_position_embeddings < TOOL_ADD_DEMONSTRATION_TOKENS:
            raise ValueError(
                f"a tool_add demonstration is {TOOL_ADD_DEMONSTRATION_TOKENS} tokens: max_position_embeddings "
                f"must be >= {TOOL_ADD_DEMONSTRATION_TOKENS}, got {self.max_position_embeddings}"
            )

    def hf_config(self) -> Any:
        from transformers import Qwen3Config, Qwen3MoeConfig

        fields = asdict(self)
        sizes = {k: v for k, v in fields.items() if k not in _NOT_CONFIG and k not in _MOE_CONFIG}
        if self.architecture == "qwen3":
            return Qwen3Config(bos_token_id=1, eos_token_id=2, pad_token_id=0, **sizes)
        moe = {k: fields[k] for k in _MOE_CONFIG}
        return Qwen3MoeConfig(
            bos_token_id=1, eos_token_id=2, pad_token_id=0, mlp_only_layers=[], **sizes, **moe
        )


_NOT_CONFIG = ("logit_std", "seed", "warm_start", "warm_start_noise", "architecture")
_MOE_CONFIG = (
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "norm_topk_prob",
    "router_aux_loss_coef", "output_router_logits",
)  # fmt: skip


def init_weights(model: Any, seed: int, logit_std: float = LOGIT_STD) -> None:
    """Deterministic init from `seed` (independent of the global RNG): embedding normal(0, 1),
    projections normal(0, 1/sqrt(fan_in)) with the residual outputs (o_proj, down_proj, each expert's
    down projection) scaled by 1/sqrt(2 layers), the MoE router (mlp.gate) and each expert's fused gate
    and up (mlp.experts.gate_up_proj [experts, 2 x moe_intermediate, hidden]) like any projection, lm_head giving logits of std ~`logit_std`, norms (incl. QK-norm) at 1.

    Why not transformers' init (std 0.02): its untrained model is a near-uniform distribution over the
    vocabulary with near-identity layers; here every layer matters and the initial distributions are
    peaked enough that top-k / top-p supports are small and quantization changes them (docs/local.md)."""
    import torch

    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = 1.0 / math.sqrt(p.shape[-1])
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                std = std / math.sqrt(2 * cfg.num_hidden_layers)
            elif name == "lm_head.weight":
                std = logit_std / math.sqrt(cfg.hidden_size)
            elif name == "model.embed_tokens.weight":
                std = logit_std / math.sqrt(cfg.hidden_size) if cfg.tie_word_embeddings else 1.0
            p.copy_(torch.randn(p.shape, generator=gen) * std)


TOOL_ADD_DEMONSTRATION_TOKENS = 13
"""BOS a b SEP | CALL x y END_CALL | RESULT s END_RESULT | answer EOS (rlfleet/api WARM_START_CONTEXT)."""
WarmStart = Callable[[Any, "TinyQwen3"], None]
"""Trains a freshly initialised model in place for its spec's warm start: rlfleet/trainer/warm_start.py
`train_warm_start` (the trainer side: the environment's demonstrations, the trainer's backend; this
module is imported by the sampler side too, which may not import the trainer)."""


def tiny_model(spec: TinyQwen3 | None = None, warm_start: WarmStart | None = None) -> Any:
    """transformers' Qwen3ForCausalLM (Qwen3MoeForCausalLM for `architecture: qwen3_moe`) of `spec`,
    initialised by `init_weights` and, when `spec.warm_start` names a task, trained by `warm_start` (fp32,
    eval mode)."""
    from transformers import GenerationConfig, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    spec = spec or TinyQwen3()
    if spec.warm_start != "none" and warm_start is None:
        raise ValueError(
            f"a {spec.warm_start} warm start is trained on the trainer side: build the model with "
            "rlfleet.trainer.warm_start (warm_start=train_warm_start)"
        )
    model_class = Qwen3MoeForCausalLM if spec.architecture == "qwen3_moe" else Qwen3ForCausalLM
    model = model_class(spec.hf_config()).eval()
    init_weights(model, spec.seed, spec.logit_std)
    if warm_start is not None and spec.warm_start != "none":
        warm_start(model, spec)
        model.eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return model


def build_tiny_qwen3(
    out: str | Path,
    spec: TinyQwen3 | None = None,
    *,
    seed: int | None = None,
    warm_start: WarmStart | None = None,
) -> Path:
    """Write the tiny Qwen3 (or Qwen3-MoE) checkpoint (bf16 safetensors, config, tokenizer, SHA256SUMS) into `out`."""
    import torch

    from rlfleet.model_source import write_checksums

    spec = spec or TinyQwen3()
    if seed is not None:
        spec = replace(spec, seed=seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tiny_model(spec, warm_start).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    build_tokenizer(out, spec.vocab_size)
    write_checksums(out)
    return out


@dataclass(frozen=True)
class _WarmCacheKey:
    spec: TinyQwen3
    recipe: WarmStartRecipe


def cached_tiny_qwen3(cache_root: str | Path, spec: TinyQwen3, warm_start: WarmStart | None = None) -> Path:
    """`build_tiny_qwen3` once per spec under `cache_root`, in a directory named by the spec's digest
    (`model_source.build_once`: built aside and renamed into place): `tiny-qwen3-<digest>`, or with a
    warm start `tiny-qwen3-<task>-<digest of the spec and WARM_START_RECIPE>`."""
    from rlfleet.model_source import build_once, spec_digest

    name = (
        f"tiny-qwen3-{spec_digest(spec)}"
        if spec.warm_start == "none"
        else f"tiny-qwen3-{spec.warm_start}-{spec_digest(_WarmCacheKey(spec, WARM_START_RECIPE))}"
    )
    return build_once(Path(cache_root) / name, lambda tmp: build_tiny_qwen3(tmp, spec, warm_start=warm_start))
