"""The in-process emulated samplers (rlfleet/local/emulated.py) are the reference server's engine: for
every weight format a dense Qwen3 is published in and every SGLang KV-cache dtype, an emulated group fed
the trainer's weights computes the same logits as a reference engine configured as local mode configures
a group's server (`rlfleet/local/fleet.py`) serving the view the trainer publishes for that format
(written by the publisher's `save_view`, read back by `load_checkpoint` as the server's weight update
does)."""

from __future__ import annotations

import pytest
import torch

from rlfleet.api.common import KV_CACHE_DTYPES
from rlfleet.local.emulated import EmulatedSampler, Request
from rlfleet.numerics.engine_model import KernelConfig, load_checkpoint
from rlfleet.numerics.views import calibrate_weights, save_view
from rlfleet.sampler.protocol import SamplingConfig
from rlfleet.sampler.reference_engine import ENGINE_KV, EngineConfig, ReferenceEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FORMATS = ("bf16", "fp8", "nvfp4")  # mxfp4 views are refused for dense models (docs/weights.md)
KERNEL = KernelConfig(act_dtype="bfloat16", split_k=2)


@pytest.fixture(scope="module")
def published(tiny_qwen3_factory, tmp_path_factory):
    """The trainer's fp32 weights after some updates (the checkpoint plus noise) and the directory of
    each format's published view."""
    base = tiny_qwen3_factory()
    _, shape, weights = load_checkpoint(base)
    gen = torch.Generator().manual_seed(1)
    trained = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    root = tmp_path_factory.mktemp("views")
    amax = calibrate_weights(trained, base)
    for fmt in FORMATS:
        save_view(
            trained, fmt, root / fmt, base_checkpoint=base, activation_amax=amax if fmt == "nvfp4" else None
        )
    return shape, trained, root


def _logits(engine: ReferenceEngine, ids: list[int], prompt_len: int) -> torch.Tensor:
    """Prefill `prompt_len` tokens, then decode the rest one at a time, through the engine's own
    model and a cache of its KV dtype (the path a sampled token's logits take)."""
    model = engine.model
    cache = model.new_cache(1, capacity=len(ids), kv_dtype=engine.config.kv_cache_dtype)
    rows = torch.tensor([0])
    parts = [model(torch.tensor([ids[:prompt_len]]), cache, rows)]
    parts += [model(torch.tensor([[t]]), cache, rows) for t in ids[prompt_len:]]
    return torch.cat(parts, 1)


@pytest.mark.parametrize("kv", KV_CACHE_DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_emulated_group_computes_the_reference_servers_logits(published, fmt, kv):
    shape, trained, root = published
    emulated = EmulatedSampler("g", fmt, kv, shape, seed=0, kernel=KERNEL)
    emulated.load_weights(trained, 3)
    server = ReferenceEngine(
        EngineConfig(
            model=shape,
            weight_format=fmt,
            kv_cache_dtype=ENGINE_KV[kv],
            kernel=KERNEL,
            max_running_requests=1,
        )
    )
    view, _, weights = load_checkpoint(root / fmt)
    assert view == fmt
    server.load_weights(weights, view, 3)
    ids = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37]
    expected = _logits(server, ids, 4)
    assert torch.equal(_logits(emulated.engine, ids, 4), expected)
    # the same engine end to end: seeded, both sample the same tokens with the same log q
    a = emulated.generate_batch([Request(ids[:4], 6)], SamplingConfig(temperature=1.0, top_p=0.95, top_k=16))[
        0
    ]
    emulated_again = EmulatedSampler("g", fmt, kv, shape, seed=0, kernel=KERNEL)
    emulated_again.engine.load_weights(weights, view, 3)  # the published view, loaded as the server loads it
    b = emulated_again.generate_batch(
        [Request(ids[:4], 6)], SamplingConfig(temperature=1.0, top_p=0.95, top_k=16)
    )[0]
    assert a.output_ids.tolist() == b.output_ids.tolist() and a.logprobs.tolist() == b.logprobs.tolist()


def test_kv_auto_is_the_model_dtype_as_in_sglang(published):
    """SGLang's kv_cache_dtype "auto" is the model dtype (srt/mem_cache/kv_cache_dtype.py): bf16 for the
    bf16 kernels every group runs, so "auto" and "bf16" caches hold the same values, and both differ
    from a float32 cache (the reference server once kept "auto" in float32, the emulation in bf16)."""
    shape, trained, _ = published
    engine = EmulatedSampler("g", "bf16", "auto", shape, kernel=KERNEL).engine
    engine.load_weights(trained, "fp32", 0)
    assert engine.model.new_cache(1, kv_dtype="auto").kv_dtype == "bf16"
    ids = [1, 5, 9, 13, 17, 21]
    auto = _logits(engine, ids, 3)
    engine.config.kv_cache_dtype = "bf16"
    assert torch.equal(_logits(engine, ids, 3), auto)
    from rlfleet.numerics.engine_model import KVCache

    cache = KVCache(shape, 1, len(ids), kv_dtype="float32")
    rows = torch.tensor([0])
    fp32 = torch.cat(
        [engine.model(torch.tensor([ids[:3]]), cache, rows)]
        + [engine.model(torch.tensor([[t]]), cache, rows) for t in ids[3:]],
        1,
    )
    assert not torch.equal(fp32, auto)
