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
import sys
from pathlib import Path

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


def build_tiny_qwen3(out: str | Path, *, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> Path:
    """Write the tiny Qwen3 checkpoint (model, tokenizer, SHA256SUMS) into `out`; returns it."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from rlfleet.model_source import write_checksums

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(
        vocab_size=vocab_size, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, **SIZES
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).eval()
    finally:
        torch.random.set_rng_state(generator_state)  # callers' RNG streams are not disturbed
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    build_tokenizer(out, vocab_size)
    write_checksums(out)
    return out


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet model tiny-qwen3", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    try:
        path = build_tiny_qwen3(args.out, seed=args.seed, vocab_size=args.vocab_size)
    except ValueError as e:
        print(f"rlfleet model tiny-qwen3: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
