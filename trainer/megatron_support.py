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
Model shapes must divide by TP: attention heads, query groups (KV heads), the FFN width and the
vocabulary (the vocabulary-parallel loss takes each rank's V/TP columns; megatron does not pad it).
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
        return Support(False, f"pipeline parallelism {pp} is not supported by the megatron backend (pipeline must be 1): "
                              "HF weight loading, publishing and the command loop assume a single stage")
    if cp != 1:
        return Support(False, f"context parallelism {cp} is not supported by the megatron backend (context must be 1): "
                              "the objective's token rows are not re-addressed into per-rank sequence chunks")
    if sequence_parallel and tp == 1:
        return Support(False, "sequence parallelism needs tensor parallelism > 1")
    return Support(True)


def shape_support(tp: int, *, num_attention_heads: int, num_query_groups: int, ffn_hidden_size: int,
                  vocab_size: int) -> Support:
    """Whether the model's shapes split evenly over `tp` tensor-parallel ranks."""
    sizes = {"num_attention_heads": num_attention_heads, "num_key_value_heads": num_query_groups,
             "intermediate_size": ffn_hidden_size, "vocab_size": vocab_size}
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tp]
    if bad:
        return Support(False, f"tensor parallelism {tp} must divide {', '.join(bad)}")
    return Support(True)
