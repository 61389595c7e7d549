"""The reference engine's Qwen3 (`EngineModel`, rlfleet/numerics/engine_model.py) held against transformers'
`Qwen3ForCausalLM`, the oracle: the same weights give the same logits (to 1e-5 with the exact kernel)
for QK-norm, grouped-query attention, a head_dim that is not hidden/heads, tied and untied embeddings,
and rope given as transformers 5 `rope_parameters` and as a transformers 4 top-level `rope_theta`;
the slot KV cache (prefill, chunked appends, ragged batched one-token decodes) equals the plain forward;
the kernel and KV-cache emulations differ from exact by a bounded amount; `ModelShape.from_hf_config`
refuses what the engine does not implement; `load_checkpoint` reads `save_pretrained` directories and
published views.

Every norm weight (incl. q_norm / k_norm) is set to random non-unit values, so a missing or misplaced
norm changes the logits; each oracle case also checks that the feature it names really moves them.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from typing import Any

import pytest
import torch

from rlfleet.numerics.engine_model import (
    EngineModel,
    KernelConfig,
    ModelShape,
    UnsupportedModelError,
    load_checkpoint,
    precision_view,
)
from rlfleet.numerics.views import checkpoint_tensors
from rlfleet.sampler.reference_engine import seeded_weights, tiny_shape
from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

EXACT_ATOL = 1e-5
SMALL = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64}  # fmt: skip


def _ids(b: int, s: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def _random_norms(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every RMSNorm weight (layer norms, final norm, q_norm, k_norm) to 1 + 0.5 N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
    return model


def _plain_qwen3(seed: int = 0, **config: Any) -> Any:
    """transformers' Qwen3ForCausalLM of a plain Qwen3Config with transformers' own (default) init."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return _random_norms(Qwen3ForCausalLM(Qwen3Config(**config)).eval(), seed)


def _engine_of(hf: Any, kernel: KernelConfig | None = None, config: dict | None = None) -> EngineModel:
    """The engine's model of an HF model: its shape from the config dict, its state dict as weights."""
    model = EngineModel(ModelShape.from_hf_config(config or hf.config.to_dict()), kernel).eval()
    model.load_weights(checkpoint_tensors(hf.state_dict()))  # a MoE's experts by their checkpoint names
    return model


@torch.no_grad()
def _oracle(hf: Any, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids).logits.float()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


MOE = {"architecture": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
PLAIN = {
    "vocab_size": 80,
    "hidden_size": 32,
    "intermediate_size": 48,
    "max_position_embeddings": 64,
}  # plain configs
CASES = {
    # the tiny Qwen3 init (rlfleet/tiny_qwen3.py) at small sizes
    "tiny": lambda: _random_norms(tiny_model(TinyQwen3(**SMALL, seed=1)), 1),
    # grouped-query attention (4 query heads on 2 KV heads) and head_dim 8 != hidden 48 / 4 heads
    "gqa_head_dim": lambda: _random_norms(
        tiny_model(
            TinyQwen3(
                **{
                    **SMALL,
                    "hidden_size": 48,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "head_dim": 8,
                },
                seed=2,
            )
        ),
        2,
    ),
    "tied": lambda: _random_norms(tiny_model(TinyQwen3(**SMALL, tie_word_embeddings=True, seed=3)), 3),
    # the tiny Qwen3-MoE (rlfleet/tiny_qwen3.py): 4 routed experts of 16, top-2, renormalised
    "moe": lambda: _random_norms(tiny_model(TinyQwen3(**SMALL, **MOE, seed=4)), 4),
    # transformers' default init, 4 query heads on 1 KV head, head_dim 12 != 32 / 4, theta 500
    "plain_config": lambda: _plain_qwen3(
        **PLAIN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=12,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    ),
    "plain_config_tied": lambda: _plain_qwen3(
        seed=1,
        **PLAIN,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_exact_kernel_logits_equal_transformers(case):
    hf = CASES[case]()
    shape = ModelShape.from_hf_config(hf.config.to_dict())
    ids = _ids(3, 12, shape.vocab_size, seed=len(case))
    want = _oracle(hf, ids)
    engine = _engine_of(hf)
    with torch.no_grad():
        got = engine(ids)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert float(want.std()) > 0.05  # logits with spread: 1e-5 is a real tolerance, not a rounding of zero
    assert _max_diff(got, want) < EXACT_ATOL
    assert shape.tie_word_embeddings == hf.config.tie_word_embeddings
    assert ("lm_head.weight" in engine.state_dict()) != shape.tie_word_embeddings
    # the features are really exercised: undoing each one moves the logits far beyond the tolerance
    with torch.no_grad():
        for norm in ("q_norm", "k_norm"):
            undone = _engine_of(hf)
            for layer in undone.model.layers:
                getattr(layer.self_attn, norm).weight.fill_(1.0)
            assert _max_diff(undone(ids), want) > 1e-3, norm
        other_theta = EngineModel(replace(shape, rope_theta=shape.rope_theta * 3)).eval()
        other_theta.load_weights(checkpoint_tensors(hf.state_dict()))
        assert _max_diff(other_theta(ids), want) > 1e-3


def test_grouped_query_attention_and_head_dim_are_read_from_the_config():
    hf = CASES["gqa_head_dim"]()
    shape = ModelShape.from_hf_config(hf.config.to_dict())
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (4, 2, 8)
    assert shape.head_dim != shape.hidden_size // shape.num_attention_heads
    assert (shape.q_size, shape.kv_size) == tuple(
        hf.state_dict()[f"model.layers.0.self_attn.{p}_proj.weight"].shape[0] for p in "qk"
    )


def test_rope_theta_from_transformers_4_and_5_configs(tmp_path):
    """A transformers 5 config (`rope_parameters`) and the same config written the transformers 4 way
    (top-level `rope_theta`, no `rope_parameters`: a config.json edited by hand) give the engine the
    same, non-default theta, and the logits transformers computes for each."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf = _random_norms(tiny_model(TinyQwen3(**SMALL, seed=4)), 4)
    v5 = hf.config.to_dict()
    assert v5["rope_parameters"]["rope_theta"] == 10_000.0  # Qwen3Config's default, the tiny Qwen3's
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 2500.0}
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"} | {
        "rope_theta": 2500.0,
        "rope_scaling": None,
    }
    (tmp_path / "config.json").write_text(json.dumps(v4))
    ids = _ids(2, 20, SMALL["vocab_size"])
    for config in (v5, json.loads((tmp_path / "config.json").read_text())):
        oracle = Qwen3ForCausalLM(Qwen3Config.from_dict(config)).eval()
        oracle.load_state_dict(hf.state_dict())
        assert oracle.config.rope_parameters["rope_theta"] == 2500.0  # transformers read it too
        engine = _engine_of(oracle, config=config)
        assert engine.shape.rope_theta == 2500.0
        with torch.no_grad():
            assert _max_diff(engine(ids), _oracle(oracle, ids)) < EXACT_ATOL
            assert _max_diff(engine(ids), _oracle(hf, ids)) > 1e-3  # theta 1e4 vs 2500: rope really differs
    assert ModelShape.from_checkpoint(tmp_path).rope_theta == 2500.0


@torch.no_grad()
@pytest.mark.parametrize("case", ["tiny", "gqa_head_dim"])
def test_slot_cache_ragged_decode_equals_the_plain_forward(case):
    """Prompts of different lengths prefilled into non-adjacent slots, one chunked append, then batched
    one-token decodes over rows of different lengths: every step's logits equal transformers' and the
    engine's full forward of the row's whole sequence."""
    hf = CASES[case]()
    engine = _engine_of(hf)
    vocab = engine.shape.vocab_size
    prompts = [_ids(1, n, vocab, seed=n)[0].tolist() for n in (3, 9, 5)]
    slots = [5, 1, 3]
    cache = engine.new_cache(slots=6, capacity=32)
    steps: list[list[torch.Tensor]] = [[] for _ in prompts]  # per row, logits of each appended token
    for row, (slot, p) in enumerate(zip(slots, prompts, strict=True)):
        steps[row].extend(engine(torch.tensor([p]), cache, torch.tensor([slot]))[0])
    chunk = [7, 8, 9]  # a chunked append to one slot that already holds tokens
    steps[1].extend(engine(torch.tensor([chunk]), cache, torch.tensor([1]))[0])
    seqs = [prompts[0], prompts[1] + chunk, prompts[2]]
    for step in range(4):  # batched decode, rows in a different order than their slots
        nxt = [(11 * step + 5 * i) % vocab for i in range(3)]
        out = engine(torch.tensor([[t] for t in nxt]), cache, torch.tensor(slots))
        for row, t in enumerate(nxt):
            seqs[row].append(t)
            steps[row].append(out[row, 0])
    assert cache.lengths[slots].tolist() == [len(s) for s in seqs] == [7, 16, 9]
    assert cache.lengths[[0, 2, 4]].tolist() == [0, 0, 0]
    for row, seq in enumerate(seqs):
        got = torch.stack(steps[row])
        assert got.shape[0] == len(seq)
        assert _max_diff(got, engine(torch.tensor([seq]))[0]) < EXACT_ATOL
        assert _max_diff(got, _oracle(hf, torch.tensor([seq]))[0]) < EXACT_ATOL


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention with K (after QK-norm and rope) and V rounded through torch's
    float8_e4m3fn dtype: what an fp8_e4m3 KV cache with scale 1.0 hands the attention kernel."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def e4m3(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float8_e4m3fn).to(t.dtype)

    return sdpa_attention_forward(module, query, e4m3(key), e4m3(value), attention_mask, **kwargs)


@torch.no_grad()
def test_emulated_kernels_and_fp8_kv_cache_differ_from_exact_by_a_bounded_amount():
    """bf16 kernel and split-K: they differ from exact, by no more than transformers' own bf16 computation of
    the same checkpoint differs from its fp32 one (the bound: a real bf16 run of the same model), and
    split-K differs from the unsplit bf16 kernel. fp8 KV cache: its cached decode equals transformers
    with K and V rounded through torch's float8_e4m3fn (the oracle) and differs from exact."""
    from transformers import AttentionInterface

    hf = CASES["tiny"]()
    ids = _ids(3, 16, SMALL["vocab_size"], seed=5)
    exact = _oracle(hf, ids)
    real_bf16 = _max_diff(_oracle(copy.deepcopy(hf).to(torch.bfloat16), ids), exact)
    bf16 = _engine_of(hf, KernelConfig("bfloat16"))(ids)
    split = _engine_of(hf, KernelConfig("bfloat16", split_k=4))(ids)
    for got in (bf16, split):
        assert 1e-4 < _max_diff(got, exact) <= real_bf16
    assert _max_diff(split, bf16) > 1e-4

    AttentionInterface.register("rlfleet_fp8_kv_test", _fp8_kv_attention)
    fp8_oracle = _oracle(hf.set_attn_implementation("rlfleet_fp8_kv_test") or hf, ids)
    hf.set_attn_implementation("sdpa")
    engine = _engine_of(hf)
    cache = engine.new_cache(slots=3, capacity=16, kv_dtype="fp8_e4m3")
    parts = [engine(ids[:, :6], cache)] + [engine(ids[:, t : t + 1], cache) for t in range(6, 16)]
    fp8_kv = torch.cat(parts, 1)
    assert _max_diff(fp8_kv, fp8_oracle) < EXACT_ATOL
    assert _max_diff(fp8_kv, exact) > 1e-3


# --------------------------------------------------------------------------------------- refusals
def _qwen3_dict(**overrides: Any) -> dict[str, Any]:
    return TinyQwen3(**SMALL).hf_config().to_dict() | overrides


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (lambda: __import__("transformers").LlamaConfig().to_dict(), "model_type 'llama'.*--engine sglang"),
        (
            lambda: TinyQwen3(**SMALL, **MOE).hf_config().to_dict() | {"mlp_only_layers": [1]},
            "Qwen3-MoE with dense layers .* not implemented",
        ),
        (lambda: {k: v for k, v in _qwen3_dict().items() if k != "model_type"}, "model_type None"),
        (
            lambda: (
                __import__("transformers")
                .Qwen3Config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
                .to_dict()
            ),
            "rope scaling .*linear.* is not implemented",
        ),
        (  # a transformers 4 config.json's rope_scaling
            lambda: (
                {k: v for k, v in _qwen3_dict().items() if k != "rope_parameters"}
                | {"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
            ),
            "rope scaling .*yarn.* is not implemented",
        ),
        (
            lambda: (
                __import__("transformers").Qwen3Config(use_sliding_window=True, sliding_window=16).to_dict()
            ),
            "sliding-window attention is not implemented",
        ),
        (
            lambda: __import__("transformers").Qwen3Config(attention_bias=True).to_dict(),
            "attention_bias .* is not implemented",
        ),
        (lambda: _qwen3_dict(hidden_act="gelu"), "hidden_act 'gelu' is not implemented"),
    ],
    ids=[
        "llama",
        "qwen3_moe",
        "no_model_type",
        "rope_linear",
        "rope_scaling_v4",
        "sliding_window",
        "attention_bias",
        "hidden_act",
    ],
)
def test_from_hf_config_refuses_what_the_engine_does_not_implement(config, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelShape.from_hf_config(config())


def test_shape_and_weight_checks_are_clear():
    shape = tiny_shape(**SMALL)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        replace(shape, num_attention_heads=3)
    with pytest.raises(ValueError, match="head_dim must be even"):
        replace(shape, head_dim=15)
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        replace(shape, vocab_size=0)
    engine = EngineModel(shape)
    weights = seeded_weights(shape, 0)
    with pytest.raises(ValueError, match="missing .*q_norm"):
        engine.load_weights({k: v for k, v in weights.items() if "q_norm" not in k})
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights(weights | {"lm_head.weight": weights["lm_head.weight"][:-1]})
    tied = EngineModel(replace(shape, tie_word_embeddings=True))
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        tied.load_weights(weights)  # an untied lm_head cannot serve as the tied output projection
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine(_ids(1, shape.max_position_embeddings + 1, shape.vocab_size))
    with pytest.raises(ValueError, match="capacity 4 exceeded"):
        engine(_ids(1, 5, shape.vocab_size), engine.new_cache(1, capacity=4))


# --------------------------------------------------------------------------------- names and init
def test_parameter_names_are_the_hf_checkpoints(tmp_path):
    from safetensors import safe_open

    for tied in (False, True):
        hf = tiny_model(TinyQwen3(**SMALL, tie_word_embeddings=tied))
        hf.save_pretrained(tmp_path / str(tied))
        with safe_open(str(tmp_path / str(tied) / "model.safetensors"), "pt") as f:
            stored = set(f.keys())
        assert set(EngineModel(ModelShape.from_checkpoint(tmp_path / str(tied))).state_dict()) == stored
        assert ("lm_head.weight" in stored) != tied


def test_seeded_weights_depend_on_the_seed_only():
    shape = tiny_shape(**SMALL)
    torch.manual_seed(123)
    a = seeded_weights(shape, 7)
    torch.manual_seed(999)
    b = seeded_weights(shape, 7)
    c = seeded_weights(shape, 8)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert set(a) == set(EngineModel(shape).state_dict())


@torch.no_grad()
def test_forward_is_causal():
    engine = EngineModel(tiny_shape(**SMALL)).eval()
    engine.load_weights(seeded_weights(engine.shape, 0))
    ids = _ids(2, 10, SMALL["vocab_size"])
    changed = ids.clone()
    changed[:, 6] = (changed[:, 6] + 1) % SMALL["vocab_size"]
    a, b = engine(ids), engine(changed)
    assert torch.equal(a[:, :6], b[:, :6]) and _max_diff(a[:, 6:], b[:, 6:]) > 1e-3


# ------------------------------------------------------------------------------------ checkpoints
def test_load_checkpoint_of_save_pretrained_and_of_a_published_view(tmp_path):
    """A `save_pretrained` directory (fp32 and bf16) and a bf16 view published from it
    (rlfleet.numerics.views.save_view with the base checkpoint) load as the same weights and shape."""
    from rlfleet.numerics.views import save_view

    hf = _random_norms(tiny_model(TinyQwen3(**SMALL, seed=6)), 6)
    state = hf.state_dict()
    hf.save_pretrained(tmp_path / "fp32")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    hf.float()
    save_view(state, "bf16", tmp_path / "view", base_checkpoint=tmp_path / "fp32")
    shape = ModelShape.from_hf_config(hf.config.to_dict())
    rounded = {k: v.to(torch.bfloat16).float() for k, v in state.items()}
    for directory, view, want in (
        ("fp32", "fp32", state),
        ("bf16", "fp32", rounded),
        ("view", "bf16", rounded),
    ):
        got_view, got_shape, weights = load_checkpoint(tmp_path / directory)
        assert (got_view, got_shape) == (view, shape), directory
        assert weights.keys() == want.keys() and all(torch.equal(weights[k], want[k]) for k in want), (
            directory
        )
    with pytest.raises(UnsupportedModelError, match="no config.json"):
        load_checkpoint(tmp_path / "missing")


# --------------------------------------------------------------------------------------- mixture of experts
def test_moe_routes_every_token_to_the_experts_transformers_routes_it_to():
    """The tiny Qwen3-MoE: per layer and token, the engine's `routed_experts` are the top-2 of
    transformers' router logits (the same set; transformers' order is the engine's: by probability), with
    and without the slot cache (a prefill then one-token decodes give the full forward's routing); the
    experts really are routed (several experts per layer, and a token's pair differs between tokens)."""
    hf = CASES["moe"]()
    engine = _engine_of(hf)
    ids = _ids(2, 10, engine.shape.vocab_size, seed=7)
    with torch.no_grad():
        engine(ids)
        routed = engine.routed_experts
        router_logits = hf(ids, output_router_logits=True).router_logits  # per layer [B x S, E]
    assert routed is not None and tuple(routed.shape) == (2, 10, 2, 2)
    for layer, logits in enumerate(router_logits):
        want = logits.float().softmax(-1).topk(2, dim=-1).indices.reshape(2, 10, 2)
        assert torch.equal(routed[:, :, layer], want), layer
        assert len(torch.unique(want)) >= 3 and len({tuple(p) for p in want.reshape(-1, 2).tolist()}) >= 2
    cache = engine.new_cache(slots=2, capacity=16)
    with torch.no_grad():
        engine(ids[:1, :6], cache, torch.tensor([1]))
        steps = [engine.routed_experts[0]]
        for t in range(6, 10):
            engine(ids[:1, t : t + 1], cache, torch.tensor([1]))
            steps.append(engine.routed_experts[0])
    assert torch.equal(torch.cat(steps), routed[0])
    dense = _engine_of(CASES["tiny"]())
    with torch.no_grad():
        dense(ids)
    assert dense.routed_experts is None


def test_moe_precision_view_quantizes_the_experts_not_the_router():
    """A weight format reaches every expert's projections (the 2-D `_proj.weight`s) and leaves the
    router in bf16, as SGLang keeps `mlp.gate` unquantized."""
    weights = checkpoint_tensors(CASES["moe"]().state_dict())
    view = precision_view(weights, "fp8")
    router, expert = "model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.3.up_proj.weight"
    assert torch.equal(view[router], weights[router].to(torch.bfloat16).float())
    assert not torch.equal(view[expert], weights[expert].to(torch.bfloat16).float())


def test_the_moe_checkpoint_and_seeded_weights_load_by_their_names(tmp_path):
    """The engine's MoE parameters are exactly the names `save_pretrained` stores (each expert's
    projections one by one, the router); an engine started without a checkpoint serves the tiny
    Qwen3-MoE's seeded init (`seeded_weights` of a MoE shape), whose logits are transformers'."""
    from safetensors import safe_open

    spec = TinyQwen3(**SMALL, **MOE, seed=6)
    tiny_model(spec).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    shape = ModelShape.from_checkpoint(tmp_path)
    assert shape == tiny_shape(**SMALL, **MOE) and shape.is_moe and shape.num_experts == 4
    assert (
        set(EngineModel(shape).state_dict()) == stored
        and "model.layers.1.mlp.experts.3.down_proj.weight" in stored
    )
    engine = EngineModel(shape).eval()
    engine.load_weights(seeded_weights(shape, 6))
    ids = _ids(2, 8, shape.vocab_size, seed=1)
    with torch.no_grad():
        assert _max_diff(engine(ids), _oracle(tiny_model(spec), ids)) < EXACT_ATOL
