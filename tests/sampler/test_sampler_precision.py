"""Precision emulation is ordered sensibly: measured KL(q || p) of each emulated sampler configuration
(the reference engine's EngineModel, KV-cached decode as in serving) against the trainer (transformers'
Qwen3ForCausalLM of the same tiny Qwen3, fp32, full forward as in training)."""

from __future__ import annotations

import pytest
import torch

from rlfleet.numerics.engine_model import EngineModel, KernelConfig, ModelShape, precision_view
from rlfleet.sampler.reference_engine import measure_kl
from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


SPEC = TinyQwen3(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=32,
    seed=3,
)
BF16_KERNEL = KernelConfig("bfloat16")


def _kl(trainer: torch.nn.Module, fmt: str, kv: str, kernel: KernelConfig) -> float:
    sampler = EngineModel(ModelShape.from_hf_config(trainer.config.to_dict()), kernel).eval()
    sampler.load_weights(precision_view(trainer.state_dict(), fmt))
    ids = torch.randint(0, SPEC.vocab_size, (3, 16), generator=torch.Generator().manual_seed(1))
    return measure_kl(trainer, sampler, kv, ids, prompt_len=6)


def test_kl_ordering_kernel_lt_fp8_lt_fp4():
    trainer = tiny_model(SPEC)
    kl = {
        "exact": _kl(trainer, "fp32", "auto", KernelConfig()),
        "kernel": _kl(trainer, "bf16", "auto", BF16_KERNEL),
        "kernel_splitk": _kl(trainer, "bf16", "auto", KernelConfig("bfloat16", split_k=4)),
        "kv_fp8": _kl(trainer, "bf16", "fp8_e4m3", BF16_KERNEL),
        "fp8": _kl(trainer, "fp8", "auto", BF16_KERNEL),
        "fp8_block": _kl(trainer, "fp8_block", "auto", BF16_KERNEL),
        "nvfp4": _kl(trainer, "nvfp4", "auto", BF16_KERNEL),
        "mxfp4": _kl(trainer, "mxfp4", "auto", BF16_KERNEL),
    }
    assert abs(kl["exact"]) < 1e-7  # the cached decode path itself adds nothing
    assert 0 < kl["kernel"] < kl["kv_fp8"] < kl["fp8"] < kl["nvfp4"]
    assert kl["kernel"] < kl["fp8_block"] < kl["mxfp4"]
    assert kl["kernel"] < kl["kernel_splitk"] < kl["fp8"]  # reduction order alone is a (small) mismatch
    assert kl["fp8"] * 3 < min(kl["nvfp4"], kl["mxfp4"])  # 4-bit is a different league from 8-bit
