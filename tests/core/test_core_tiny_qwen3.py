"""The tiny Qwen3 checkpoint (rlfleet/tiny_qwen3.py): a real transformers checkpoint, deterministic,
built once per spec by `cached_tiny_qwen3`, with the init its docstring states."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rlfleet.model_source import parse_checksums
from rlfleet.tiny_qwen3 import TinyQwen3, build_tiny_qwen3, cached_tiny_qwen3, tiny_model


def test_same_spec_same_bytes_and_a_loadable_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = build_tiny_qwen3(tmp_path / "a", TinyQwen3(seed=3))
    b = build_tiny_qwen3(tmp_path / "b", TinyQwen3(seed=3))
    c = build_tiny_qwen3(tmp_path / "c", TinyQwen3(seed=4))
    sums = {d: parse_checksums((d / "SHA256SUMS").read_text(), str(d)) for d in (a, b, c)}
    assert sums[a] == sums[b]
    assert sums[a]["model.safetensors"] != sums[c]["model.safetensors"]
    config = json.loads((a / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(a))
    assert tok.convert_tokens_to_ids(["<s>", "</s>", "0", "9"]) == [1, 2, 10, 19]
    assert model.config.vocab_size == 64 and model.config.head_dim == 64


def test_init_is_the_stated_one() -> None:
    """Norms at 1, projections ~ N(0, 1/fan_in) (residual outputs / sqrt(2 layers)), lm_head giving logits
    of std ~logit_std: checked on the sample std of each tensor (thousands of draws, 10% tolerance)."""
    spec = TinyQwen3(logit_std=3.0, seed=1)
    state = tiny_model(spec).state_dict()
    assert torch.equal(state["model.layers.0.self_attn.q_norm.weight"], torch.ones(64))
    assert torch.equal(state["model.norm.weight"], torch.ones(128))
    expected = {
        "model.layers.0.self_attn.q_proj.weight": 1 / math.sqrt(128),
        "model.layers.1.self_attn.o_proj.weight": 1 / math.sqrt(128) / 2,
        "model.layers.0.mlp.down_proj.weight": 1 / math.sqrt(256) / 2,
        "lm_head.weight": 3.0 / math.sqrt(128),
        "model.embed_tokens.weight": 1.0,
    }
    for name, std in expected.items():
        assert float(state[name].std()) == pytest.approx(std, rel=0.1), name


def test_cached_build_happens_once_per_spec(tmp_path: Path) -> None:
    first = cached_tiny_qwen3(tmp_path, TinyQwen3(seed=0))
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = cached_tiny_qwen3(tmp_path, TinyQwen3(seed=0))
    other = cached_tiny_qwen3(tmp_path, TinyQwen3(seed=1))
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == stamp
    assert other != first
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])  # no temp dirs left
