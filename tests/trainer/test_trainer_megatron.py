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
from pathlib import Path

import numpy as np
import pytest
import torch

from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model
from rlfleet.trainer import backend_megatron as bm
from rlfleet.trainer import megatron_support as ms
from rlfleet.trainer.backend_common import merge_loss_outputs, to_token_batch
from rlfleet.trainer.objective import ObjectiveConfig, policy_loss

CFG = bm.MegatronModelConfig(vocab_size=32, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=64, max_seq_len=16)
# Qwen3's shape: QK-norm, head_dim (12) != hidden / heads (8), tied embeddings
QWEN3 = bm.MegatronModelConfig(vocab_size=32, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=64, max_seq_len=16, kv_channels=12, qk_layernorm=True, tie_word_embeddings=True)


def hf_weights(cfg: bm.MegatronModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hd = cfg.head_dim
    w = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g),
         "model.norm.weight": torch.randn(cfg.hidden_size, generator=g)}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = torch.randn(cfg.num_attention_heads * hd, cfg.hidden_size, generator=g)
        w[p + "self_attn.k_proj.weight"] = torch.randn(cfg.num_query_groups * hd, cfg.hidden_size, generator=g)
        w[p + "self_attn.v_proj.weight"] = torch.randn(cfg.num_query_groups * hd, cfg.hidden_size, generator=g)
        w[p + "self_attn.o_proj.weight"] = torch.randn(cfg.hidden_size, cfg.num_attention_heads * hd, generator=g)
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


def _flat_batch():
    from rlfleet.trainer.batching import FlatBatch

    rng = np.random.default_rng(0)
    t, k = 12, 4
    counts = np.full(t, k)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    cand = np.stack([rng.permutation(32)[:k] for _ in range(t)])
    tgt = cand[:, 0]
    lq = np.log(np.full((t, k), 1 / k, dtype=np.float32))
    return FlatBatch(
        input_ids=rng.integers(0, 32, size=(4, 6)), seq_lens=np.full(4, 6), row_seq=np.repeat(np.arange(4), 3),
        row_pos=np.tile(np.arange(2, 5), 4), target_ids=tgt, advantages=rng.normal(size=t).astype(np.float32),
        logq=lq[:, 0].copy(), logq_support=lq[:, 0].copy(), cand_offsets=offsets, cand_ids=cand.reshape(-1),
        cand_logq=lq.reshape(-1), candidate_mode="support", versions=np.zeros(t, dtype=np.int64),
        staleness=np.zeros(t, dtype=np.int64), groups=np.array(["a", "b"] * 6, dtype=object),
        rollout_uids=["u0", "u1", "u2", "u3"],
    )


def test_micro_batches_reassemble_the_batch_loss_and_metrics():
    """Slicing by sequence and merging the objective's outputs gives the whole batch's token mean."""
    flat = _flat_batch()
    model = tiny_model(TinyQwen3(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=8))
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


QWEN3_JSON = {"model_type": "qwen3", "vocab_size": 151936, "num_hidden_layers": 28, "hidden_size": 1024,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
              "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
              "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False}


@pytest.mark.parametrize("rope", [{"rope_theta": 1000000.0},
                                  {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}],
                         ids=["transformers4_rope_theta", "transformers5_rope_parameters"])
def test_qwen3_config_json_is_read_whole(rope):
    """Qwen3-0.6B's config.json: head_dim 128 != 1024 / 16, tied embeddings, QK-norm, rope theta 1e6
    in either form transformers writes."""
    cfg = bm.MegatronModelConfig.from_hf_config({**QWEN3_JSON, **rope}, max_seq_len=4096, tensor_parallel=2)
    assert (cfg.head_dim, cfg.kv_channels, cfg.rotary_base) == (128, 128, 1e6)
    assert cfg.tie_word_embeddings and cfg.qk_layernorm and cfg.sequence_parallel
    assert (cfg.num_query_groups, cfg.max_seq_len) == (8, 4096)
    cfg.check_supported()


@pytest.mark.parametrize(("change", "match"), [
    ({"model_type": "llama"}, "model_type 'llama'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope scaling 'yarn'"),
    ({"rope_parameters": None}, "rope_theta"),
    ({"attention_bias": True}, "attention bias"),
    ({"use_sliding_window": True}, "sliding-window"),
])
def test_config_json_the_model_would_compute_differently_is_refused(change, match):
    base = {**QWEN3_JSON, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    with pytest.raises(bm.UnsupportedModel, match=match):
        bm.MegatronModelConfig.from_hf_config({**base, **change})


@pytest.mark.parametrize(("layout", "ok", "match"), [
    ((1, 1, 1, False), True, ""),
    ((8, 1, 1, True), True, ""),
    ((2, 2, 1, True), False, "pipeline parallelism 2 is not supported"),
    ((2, 1, 2, True), False, "context parallelism 2 is not supported"),
    ((1, 1, 1, True), False, "sequence parallelism needs tensor parallelism > 1"),
    ((0, 1, 1, False), False, ">= 1"),
])
def test_parallelism_support_rule(layout, ok, match):
    verdict = ms.parallelism_support(*layout)
    assert verdict.ok is ok and match in verdict.reason


def test_unsupported_layouts_are_refused_before_anything_is_built():
    """Pipeline / context parallelism used to be accepted and then fail (or silently not split the
    sequence) at run time; a TP that does not divide the shapes is refused with the sizes named."""
    for change, match in (({"pipeline_parallel": 2}, "pipeline parallelism 2"), ({"context_parallel": 2}, "context parallelism 2"),
                          ({"tensor_parallel": 3}, "num_attention_heads=4, num_key_value_heads=2")):
        cfg = bm.MegatronModelConfig(**{**CFG.__dict__, **change})
        with pytest.raises(bm.UnsupportedModel, match=match):
            bm.MegatronBackend(cfg, ObjectiveConfig())


# ---------------------------------------------------------------------------------------------
# The megatron CPU tier (real megatron-core 0.19.2 under .venv312)

REPO = Path(__file__).resolve().parents[2]
CHECKS = [
    *(f"{kind}[{variant}]" for variant in ("qwen3_head_dim_rope_parameters", "qwen3_rope_theta", "qwen3_tied")
      for kind in ("logits_match_transformers", "hf_export_roundtrip_tp1", "tp2_logits_equal_tp1", "hf_export_roundtrip_tp2",
                   "publish_version_0_nvfp4")),
    "publish_version_0_nvfp4_bf16[qwen3_tied]",
    "odd_seq_sequence_parallel_tp2_equals_tp1",
    "restore_then_step_equals_uninterrupted_all_ranks",
    "tp2_dp2_step_equals_single_process",
    "tp2_dp2_restore_then_step_equals_uninterrupted_all_ranks",
    "token_budget_micro_batches_equal_one_micro_batch",
    "activation_checkpointing_step_equals_plain",
]


@pytest.fixture(scope="module")
def megatron_cpu_tier(tmp_path_factory) -> dict:
    python = REPO / ".venv312" / "bin" / "python"
    assert python.exists(), "the megatron CPU tier needs .venv312: run scripts/bootstrap"
    out = tmp_path_factory.mktemp("megatron") / "checks.json"
    proc = subprocess.run([str(python), str(Path(__file__).with_name("megatron_cpu_checks.py")), str(out)],
                          cwd=out.parent, capture_output=True, text=True, timeout=540)
    assert out.exists(), f"megatron_cpu_checks.py wrote no result (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    result = json.loads(out.read_text())
    sys.stderr.write(f"megatron CPU tier: {result['wall_s']:.1f} s\n")
    return result


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKS)
def test_megatron_cpu_tier(megatron_cpu_tier, name):
    """Logits of the GPTModel our backend builds equal transformers' Qwen3 (fp32, 1e-5) for QK-norm +
    custom head_dim, both rope forms and tied embeddings; TP=2 equals TP=1; HF -> megatron -> HF is
    bit-exact at TP 1 and 2; version 0 of a bf16 + nvfp4 channel is published from the backend (the
    path `rlfleet trainer run` takes before step 1), each quantized linear's input_scale from the
    activation amax transformers' Qwen3 gives with the exported weights (exact; fp32, and bf16); an
    odd sequence length under TP=2 sequence parallel gives the TP=1 loss; restore + one step is
    bit-equal to the uninterrupted run on every rank, Adam moments included (TP=2, and TP=2 x DP=2
    with the optimizer state sharded over the replicas); TP=2 x DP=2 gives the single process's
    update, and rank 0 reports the whole batch's loss and metrics."""
    check = megatron_cpu_tier["checks"][name]
    assert check["ok"], check


@pytest.mark.slow
def test_megatron_cpu_tier_thresholds_are_tight(megatron_cpu_tier):
    checks = megatron_cpu_tier["checks"]
    for name in CHECKS:
        if name.startswith(("logits_match", "tp2_logits")):
            assert checks[name]["max_abs_diff"] <= 1e-5, name
    assert checks["odd_seq_sequence_parallel_tp2_equals_tp1"]["seq_len"] % 2 == 1
    for name in ("restore_then_step_equals_uninterrupted_all_ranks", "tp2_dp2_restore_then_step_equals_uninterrupted_all_ranks"):
        ranks = checks[name]["per_rank"]
        assert len(ranks) == (2 if name.startswith("restore") else 4)
        assert all(r["adam_moment_tensors"] > 0 and r["model_tensors_changed_by_restore"] > 0 for r in ranks)
    assert checks["tp2_dp2_step_equals_single_process"]["num_valid_tokens"] == 28  # the whole batch, not a replica's half
    budget = checks["token_budget_micro_batches_equal_one_micro_batch"]
    assert budget["tokens"] == 41  # sum(RAGGED) - 7
    # packed THD rows at the budget of 14 (RAGGED through each last sampled token: 11, 2, 8, 4, 6, 1, 9),
    # first-fit decreasing: 11+2+1 | 9+4 | 8+6; each row's attention called once per layer (2 layers)
    assert sorted(map(tuple, budget["packed_rows"])) == sorted([(11, 2, 1)] * 2 + [(9, 4)] * 2 + [(8, 6)] * 2)
    for name in CHECKS:
        if name.startswith("publish_version_0"):  # every linear of the 2 layers quantized, amax not degenerate
            check = checks[name]
            assert check["version"] == 0 and check["quantized"] == check["linears"] == 14, name
            assert 0.0 < check["amax_range"][0] < check["amax_range"][1], name
    assert checks["publish_version_0_nvfp4_bf16[qwen3_tied]"]["dtype"] == "bfloat16"
