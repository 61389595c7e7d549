"""The sizes of the tiny grouped-query model (2 layers, 4 query heads sharing 2 key/value heads, width 32)
the trainer's backend and attention tests build, as Hugging Face config fields (what `Qwen3Config`,
`LlamaConfig` and `rlfleet.tiny_qwen3.TinyQwen3` take)."""

from __future__ import annotations

TWO_LAYER_GQA: dict[str, int] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}
"""head_dim is hidden_size / num_attention_heads, the default of models that do not set it (Llama)."""
