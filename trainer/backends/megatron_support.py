"""Which parallel layouts the `megatron` trainer backend supports, and why the others are refused.

Pure (no megatron, no torch): the backend calls it before it builds anything, and the rule is stated
here once so the RLJob admission rule can mirror it (docs/architecture.md, "Megatron backend").

Supported: tensor parallel TP >= 1 (sequence parallel on exactly when TP > 1), pipeline PP = 1,
context parallel CP = 1. Refused, with the reason:
- PP > 1: loading the HF checkpoint, publishing HF-named weights and the rank-0-drives command loop
  all assume every rank holds every layer (one stage); a per-stage mapping is not written.
- CP > 1: megatron's local (non-TransformerEngine) attention refuses context parallelism, and the
  objective's rows (sequence, position) would have to be re-addressed into each rank's load-balanced
  2*CP chunks with the token counts reduced over the CP group; neither is implemented or tested.
- sequence parallel with TP = 1: megatron-core refuses it (nothing to split the sequence over).
Model shapes must divide by TP: attention heads, query groups (KV heads), the FFN width (a mixture of
experts': each expert's, split over TP as megatron's expert tensor parallelism defaults to) and the
vocabulary (the vocabulary-parallel loss takes each rank's V/TP columns; megatron does not pad it).
Expert parallelism EP (a Qwen3-MoE): EP must divide the number of experts (each rank holds E/EP
experts), expert tensor parallelism ETP (each expert's width split; default TP, as megatron's) must
divide `moe_intermediate_size`; EP > 1 or ETP != TP on a dense model is refused (no experts). The
world size must be a multiple of TP and of ETP x EP (megatron's expert grid): checked where the
world size is known.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Support:
    ok: bool
    reason: str = ""


def parallelism_support(tp: int, pp: int, cp: int, sequence_parallel: bool) -> Support:
    """Whether the megatron backend runs this (tensor, pipeline, context, sequence-parallel) layout."""
    if min(tp, pp, cp) < 1:
        return Support(False, f"parallel sizes must be >= 1 (tensor={tp}, pipeline={pp}, context={cp})")
    if pp != 1:
        return Support(
            False,
            f"pipeline parallelism {pp} is not supported by the megatron backend (pipeline must be 1): "
            "HF weight loading, publishing and the command loop assume a single stage",
        )
    if cp != 1:
        return Support(
            False,
            f"context parallelism {cp} is not supported by the megatron backend (context must be 1): "
            "the objective's token rows are not re-addressed into per-rank sequence chunks",
        )
    if sequence_parallel and tp == 1:
        return Support(False, "sequence parallelism needs tensor parallelism > 1")
    return Support(True)


def shape_support(
    tp: int,
    *,
    num_attention_heads: int,
    num_query_groups: int,
    ffn_hidden_size: int,
    vocab_size: int,
    moe_ffn_hidden_size: int | None = None,
    expert_tp: int = 1,
) -> Support:
    """Whether the model's shapes split evenly over `tp` tensor-parallel ranks, and a mixture of
    experts' expert width (`moe_ffn_hidden_size`, config.json `moe_intermediate_size`; its layers have
    no dense MLP) over `expert_tp` expert-tensor-parallel ranks."""
    sizes = {
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_query_groups,
        "vocab_size": vocab_size,
    }
    if moe_ffn_hidden_size is None:
        sizes["intermediate_size"] = ffn_hidden_size
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tp]
    if bad:
        return Support(False, f"tensor parallelism {tp} must divide {', '.join(bad)}")
    if moe_ffn_hidden_size is not None and moe_ffn_hidden_size % expert_tp:
        return Support(
            False,
            f"expert tensor parallelism {expert_tp} must divide moe_intermediate_size={moe_ffn_hidden_size}",
        )
    return Support(True)


def expert_support(
    ep: int, *, num_experts: int | None, topk: int, expert_tp: int = 1, tp: int = 1
) -> Support:
    """Whether `ep` expert-parallel ranks (each expert over `expert_tp` ranks) can split the model's
    experts (None: a dense model)."""
    if ep < 1 or expert_tp < 1:
        return Support(
            False, f"expert parallelism and expert tensor parallelism must be >= 1, got {ep} and {expert_tp}"
        )
    if num_experts is None:
        if ep != 1 or expert_tp != tp:
            return Support(
                False,
                f"expert parallelism {ep} / expert tensor parallelism {expert_tp} need a mixture of experts "
                "(the model is dense)",
            )
        return Support(True)
    if not 1 <= topk <= num_experts:
        return Support(False, f"num_experts_per_tok {topk} must be in [1, num_experts={num_experts}]")
    if num_experts % ep:
        return Support(False, f"expert parallelism {ep} must divide num_experts={num_experts}")
    return Support(True)


def world_support(world: int, *, tp: int, ep: int, expert_tp: int | None = None) -> Support:
    """Whether `world` ranks hold whole model replicas (TP) and whole expert grids (expert TP x EP;
    expert TP None: TP, megatron's default)."""
    etp = tp if expert_tp is None else expert_tp
    if world % tp:
        return Support(False, f"world size {world} must be a multiple of tensor parallelism {tp}")
    if world % (etp * ep):
        return Support(
            False,
            f"world size {world} must be a multiple of expert tensor x expert parallelism "
            f"({etp} x {ep} = {etp * ep})",
        )
    return Support(True)
