"""The per-sequence attention of a packed row (trainer/backends/attention.py) against transformers' own attention:
each sequence forwarded alone with transformers' sdpa is the oracle (its causal and sliding-window masks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.gqa_sizes import TWO_LAYER_GQA
from transformers import Qwen3Config, Qwen3ForCausalLM

from rlfleet.trainer.backends.attention import (
    VARLEN_SDPA,
    sequence_bounds,
    use_varlen_attention,
    varlen_sdpa_attention,
)
from rlfleet.trainer.backends.backend_hf import HFBackend
from rlfleet.trainer.objective import ObjectiveConfig

LENGTHS = [7, 1, 12, 4]


def packed_row(lengths: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    input_ids = torch.from_numpy(rng.integers(0, vocab, size=sum(lengths)))[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    return input_ids, position_ids


def test_sequence_bounds_are_where_the_positions_restart() -> None:
    assert sequence_bounds(torch.tensor([[0, 1, 2, 0, 0, 1]])) == [0, 3, 4, 6]
    assert sequence_bounds(torch.tensor([5, 6, 7])) == [0, 3]  # a row that continues a sequence
    assert sequence_bounds(torch.tensor([0])) == [0, 1]


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_packed_row_equals_each_sequence_alone_with_transformers_sdpa(sliding_window: int | None) -> None:
    """Grouped-query heads (4 query, 2 key/value); with a sliding window of 3 on every layer the longer
    sequences are cut by the window (transformers' sliding mask for the sequence alone)."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        **TWO_LAYER_GQA,
        use_sliding_window=sliding_window is not None,
        sliding_window=sliding_window,
        max_window_layers=0,
        attn_implementation="sdpa",
    )
    model = Qwen3ForCausalLM(config).eval()
    assert set(config.layer_types) == {"full_attention" if sliding_window is None else "sliding_attention"}
    input_ids, position_ids = packed_row(LENGTHS, 64, seed=1)
    with torch.no_grad():
        alone = [model(input_ids=ids[None], use_cache=False).logits[0] for ids in input_ids[0].split(LENGTHS)]
        assert use_varlen_attention(model) and model.config._attn_implementation == VARLEN_SDPA
        packed = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=0, atol=1e-5)
    if sliding_window is not None:  # the window mattered: plain causal differs on the 12-token sequence
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        with torch.no_grad():
            unwindowed = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0]
        assert float((unwindowed - packed).abs().max()) > 1e-3


def test_the_backend_trains_with_it_and_refuses_what_it_cannot_take(tiny_qwen3_dir) -> None:
    backend = HFBackend.from_pretrained(tiny_qwen3_dir, ObjectiveConfig(), device="cpu")
    assert backend.varlen_attention and backend.model.config._attn_implementation == VARLEN_SDPA
    q = torch.zeros(1, 2, 5, 4)
    with pytest.raises(ValueError, match="without an attention mask"):
        varlen_sdpa_attention(backend.model, q, q, q, torch.ones(1, 1, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="one packed row, got a batch of 2"):
        varlen_sdpa_attention(backend.model, q.expand(2, -1, -1, -1), q, q, None)
    with pytest.raises(ValueError, match="position ids cover 3 positions, the row has 5"):
        varlen_sdpa_attention(backend.model, q, q, q, None, position_ids=torch.tensor([[0, 1, 0]]))
