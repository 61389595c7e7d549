"""The project's tiny Qwen3 checkpoint: a real Qwen3-architecture Hugging Face checkpoint small enough
for CPU tests and local runs (`rlfleet model tiny-qwen3 --out DIR`).

Built locally, no download: transformers' `Qwen3ForCausalLM` with tiny sizes, initialised from a seed
and saved with `save_pretrained` (config.json + model.safetensors + generation_config.json), plus a
word-level tokenizer built with the `tokenizers` library over the toy environments' alphabet
(trainer/environments.py `ToyVocab`: ids 0..9 are PAD BOS EOS SEP CALL END_CALL RESULT END_RESULT ERR
and one spare, 10..19 the digits, the rest fillers) saved as tokenizer.json + tokenizer_config.json with
a chat template, and `SHA256SUMS` (so the directory can be uploaded as an s3:// model source, see
rlfleet/model_source.py). The same seed gives the same bytes.
"""

from __future__ import annotations

import argparse
import math
import sys
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
LOGIT_STD = 2.0
"""std of the untrained model's logits (see `init_weights`)."""
SPECIAL = ["<pad>", "<s>", "</s>", "<sep>", "<call>", "</call>", "<result>", "</result>", "<err>", "<unk>"]
"""ids 0..9: ToyVocab's PAD, BOS, EOS, SEP, CALL, END_CALL, RESULT, END_RESULT, ERR, and the unknown token."""
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
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
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

    def hf_config(self) -> Any:
        from transformers import Qwen3Config

        sizes = {k: v for k, v in asdict(self).items() if k not in ("logit_std", "seed")}
        return Qwen3Config(bos_token_id=1, eos_token_id=2, pad_token_id=0, **sizes)


def init_weights(model: Any, seed: int, logit_std: float = LOGIT_STD) -> None:
    """Deterministic init from `seed` (independent of the global RNG): embedding normal(0, 1),
    projections normal(0, 1/sqrt(fan_in)) with the residual outputs (o_proj, down_proj) scaled by
    1/sqrt(2 layers), lm_head giving logits of std ~`logit_std`, norms (incl. QK-norm) at 1.

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
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std = std / math.sqrt(2 * cfg.num_hidden_layers)
            elif name == "lm_head.weight":
                std = logit_std / math.sqrt(cfg.hidden_size)
            elif name == "model.embed_tokens.weight":
                std = logit_std / math.sqrt(cfg.hidden_size) if cfg.tie_word_embeddings else 1.0
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def tiny_model(spec: TinyQwen3 | None = None) -> Any:
    """transformers' Qwen3ForCausalLM of `spec`, initialised by `init_weights` (fp32, eval mode)."""
    from transformers import GenerationConfig, Qwen3ForCausalLM

    spec = spec or TinyQwen3()
    model = Qwen3ForCausalLM(spec.hf_config()).eval()
    init_weights(model, spec.seed, spec.logit_std)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return model


def build_tiny_qwen3(out: str | Path, spec: TinyQwen3 | None = None, *, seed: int | None = None) -> Path:
    """Write the tiny Qwen3 checkpoint (bf16 safetensors, config, tokenizer, SHA256SUMS) into `out`."""
    import torch

    from rlfleet.model_source import write_checksums

    spec = spec or TinyQwen3()
    if seed is not None:
        spec = replace(spec, seed=seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tiny_model(spec).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    build_tokenizer(out, spec.vocab_size)
    write_checksums(out)
    return out


def cached_tiny_qwen3(cache_root: str | Path, spec: TinyQwen3) -> Path:
    """`build_tiny_qwen3` once per spec under `cache_root`, in a directory named by the spec's digest
    (`model_source.build_once`: built aside and renamed into place)."""
    from rlfleet.model_source import build_once, spec_digest

    return build_once(Path(cache_root) / f"tiny-qwen3-{spec_digest(spec)}", lambda tmp: build_tiny_qwen3(tmp, spec))


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet model tiny-qwen3", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    try:
        path = build_tiny_qwen3(args.out, TinyQwen3(vocab_size=args.vocab_size, seed=args.seed))
    except ValueError as e:
        print(f"rlfleet model tiny-qwen3: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
