"""TinyGPT: HF names, deterministic init, causality, and the KV-cached path equals the full forward."""

from __future__ import annotations

import pytest
import torch

from rlfleet.numerics.tinygpt import KernelConfig, TinyGPT, TinyGPTConfig, build_tinygpt

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


CFG = TinyGPTConfig(vocab_size=128, n_layer=2, n_head=4, d_model=32, max_seq_len=64, seed=7)


def _ids(b: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))


def test_hf_parameter_names():
    names = set(TinyGPT(CFG).state_dict())
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(CFG.n_layer):
        p = f"model.layers.{i}."
        expected |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        expected |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    assert names == expected


def test_init_is_deterministic_from_seed_only():
    torch.manual_seed(123)
    a = TinyGPT(CFG).state_dict()
    torch.manual_seed(999)
    b = TinyGPT(CFG).state_dict()
    c = TinyGPT(TinyGPTConfig(**{**CFG.__dict__, "seed": 8})).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


@torch.no_grad()
def test_forward_is_causal_and_float32():
    m = TinyGPT(CFG).eval()
    ids = _ids(2, 10)
    logits = m(ids)
    assert logits.shape == (2, 10, CFG.vocab_size) and logits.dtype == torch.float32
    changed = ids.clone()
    changed[:, 6] = (changed[:, 6] + 1) % CFG.vocab_size
    logits2 = m(changed)
    assert torch.equal(logits[:, :6], logits2[:, :6])
    assert not torch.allclose(logits[:, 6:], logits2[:, 6:])


@torch.no_grad()
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_kv_cached_ragged_decode_matches_full_forward(kv_dtype):
    m = TinyGPT(CFG).eval()
    prompts = [_ids(1, n, seed=n)[0] for n in (3, 9, 5)]
    cache = m.new_cache(slots=6, kv_dtype=kv_dtype)
    slots = [5, 1, 3]
    last = []
    for slot, p in zip(slots, prompts, strict=True):  # prefill each prompt into its own slot
        last.append(m(p[None], cache, torch.tensor([slot]))[0, -1])
    seqs = [p.tolist() for p in prompts]
    step_logits = [torch.stack(last)]
    for step in range(4):  # batched decode across rows of different lengths
        nxt = torch.tensor([[(7 * step + i) % CFG.vocab_size] for i in range(3)])
        for s, t in zip(seqs, nxt[:, 0].tolist(), strict=True):
            s.append(t)
        step_logits.append(m(nxt, cache, torch.tensor(slots))[:, 0])
    assert cache.lengths[slots].tolist() == [len(s) for s in seqs]
    tol = 1e-4 if kv_dtype == "auto" else None
    for i, s in enumerate(seqs):
        full = m(torch.tensor([s]))[0]  # [S, V]
        got = torch.stack([sl[i] for sl in step_logits])  # logits at the last 5 positions
        want = full[-5:]
        if tol is not None:
            assert torch.allclose(got, want, atol=tol)
        else:  # fp8 KV: close but not identical
            assert not torch.allclose(got, want, atol=1e-6)
            assert (got - want).abs().max() < 0.5


@torch.no_grad()
def test_kernel_knob_changes_logits_slightly():
    m = TinyGPT(CFG).eval()
    ids = _ids(2, 16)
    ref = m(ids)
    m.kernel = KernelConfig("bfloat16", split_k=1)
    bf = m(ids)
    m.kernel = KernelConfig("bfloat16", split_k=4)
    bf_split = m(ids)
    assert 0 < (bf - ref).abs().max() < 0.2
    assert 0 < (bf_split - bf).abs().max() < 0.2


def test_build_loads_state_dict_and_rejects_bad_config():
    sd = TinyGPT(CFG).state_dict()
    m = build_tinygpt(TinyGPTConfig(**{**CFG.__dict__, "seed": 1}), sd)
    assert torch.equal(m.state_dict()["lm_head.weight"], sd["lm_head.weight"])
    with pytest.raises(ValueError, match="divisible"):
        TinyGPTConfig(d_model=30, n_head=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        TinyGPT(CFG)(_ids(1, CFG.max_seq_len + 1))


def test_trainable_gradients_flow():
    m = TinyGPT(CFG)
    loss = torch.nn.functional.cross_entropy(m(_ids(2, 8)).flatten(0, 1), _ids(2, 8, seed=1).flatten())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
