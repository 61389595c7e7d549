"""The megatron backend. Its pure parts (HF <-> Megatron layouts, TP shard split/merge, micro-batch
slicing, merging the objective's outputs, the config.json reading and the supported-parallelism rule)
are tested here; the backend itself runs in the megatron CPU tier: `megatron_cpu_checks.py` under
.venv312 (CPython 3.12, the REAL megatron-core 0.19.2 GPTModel on CPU with gloo, against transformers'
Qwen3; scripts/bootstrap makes the venv). That script's docstring names its stubs, all for CUDA-only
calls: CUDA device placement -> CPU (`torch.cuda.current_device`, `device="cuda"`, `Tensor.cuda()`,
`Tensor.type()`), `torch.cuda.current_stream`, and the CUDA RNG tracker's `fork` (no dropout)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model
from rlfleet.trainer.backends import backend_megatron as bm
from rlfleet.trainer.backends import megatron_support as ms
from rlfleet.trainer.backends.backend_common import merge_loss_outputs, to_token_batch
from rlfleet.trainer.objective import ObjectiveConfig, policy_loss

CFG = bm.MegatronModelConfig(
    vocab_size=32,
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    max_seq_len=16,
)
# Qwen3's shape: QK-norm, head_dim (12) != hidden / heads (8), tied embeddings
QWEN3 = replace(CFG, kv_channels=12, qk_layernorm=True, tie_word_embeddings=True)


def hf_weights(cfg: bm.MegatronModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hd = cfg.head_dim
    w = {
        "model.embed_tokens.weight": torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g),
        "model.norm.weight": torch.randn(cfg.hidden_size, generator=g),
    }
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = torch.randn(
            cfg.num_attention_heads * hd, cfg.hidden_size, generator=g
        )
        w[p + "self_attn.k_proj.weight"] = torch.randn(
            cfg.num_query_groups * hd, cfg.hidden_size, generator=g
        )
        w[p + "self_attn.v_proj.weight"] = torch.randn(
            cfg.num_query_groups * hd, cfg.hidden_size, generator=g
        )
        w[p + "self_attn.o_proj.weight"] = torch.randn(
            cfg.hidden_size, cfg.num_attention_heads * hd, generator=g
        )
        w[p + "mlp.gate_proj.weight"] = torch.randn(cfg.ffn_hidden_size, cfg.hidden_size, generator=g)
        w[p + "mlp.up_proj.weight"] = torch.randn(cfg.ffn_hidden_size, cfg.hidden_size, generator=g)
        w[p + "mlp.down_proj.weight"] = torch.randn(cfg.hidden_size, cfg.ffn_hidden_size, generator=g)
        w[p + "input_layernorm.weight"] = torch.randn(cfg.hidden_size, generator=g)
        w[p + "post_attention_layernorm.weight"] = torch.randn(cfg.hidden_size, generator=g)
        if cfg.qk_layernorm:
            w[p + "self_attn.q_norm.weight"] = torch.randn(hd, generator=g)
            w[p + "self_attn.k_norm.weight"] = torch.randn(hd, generator=g)
    return w


@pytest.mark.parametrize("te_spec", [True, False])
@pytest.mark.parametrize("cfg", [CFG, QWEN3], ids=["plain", "qwen3"])
def test_hf_megatron_roundtrip_is_exact(te_spec, cfg):
    hf = hf_weights(cfg)
    mg = bm.hf_to_megatron(hf, cfg, te_spec=te_spec)
    assert mg["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * cfg.head_dim, 32)
    assert ("output_layer.weight" in mg) == (not cfg.tie_word_embeddings)
    assert ("decoder.layers.1.self_attention.q_layernorm.weight" in mg) == cfg.qk_layernorm
    back = bm.megatron_to_hf(mg, cfg)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_fused_qkv_layout_is_grouped_per_query_group():
    """Megatron's fused QKV: per query group [q heads of the group; k; v] (a wrong interleave would
    still round-trip, so pin one row of each block)."""
    hf = hf_weights(CFG)
    qkv = bm.hf_to_megatron(hf, CFG)["decoder.layers.1.self_attention.linear_qkv.weight"]
    hd, per = 8, (2 + 2) * 8  # 2 q heads per group + k + v
    q, k, v = (hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(qkv[per + 0], q[2 * hd])  # group 1 starts with its first q head (head 2)
    assert torch.equal(qkv[per + 2 * hd], k[hd])  # then group 1's k
    assert torch.equal(qkv[per + 3 * hd], v[hd])  # then its v


@pytest.mark.parametrize("world", [1, 2, 4])
def test_tp_split_and_merge_are_inverse(world):
    mg = bm.hf_to_megatron(hf_weights(CFG), CFG)
    for name, full in mg.items():
        shards = [bm.split_tp_shard(name, full, r, world) for r in range(world)]
        if bm.tp_split_dim(name) is not None and world > 1:
            assert shards[0].numel() * world == full.numel()
        assert torch.equal(bm.merge_tp_shards(name, shards), full), name
    # the fused gate/up of fc1: each rank holds [gate_r; up_r], not a contiguous slice of [gate; up]
    fc1 = mg["decoder.layers.0.mlp.linear_fc1.weight"]
    if world == 2:
        shard0 = bm.split_tp_shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 0, 2)
        assert torch.equal(shard0[:32], fc1[:32]) and torch.equal(shard0[32:], fc1[64:96])


# Qwen3-MoE's shape: 4 experts of width 16, top-2, every layer a mixture of experts
MOE = replace(
    CFG,
    kv_channels=12,
    qk_layernorm=True,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
    norm_topk_prob=True,
)


def hf_moe_weights(cfg: bm.MegatronModelConfig) -> dict[str, torch.Tensor]:
    """A Qwen3-MoE state dict under checkpoint names (experts one by one)."""
    assert cfg.num_experts is not None and cfg.moe_ffn_hidden_size is not None
    g = torch.Generator().manual_seed(1)
    w = {k: v for k, v in hf_weights(cfg).items() if ".mlp." not in k}
    inter = cfg.moe_ffn_hidden_size
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp."
        w[p + "gate.weight"] = torch.randn(cfg.num_experts, cfg.hidden_size, generator=g)
        for e in range(cfg.num_experts):
            w[f"{p}experts.{e}.gate_proj.weight"] = torch.randn(inter, cfg.hidden_size, generator=g)
            w[f"{p}experts.{e}.up_proj.weight"] = torch.randn(inter, cfg.hidden_size, generator=g)
            w[f"{p}experts.{e}.down_proj.weight"] = torch.randn(cfg.hidden_size, inter, generator=g)
    return w


@pytest.mark.parametrize("te_spec", [True, False])
def test_moe_hf_megatron_roundtrip_is_exact(te_spec):
    hf = hf_moe_weights(MOE)
    mg = bm.hf_to_megatron(hf, MOE, te_spec=te_spec)
    fc1 = mg["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    # each expert's fused [gate; up], as the dense MLP's
    assert torch.equal(fc1[:16], hf["model.layers.1.mlp.experts.3.gate_proj.weight"])
    assert torch.equal(fc1[16:], hf["model.layers.1.mlp.experts.3.up_proj.weight"])
    assert torch.equal(mg["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])
    # a MoE layer's pre-MLP norm is its own module on both specs (TE fuses it into a dense fc1 only)
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in mg and not any(
        "linear_fc1.layer_norm" in k for k in mg
    )
    assert not any(k.endswith("mlp.linear_fc1.weight") for k in mg)
    back = bm.megatron_to_hf(mg, MOE)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_moe_mapping_takes_transformers_5_fused_experts():
    """transformers 5 keeps a Qwen3-MoE layer's experts fused in memory (gate_up_proj [E, 2I, H] with
    the gate rows first, down_proj [E, H, I]): the same Megatron tensors as the checkpoint names."""
    hf = hf_moe_weights(MOE)
    fused = {k: v for k, v in hf.items() if ".mlp.experts." not in k}
    for i in range(MOE.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        fused[p + "gate_up_proj"] = torch.stack(
            [torch.cat([hf[f"{p}{e}.gate_proj.weight"], hf[f"{p}{e}.up_proj.weight"]]) for e in range(4)]
        )
        fused[p + "down_proj"] = torch.stack([hf[f"{p}{e}.down_proj.weight"] for e in range(4)])
    want, got = bm.hf_to_megatron(hf, MOE, te_spec=False), bm.hf_to_megatron(fused, MOE, te_spec=False)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_expert_names_move_between_local_and_global_indices():
    name = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"
    assert bm.expert_index(name) == 1 and bm.expert_index("decoder.layers.1.mlp.router.weight") is None
    assert bm.with_expert_index(name, 3) == "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"


def _flat_batch():
    from rlfleet.trainer.rollout.batching import FlatBatch

    rng = np.random.default_rng(0)
    t, k = 12, 4
    counts = np.full(t, k)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    cand = np.stack([rng.permutation(32)[:k] for _ in range(t)])
    tgt = cand[:, 0]
    lq = np.log(np.full((t, k), 1 / k, dtype=np.float32))
    return FlatBatch(
        input_ids=rng.integers(0, 32, size=(4, 6)),
        seq_lens=np.full(4, 6),
        row_seq=np.repeat(np.arange(4), 3),
        row_pos=np.tile(np.arange(2, 5), 4),
        target_ids=tgt,
        advantages=rng.normal(size=t).astype(np.float32),
        logq=lq[:, 0].copy(),
        logq_support=lq[:, 0].copy(),
        cand_offsets=offsets,
        cand_ids=cand.reshape(-1),
        cand_logq=lq.reshape(-1),
        candidate_mode="support",
        versions=np.zeros(t, dtype=np.int64),
        staleness=np.zeros(t, dtype=np.int64),
        groups=np.array(["a", "b"] * 6, dtype=object),
        rollout_uids=["u0", "u1", "u2", "u3"],
    )


def test_micro_batches_reassemble_the_batch_loss_and_metrics():
    """Slicing by sequence and merging the objective's outputs gives the whole batch's token mean."""
    flat = _flat_batch()
    model = tiny_model(
        TinyQwen3(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=8,
        )
    )
    cfg = ObjectiveConfig(mode="sc_mis", replay=True)
    gi = {"a": 0, "b": 1}

    full = to_token_batch(flat, gi)
    with torch.no_grad():
        hidden = model.model(torch.from_numpy(flat.input_ids)).last_hidden_state
        rows = hidden[torch.from_numpy(flat.row_seq), torch.from_numpy(flat.row_pos)]

    def out_of(row_ids: np.ndarray):
        index = torch.from_numpy(row_ids)
        return policy_loss(rows[index], model.lm_head.weight, full.select(index), cfg)

    whole = out_of(np.arange(len(flat.row_seq)))
    parts = [out_of(np.flatnonzero(np.isin(flat.row_seq, s))) for s in ([0, 1], [2], [3])]
    merged = merge_loss_outputs(parts)
    assert merged.num_valid_tokens == whole.num_valid_tokens == 12
    assert float(merged.loss.detach()) == pytest.approx(float(whole.loss.detach()), rel=1e-5)
    for key in ("kl_k3", "entropy", "oor_fraction"):
        assert merged.metrics[key] == pytest.approx(whole.metrics[key], rel=1e-5)
    assert merged.per_group[1]["kl_k3"] == pytest.approx(whole.per_group[1]["kl_k3"], rel=1e-5)


def test_backend_refuses_cleanly_without_cuda_or_megatron():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(bm.BackendUnavailable, match="CUDA"):
        bm.MegatronBackend(CFG, ObjectiveConfig())


QWEN3_JSON = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "num_hidden_layers": 28,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
}


@pytest.mark.parametrize(
    "rope",
    [{"rope_theta": 1000000.0}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}],
    ids=["transformers4_rope_theta", "transformers5_rope_parameters"],
)
def test_qwen3_config_json_is_read_whole(rope):
    """Qwen3-0.6B's config.json: head_dim 128 != 1024 / 16, tied embeddings, QK-norm, rope theta 1e6
    in either form transformers writes."""
    cfg = bm.MegatronModelConfig.from_hf_config({**QWEN3_JSON, **rope}, max_seq_len=4096, tensor_parallel=2)
    assert (cfg.head_dim, cfg.kv_channels, cfg.rotary_base) == (128, 128, 1e6)
    assert cfg.tie_word_embeddings and cfg.qk_layernorm and cfg.sequence_parallel
    assert (cfg.num_query_groups, cfg.max_seq_len) == (8, 4096)
    cfg.check_supported()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "llama"}, "model_type 'llama'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope scaling 'yarn'"),
        ({"rope_parameters": None}, "rope_theta"),
        ({"attention_bias": True}, "attention bias"),
        ({"use_sliding_window": True}, "sliding-window"),
    ],
)
def test_config_json_the_model_would_compute_differently_is_refused(change, match):
    base = {**QWEN3_JSON, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    with pytest.raises(bm.UnsupportedModel, match=match):
        bm.MegatronModelConfig.from_hf_config({**base, **change})


QWEN3_MOE_JSON = {
    **QWEN3_JSON,
    "model_type": "qwen3_moe",
    "tie_word_embeddings": False,
    "num_local_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "intermediate_size": 6144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
}


@pytest.mark.parametrize(
    "experts_key", ["num_local_experts", "num_experts"], ids=["transformers5", "transformers4"]
)
@pytest.mark.parametrize("router_logits", [False, True])
def test_qwen3_moe_config_json_is_read_whole(experts_key, router_logits):
    """Qwen3-30B-A3B's MoE fields; transformers 5 writes `num_local_experts`, 4 wrote `num_experts`.
    The load-balancing loss counts only when the config asks for router logits (as transformers)."""
    hf = {k: v for k, v in QWEN3_MOE_JSON.items() if k != "num_local_experts"} | {
        experts_key: 128,
        "output_router_logits": router_logits,
    }
    cfg = bm.MegatronModelConfig.from_hf_config(hf, tensor_parallel=2, expert_parallel=8)
    assert (cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.norm_topk_prob) == (
        128,
        8,
        768,
        True,
    )
    assert (
        cfg.router_aux_loss_coef == (0.001 if router_logits else 0.0)
        and cfg.is_moe
        and cfg.expert_parallel == 8
    )
    cfg.check_supported()


@pytest.mark.parametrize(
    ("change", "kwargs", "match"),
    [
        ({"mlp_only_layers": [0]}, {}, "dense MLP layers among the expert layers"),
        ({"decoder_sparse_step": 2}, {}, "decoder_sparse_step 2"),
        ({}, {"expert_parallel": 3}, "expert parallelism 3 must divide num_experts=128"),
        ({"num_experts_per_tok": 129}, {}, "num_experts_per_tok 129 must be in"),
        (
            {"moe_intermediate_size": 769},
            {"tensor_parallel": 2},
            "expert tensor parallelism 2 must divide moe_intermediate_size=769",
        ),
        ({"moe_intermediate_size": 769}, {"tensor_parallel": 2, "expert_tensor_parallel": 1}, None),
    ],
)
def test_qwen3_moe_the_backend_cannot_run_is_refused(change, kwargs, match):
    """(An expert width that TP does not divide runs with whole experts per rank: expert TP 1.)"""
    if match is None:
        bm.MegatronModelConfig.from_hf_config({**QWEN3_MOE_JSON, **change}, **kwargs).check_supported()
        return
    with pytest.raises(bm.UnsupportedModel, match=match):
        bm.MegatronModelConfig.from_hf_config({**QWEN3_MOE_JSON, **change}, **kwargs).check_supported()


def test_expert_parallelism_on_a_dense_model_is_refused():
    cfg = bm.MegatronModelConfig.from_hf_config({**QWEN3_JSON, "rope_theta": 1e6}, expert_parallel=2)
    with pytest.raises(
        bm.UnsupportedModel,
        match="expert parallelism 2 / expert tensor parallelism 1 need a mixture of experts",
    ):
        cfg.check_supported()


@pytest.mark.parametrize(
    ("world", "tp", "ep", "etp", "match"),
    [
        (4, 2, 2, None, None),
        (8, 2, 2, None, None),
        (2, 2, 2, 1, None),
        (4, 2, 4, 1, None),
        (2, 2, 2, None, "expert tensor x expert parallelism (2 x 2 = 4)"),
        (6, 1, 4, None, "expert tensor x expert parallelism (1 x 4 = 4)"),
        (3, 2, 1, 1, "multiple of tensor parallelism 2"),
    ],
)
def test_world_must_hold_whole_expert_grids(world, tp, ep, etp, match):
    verdict = ms.world_support(world, tp=tp, ep=ep, expert_tp=etp)
    assert verdict.ok is (match is None)
    assert match is None or f"world size {world} must be a " in verdict.reason and match in verdict.reason


@pytest.mark.parametrize(
    ("layout", "ok", "match"),
    [
        ((1, 1, 1, False), True, ""),
        ((8, 1, 1, True), True, ""),
        ((2, 2, 1, True), False, "pipeline parallelism 2 is not supported"),
        ((2, 1, 2, True), False, "context parallelism 2 is not supported"),
        ((1, 1, 1, True), False, "sequence parallelism needs tensor parallelism > 1"),
        ((0, 1, 1, False), False, ">= 1"),
    ],
)
def test_parallelism_support_rule(layout, ok, match):
    verdict = ms.parallelism_support(*layout)
    assert verdict.ok is ok and match in verdict.reason


def test_unsupported_layouts_are_refused_before_anything_is_built():
    """Pipeline / context parallelism used to be accepted and then fail (or silently not split the
    sequence) at run time; a TP that does not divide the shapes is refused with the sizes named."""
    for change, match in (
        ({"pipeline_parallel": 2}, "pipeline parallelism 2"),
        ({"context_parallel": 2}, "context parallelism 2"),
        ({"tensor_parallel": 3}, "num_attention_heads=4, num_key_value_heads=2"),
    ):
        cfg = bm.MegatronModelConfig(**{**CFG.__dict__, **change})
        with pytest.raises(bm.UnsupportedModel, match=match):
            bm.MegatronBackend(cfg, ObjectiveConfig())


# ---------------------------------------------------------------------------------------------
# The megatron CPU tier (real megatron-core 0.19.2 under .venv312)

REPO = Path(__file__).resolve().parents[2]
CHECKS = [
    *(
        f"{kind}[{variant}]"
        for variant in ("qwen3_head_dim_rope_parameters", "qwen3_rope_theta", "qwen3_tied")
        for kind in (
            "logits_match_transformers",
            "hf_export_roundtrip_tp1",
            "tp2_logits_equal_tp1",
            "hf_export_roundtrip_tp2",
            "publish_version_0_nvfp4",
        )
    ),
    "publish_version_0_nvfp4_bf16[qwen3_tied]",
    "odd_seq_sequence_parallel_tp2_equals_tp1",
    "restore_then_step_equals_uninterrupted_all_ranks",
    "tp2_dp2_step_equals_single_process",
    "tp2_dp2_restore_then_step_equals_uninterrupted_all_ranks",
    "token_budget_micro_batches_equal_one_micro_batch",
    "activation_checkpointing_step_equals_plain",
]


def run_cpu_tier(tmp_path_factory, script: str) -> dict:
    """`script` (beside this file) run by .venv312's Python: the JSON it writes ({"checks": {name: {"ok":
    bool, ...}}, "wall_s": float}); its wall time goes to stderr, labelled with the script."""
    python = REPO / ".venv312" / "bin" / "python"
    assert python.exists(), "the megatron CPU tier needs .venv312: run scripts/bootstrap"
    out = tmp_path_factory.mktemp(Path(script).stem) / "checks.json"
    proc = subprocess.run(
        [str(python), str(Path(__file__).with_name(script)), str(out)],
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert out.exists(), f"{script} wrote no result (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    result = json.loads(out.read_text())
    sys.stderr.write(f"{script}: {result['wall_s']:.1f} s\n")
    return result


@pytest.fixture(scope="module")
def cpu_tier(tmp_path_factory) -> Callable[[str], dict]:
    """`cpu_tier(script)`: the JSON of megatron_cpu_checks.py or megatron_moe_cpu_checks.py, each run
    once per module (when a selected test first asks for it)."""
    results: dict[str, dict] = {}

    def result(script: str) -> dict:
        if script not in results:
            results[script] = run_cpu_tier(tmp_path_factory, script)
        return results[script]

    return result


@pytest.mark.slow
def test_megatron_cpu_tier_thresholds_are_tight(cpu_tier):
    checks = cpu_tier("megatron_cpu_checks.py")["checks"]
    for name in CHECKS:
        if name.startswith(("logits_match", "tp2_logits")):
            assert checks[name]["max_abs_diff"] <= 1e-5, name
    assert checks["odd_seq_sequence_parallel_tp2_equals_tp1"]["seq_len"] % 2 == 1
    for name in (
        "restore_then_step_equals_uninterrupted_all_ranks",
        "tp2_dp2_restore_then_step_equals_uninterrupted_all_ranks",
    ):
        ranks = checks[name]["per_rank"]
        assert len(ranks) == (2 if name.startswith("restore") else 4)
        assert all(r["adam_moment_tensors"] > 0 and r["model_tensors_changed_by_restore"] > 0 for r in ranks)
    assert (
        checks["tp2_dp2_step_equals_single_process"]["num_valid_tokens"] == 28
    )  # the whole batch, not a replica's half
    budget = checks["token_budget_micro_batches_equal_one_micro_batch"]
    assert budget["tokens"] == 41  # sum(RAGGED) - 7
    # packed THD rows at the budget of 14 (RAGGED through each last sampled token: 11, 2, 8, 4, 6, 1, 9),
    # first-fit decreasing: 11+2+1 | 9+4 | 8+6; each row's attention called once per layer (2 layers)
    assert sorted(map(tuple, budget["packed_rows"])) == sorted([(11, 2, 1)] * 2 + [(9, 4)] * 2 + [(8, 6)] * 2)
    for name in CHECKS:
        if name.startswith(
            "publish_version_0"
        ):  # every linear of the 2 layers quantized, amax not degenerate
            check = checks[name]
            assert check["version"] == 0 and check["quantized"] == check["linears"] == 14, name
            assert 0.0 < check["amax_range"][0] < check["amax_range"][1], name
    assert checks["publish_version_0_nvfp4_bf16[qwen3_tied]"]["dtype"] == "bfloat16"


# ---------------------------------------------------------------------------------------------
# The megatron CPU tier for a mixture of experts (megatron_moe_cpu_checks.py: the real megatron-core
# MoE layers against transformers' Qwen3-MoE, the project's tiny builder, 4 experts, top-2)

MOE_CHECKS = [
    *(
        f"{kind}[{variant}]"
        for variant in ("moe_norm_topk_prob", "moe_plain_topk_prob")
        for kind in (
            "moe_logits_match_transformers_ep1",
            "moe_hf_export_roundtrip_ep1",
            "moe_logits_match_transformers_ep2",
            "moe_hf_export_roundtrip_ep2",
        )
    ),
    "moe_publish_version_0_nvfp4[moe_norm_topk_prob]",
    "moe_router_aux_step_equals_transformers_backend",
    "moe_ep2_step_equals_ep1",
    "moe_ep2_restore_then_step_equals_uninterrupted_all_ranks",
    "moe_ep2_checkpoint_refused_at_ep1",
    "moe_router_aux_tp2_sequence_parallel_step_equals_tp1",
    "moe_logits_match_transformers_tp2_ep2[moe_norm_topk_prob]",
    "moe_hf_export_roundtrip_tp2_ep2[moe_norm_topk_prob]",
    "moe_tp2_ep2_step_equals_ep1",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "name"),
    [("megatron_cpu_checks.py", name) for name in CHECKS]
    + [("megatron_moe_cpu_checks.py", name) for name in MOE_CHECKS],
)
def test_megatron_cpu_tier(cpu_tier, script, name):
    """Logits of the GPTModel our backend builds equal transformers' Qwen3 (fp32, 1e-5) for QK-norm +
    custom head_dim, both rope forms and tied embeddings; TP=2 equals TP=1; HF -> megatron -> HF is
    bit-exact at TP 1 and 2; version 0 of a bf16 + nvfp4 channel is published from the backend (the
    path `rlfleet trainer run` takes before step 1), each quantized linear's input_scale from the
    activation amax transformers' Qwen3 gives with the exported weights (exact; fp32, and bf16); an
    odd sequence length under TP=2 sequence parallel gives the TP=1 loss; restore + one step is
    bit-equal to the uninterrupted run on every rank, Adam moments included (TP=2, and TP=2 x DP=2
    with the optimizer state sharded over the replicas); TP=2 x DP=2 gives the single process's
    update, and rank 0 reports the whole batch's loss and metrics.

    Qwen3-MoE in megatron-core (TopKRouter, SequentialMLP experts, alltoall dispatch over gloo):
    logits equal transformers' (fp32, 1e-5) with and without `norm_topk_prob`, at EP=1 and EP=2 (two
    experts per rank); HF -> megatron -> HF is bit-exact at EP 1 and 2 (experts gathered from their
    ranks); version 0 is published from the backend (bf16 + nvfp4 views) with every attention and
    expert linear quantized and its input_scale from transformers' Qwen3-MoE's activation amax; a ragged step at EP=2 (3 packed micro-batches on one rank, 1 on the other: empty ones make
    up the count) equals EP=1; save -> restore -> step at EP=2 (bf16) is bit-equal to the uninterrupted
    run on both ranks, their experts and Adam moments included, and that checkpoint is refused by an
    EP=1 run of the same world size (its ranks' local experts would be other experts); with `output_router_logits` the step (two packed micro-batches) has the
    transformers backend's loss, gradient norm and routing mismatch against the samplers' experts
    (whole batch and per group), load-balancing term included, activation recompute
    gives the same step, and TP=2 with sequence parallel (each expert split over the 2 ranks; padding
    tokens counted out of the term) equals TP=1; TP=2 x EP=2 with whole experts (4 processes) gives
    transformers' logits, the exact export and the EP=1 step."""
    check = cpu_tier(script)["checks"][name]
    assert check["ok"], check


@pytest.mark.slow
def test_megatron_moe_cpu_tier_thresholds_are_tight(cpu_tier):
    checks = cpu_tier("megatron_moe_cpu_checks.py")["checks"]
    assert set(checks) == set(MOE_CHECKS)
    for name in MOE_CHECKS:
        if name.startswith("moe_logits"):
            assert checks[name]["max_abs_diff"] <= 1e-5, name
        if name.startswith("moe_hf_export"):  # 2 layers x 4 experts x gate/up/down, every name back
            assert checks[name]["expert_tensors"] == 24 and not checks[name]["unequal"], name
        if name.startswith(("moe_logits_match_transformers_ep2", "moe_logits_match_transformers_tp2_ep2")):
            assert checks[name]["local_experts"] == 2, name
    tp2_ep2 = checks["moe_logits_match_transformers_tp2_ep2[moe_norm_topk_prob]"]
    assert (
        tp2_ep2["expert_fc1_rows"] == 2 * 16 and tp2_ep2["qkv_rows"] == (4 + 2 * 2) * 12 // 2
    )  # whole experts, attention split
    assert checks["moe_router_aux_step_equals_transformers_backend"]["activation_checkpointing"]["ok"]
    publish = checks["moe_publish_version_0_nvfp4[moe_norm_topk_prob]"]
    assert (
        publish["version"] == 0
        and publish["quantized"] == 2 * (4 + 4 * 3)
        and publish["expert_linears"] == 24
    )
    aux = checks["moe_router_aux_step_equals_transformers_backend"]
    assert aux["grad_norm_diff"] <= 1e-5 and aux["aux_grad_norm_effect"] > 100 * aux["grad_norm_diff"]
    # the routing mismatch against the samplers' experts: 28 rows, every fifth without routing -> 22
    # compared, as the transformers backend measures it, per group too; a mismatch neither 0 nor 1
    assert aux["routing"] == aux["transformers_routing"] and aux["routing"]["routing_tokens"] == 22
    assert 0 < aux["routing"]["routing_mismatch_layers"] < 1 and aux["routing_groups"] == ["0", "1"]
    for name in (
        "moe_ep2_step_equals_ep1",
        "moe_tp2_ep2_step_equals_ep1",
        "moe_router_aux_tp2_sequence_parallel_step_equals_tp1",
    ):
        assert checks[name]["routing"]["routing_tokens"] > 0, name
    assert checks["moe_ep2_step_equals_ep1"]["num_valid_tokens"] == 41  # sum(RAGGED) - 7: the whole batch
    ranks = checks["moe_ep2_restore_then_step_equals_uninterrupted_all_ranks"]["per_rank"]
    assert len(ranks) == 2  # each rank's 2 experts x 2 layers x fc1/fc2, all restored from the other run's
    assert all(
        r["adam_moment_tensors"] > 0 and r["expert_tensors"] == r["expert_tensors_changed_by_restore"] == 8
        for r in ranks
    )
