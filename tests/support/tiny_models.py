"""The tiny Qwen3 sizes the tests run at, as `rlfleet.tiny_qwen3.TinyQwen3` fields (also what
`tiny_shape(**sizes)` and the `tiny_qwen3_factory` fixture take). Smaller than the project's tiny Qwen3:
no fp8 view of these can be published (its fused rows are not multiples of 128)."""

from __future__ import annotations

ONE_LAYER: dict[str, int] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
"""One small decoder layer, the body of both models below."""

LOOP_MODEL: dict[str, int] = {"vocab_size": 32, "max_position_embeddings": 48, **ONE_LAYER}
"""The trainer loop tests' model: 32 tokens, sequences up to 48."""

SERVED_MODEL: dict[str, int] = {"vocab_size": 64, "max_position_embeddings": 64, **ONE_LAYER}
"""The reference sampler's model behind the router, in the SGLang contract tests and the rollout outage."""
