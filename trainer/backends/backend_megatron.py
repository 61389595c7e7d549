"""The `megatron` backend: megatron-core (0.19) GPTModel, its schedules and the distributed optimizer,
with the vocab-parallel corrected objective. Runs on CUDA GPUs, or on CPU (device "cpu", gloo, fp32,
local layer spec, the shims of trainer/backends/megatron_cpu.py) for a trainer on a CPU class; megatron is
imported lazily so this module imports (and its pure parts are tested) anywhere. The CPU tier
(docs/testing.md) runs it for real on CPU against transformers' Qwen3.

How a step runs (documented megatron-core API, nothing private):
- `MegatronModelConfig.from_hf_config(config.json)`: Qwen3 dense. `head_dim` -> `kv_channels`,
  `tie_word_embeddings` -> `share_embeddings_and_output_weights`, QK-norm (`qk_layernorm` in BOTH the
  TransformerConfig and the layer spec), rope theta from `rope_theta` (transformers 4) or
  `rope_parameters` (transformers 5), dropout 0 (megatron defaults to 0.1). Layouts outside
  `megatron_support.parallelism_support` (PP > 1, CP > 1) are refused before anything is built.
- Qwen3-MoE (`model_type: qwen3_moe`): every layer's MLP is megatron-core's MoELayer (TopKRouter,
  SequentialMLP experts, alltoall token dispatcher, no shared expert), routing as Qwen3-MoE's router
  (`_moe_config`), transformers' load-balancing loss (trainer/backends/megatron_moe.py) when the config sets
  `output_router_logits`; expert parallelism EP splits the experts over ranks (`expert_parallel`).
- `parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=1, expert_model_parallel_size=ep)`
  once, under torchrun.
- `GPTModel(config=TransformerConfig(...), transformer_layer_spec=..., vocab_size, max_sequence_length,
  pre_process, post_process, parallel_output=True, share_embeddings_and_output_weights=tied,
  position_embedding_type="rope")`, wrapped in `DistributedDataParallel`; optimizer from
  `get_megatron_optimizer(OptimizerConfig(...), [model])` (distributed optimizer). Layer spec: the
  TransformerEngine spec when TE is installed (the GPU image), else the local spec with
  `LocalRMSNorm` (torch's RMSNorm that also runs under sequence parallelism).
- Rank 0 drives the rollouts and the loop; every other rank runs `follow()`, executing the commands
  rank 0 broadcasts (`step` with the batch, `weights`, `state`, `load`, `stop`). Each data-parallel
  rank takes its share of the batch's sequences (b % dp) and packs it into micro-batches of at most
  `max_tokens_per_micro_batch` tokens (trainer/rollout/batching.py `plan_micro_batches`, first-fit
  decreasing, every sequence cut after its last sampled token; one longer than the budget trains
  alone): one row of sequences back to back, no padding, in megatron-core's THD layout
  (`PackedSeqParams` with the cumulative lengths: rotary positions restart at each sequence,
  attention stays within each). TransformerEngine's attention takes THD natively; the local spec's
  core attention is trainer/backends/megatron_packed.py `PackedDotProductAttention` (megatron's own refuses
  THD). The loss and metrics rank 0 returns are merged over all micro-batches and data-parallel
  replicas (backend_common `merge_loss_outputs`).
- Sequence parallelism is on when TP > 1; it needs T % TP == 0, so a packed row is right-padded to a
  multiple of TP by a last sequence of padding tokens that no loss row reads.
- `activation_checkpointing`: TransformerConfig recompute_granularity "full", method "uniform", one
  layer per checkpoint: each layer keeps its input only and is recomputed in backward.
- `get_forward_backward_func()(forward_step_func=..., data_iterator=..., model=[model],
  num_microbatches=n, seq_length=S, micro_batch_size=m, forward_only=False)`.
  `forward_step_func(data_iterator, model) -> (hidden, partial(loss_func, micro_batch))`: the output
  layer's forward is replaced (`_output_layer_input`) by its input mapping without the matmul, so
  with labels=None GPTModel returns the final hidden states [b, s, H] (gathered from the
  sequence-parallel region) instead of logits.
  `loss_func(micro_batch, hidden) -> (loss_sum, num_valid_tokens, log_dict)`: the hidden states of the
  sampled tokens' rows and this rank's vocabulary shard of the output weight ->
  `policy_loss(rows, weight, batch, cfg, process_group=tp_group, temperature)` (the fused lm_head:
  logits made tile by tile, the max / sum-exp / target logits all-reduced over the TP group; no
  [T, V] tensor and no gathered vocabulary).
  `TransformerConfig.calculate_per_token_loss=True` + `finalize_model_grads` make the gradient a
  token mean over the WHOLE batch (all micro-batches, all DP ranks), as method.md prescribes.
- `optimizer.step() -> (ok, grad_norm, num_zeros)` (clipping inside, `OptimizerConfig.clip_grad`).
- Publishing: only the TP group of rank 0 (data-parallel rank 0) sends its shards to rank 0 (gather,
  not all-gather); rank 0 merges them and renames to Hugging Face names (`megatron_to_hf`), the same
  names transformers and SGLang use, so the weight publisher makes every view from them.
- Checkpoints: `state_dict()` on rank 0 gathers every rank's model shard, optimizer state_dict and
  the distributed optimizer's parameter state (`save_parameter_state`: fp32 main params and Adam
  moments, which its state_dict leaves out); `load_state_dict` scatters them back, loads the model,
  `reload_model_params()` (main params from the restored model), the optimizer state and
  `load_parameter_state`. Same parallel layout only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlfleet.api.rljob import MAX_TOKENS_PER_MICRO_BATCH
from rlfleet.trainer.backends.backend_common import (
    OptimConfig,
    RankCommands,
    add_routing_metrics,
    merge_loss_outputs,
    routing_compared_rows,
    to_token_batch,
    trainer_experts,
)
from rlfleet.trainer.backends.megatron_support import (
    expert_support,
    parallelism_support,
    shape_support,
    world_support,
)
from rlfleet.trainer.objective import LossOutput, ObjectiveConfig, TokenBatch, policy_loss
from rlfleet.trainer.publish.checkpoint import load_checkpoint_file
from rlfleet.trainer.rollout.batching import FlatBatch, MicroBatch, plan_micro_batches

if TYPE_CHECKING:
    from rlfleet.trainer.backends.megatron_moe import RouterAuxLoss, RouterLogits


class BackendUnavailable(RuntimeError):
    """megatron-core or CUDA is missing (clear message, raised at construction)."""


class UnsupportedModel(ValueError):
    """The checkpoint's config.json or the parallel layout is one the backend does not run."""


@dataclass
class MegatronModelConfig:
    vocab_size: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    max_seq_len: int
    rotary_base: float = 10000.0
    norm_eps: float = 1e-6
    kv_channels: int | None = None  # config.json `head_dim`; None: hidden_size // num_attention_heads
    qk_layernorm: bool = False  # Qwen3: RMSNorm of each head's q and k before RoPE
    tie_word_embeddings: bool = False  # -> share_embeddings_and_output_weights (no lm_head tensor)
    # Qwen3-MoE (config.json `num_experts` ...): every layer's MLP is `num_experts` routed SwiGLU experts
    # of width `moe_ffn_hidden_size`, each token using its top `moe_router_topk`; no shared expert
    num_experts: int | None = None
    moe_router_topk: int = 1  # num_experts_per_tok
    moe_ffn_hidden_size: int | None = None  # moe_intermediate_size
    norm_topk_prob: bool = (
        False  # renormalise the top-k routing weights to sum to 1 (Qwen3-MoE's norm_topk_prob)
    )
    router_aux_loss_coef: float = (
        0.0  # config.json router_aux_loss_coef when it sets output_router_logits, else 0
    )
    expert_parallel: int = 1  # experts split over this many ranks (megatron's expert_model_parallel_size)
    expert_tensor_parallel: int | None = (
        None  # each expert split over this many ranks; None: TP (megatron's default)
    )
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    max_tokens_per_micro_batch: int = (
        MAX_TOKENS_PER_MICRO_BATCH  # padded tokens per micro-batch (RLJob trainer.maxTokensPerMicroBatch)
    )
    activation_checkpointing: bool = (
        False  # recompute every layer in backward (megatron's full, uniform recompute)
    )
    seed: int = 0
    params_dtype: str = "bfloat16"  # the trainer's precision; "float32" in the CPU parity tier
    device: str = "cuda"  # "cpu": a CPU class or the CPU test tier (gloo, local layer spec, trainer/backends/megatron_cpu.py shims)

    @property
    def head_dim(self) -> int:
        return (
            self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads
        )

    @property
    def sequence_parallel(self) -> bool:
        return self.tensor_parallel > 1

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def expert_tp(self) -> int:
        return self.tensor_parallel if self.expert_tensor_parallel is None else self.expert_tensor_parallel

    @classmethod
    def from_hf_config(
        cls,
        hf: dict[str, Any],
        *,
        max_seq_len: int | None = None,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        context_parallel: int = 1,
        **kwargs: Any,
    ) -> MegatronModelConfig:
        """The model of a Hugging Face config.json (Qwen3 dense, or Qwen3-MoE), written by transformers 4
        (`rope_theta`) or 5 (`rope_parameters`). Anything the megatron model would compute differently is
        refused."""
        model_type = hf.get("model_type")
        if model_type not in ("qwen3", "qwen3_moe"):
            raise UnsupportedModel(
                f"megatron backend: model_type {model_type!r} is not supported (only 'qwen3' and 'qwen3_moe')"
            )
        rope = hf.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default" or hf.get("rope_scaling"):
            raise UnsupportedModel(
                f"megatron backend: rope scaling {rope_type!r} / {hf.get('rope_scaling')!r} is not supported"
            )
        theta = rope.get("rope_theta", hf.get("rope_theta"))
        if theta is None:
            raise UnsupportedModel(
                "megatron backend: config.json has neither rope_parameters.rope_theta nor rope_theta"
            )
        if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias", False):
            raise UnsupportedModel(
                "megatron backend: only hidden_act 'silu' without attention bias is supported"
            )
        if hf.get("use_sliding_window", False):
            raise UnsupportedModel("megatron backend: sliding-window attention is not supported")
        moe: dict[str, Any] = {}
        if model_type == "qwen3_moe":
            if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
                raise UnsupportedModel(
                    "megatron backend: Qwen3-MoE with dense MLP layers among the expert layers (mlp_only_layers "
                    f"{hf.get('mlp_only_layers')!r}, decoder_sparse_step {hf.get('decoder_sparse_step', 1)!r}) is not "
                    "supported: every layer must be a mixture of experts"
                )
            experts = hf.get(
                "num_experts", hf.get("num_local_experts")
            )  # transformers 5 writes num_local_experts
            if experts is None:
                raise UnsupportedModel(
                    "megatron backend: qwen3_moe config.json has neither num_experts nor num_local_experts"
                )
            moe = dict(
                num_experts=int(experts),
                moe_router_topk=hf["num_experts_per_tok"],
                moe_ffn_hidden_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                # transformers adds the load-balancing loss only when the config asks for router logits
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001))
                if hf.get("output_router_logits")
                else 0.0,
            )
        return cls(
            vocab_size=hf["vocab_size"],
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            num_attention_heads=hf["num_attention_heads"],
            num_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            ffn_hidden_size=hf["intermediate_size"],
            max_seq_len=max_seq_len or hf.get("max_position_embeddings", 4096),
            rotary_base=float(theta),
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            kv_channels=hf.get("head_dim"),
            qk_layernorm=True,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            tensor_parallel=tensor_parallel,
            pipeline_parallel=pipeline_parallel,
            context_parallel=context_parallel,
            **moe,
            **kwargs,
        )

    def check_supported(self) -> None:
        """Raise `UnsupportedModel` (with the reason) for a layout or shape the backend does not run."""
        for verdict in (
            parallelism_support(
                self.tensor_parallel, self.pipeline_parallel, self.context_parallel, self.sequence_parallel
            ),
            shape_support(
                self.tensor_parallel,
                num_attention_heads=self.num_attention_heads,
                num_query_groups=self.num_query_groups,
                ffn_hidden_size=self.ffn_hidden_size,
                vocab_size=self.vocab_size,
                moe_ffn_hidden_size=self.moe_ffn_hidden_size,
                expert_tp=self.expert_tp,
            ),
            expert_support(
                self.expert_parallel,
                num_experts=self.num_experts,
                topk=self.moe_router_topk,
                expert_tp=self.expert_tp,
                tp=self.tensor_parallel,
            ),
        ):
            if not verdict.ok:
                raise UnsupportedModel(f"megatron backend: {verdict.reason}")


# ---------------------------------------------------------------------------------------------
# Pure name/layout conversion between Megatron (fused qkv, fused gate/up) and Hugging Face names.
# Tested on CPU against the real megatron-core GPTModel and transformers' Qwen3 (docs/testing.md);
# used to initialise Megatron from an HF checkpoint and to publish HF-named weights.


_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def expert_index(name: str) -> int | None:
    """The expert a Megatron MoE tensor belongs to (`...mlp.experts.local_experts.{e}...`), else None."""
    found = _LOCAL_EXPERT.search(name)
    return int(found.group(1)) if found else None


def with_expert_index(name: str, expert: int) -> str:
    """`name` with its expert index replaced: a rank's local expert j is global expert
    ep_rank x (E / EP) + j (megatron's contiguous split of the experts over the EP ranks)."""
    return _LOCAL_EXPERT.sub(f".mlp.experts.local_experts.{expert}.", name, count=1)


def hf_to_megatron(
    hf: dict[str, torch.Tensor], cfg: MegatronModelConfig, te_spec: bool = True
) -> dict[str, torch.Tensor]:
    """Full (unsharded) HF state dict -> full Megatron state dict (GPTModel names; a MoE's experts by
    their global index). A Qwen3-MoE's experts may come as checkpoints name them
    (`mlp.experts.{e}.{gate,up,down}_proj.weight`) or fused as transformers 5 keeps them in memory
    (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I])."""
    from rlfleet.numerics.views import checkpoint_tensors

    hf = checkpoint_tensors(hf) if cfg.is_moe else hf
    out: dict[str, torch.Tensor] = {}
    hd, ng = cfg.head_dim, cfg.num_query_groups
    q_per_g = cfg.num_attention_heads // ng
    out["embedding.word_embeddings.weight"] = hf["model.embed_tokens.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        m = f"decoder.layers.{i}."
        q = hf[p + "self_attn.q_proj.weight"].view(ng, q_per_g * hd, -1)
        k = hf[p + "self_attn.k_proj.weight"].view(ng, hd, -1)
        v = hf[p + "self_attn.v_proj.weight"].view(ng, hd, -1)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, cfg.hidden_size)
        out[m + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        if cfg.qk_layernorm:
            out[m + "self_attention.q_layernorm.weight"] = hf[p + "self_attn.q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[p + "self_attn.k_norm.weight"]
        if cfg.num_experts is not None:  # the router (Qwen3-MoE's `gate`) and each expert's fused gate/up
            out[m + "mlp.router.weight"] = hf[p + "mlp.gate.weight"]
            for e in range(cfg.num_experts):
                x, y = f"{p}mlp.experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
                out[y + "linear_fc1.weight"] = torch.cat(
                    [hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]], dim=0
                )
                out[y + "linear_fc2.weight"] = hf[x + "down_proj.weight"]
        else:
            out[m + "mlp.linear_fc1.weight"] = torch.cat(
                [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0
            )
            out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
        if (
            te_spec
        ):  # TransformerEngine fuses the pre-norms into the following linear (a MoE's has its own norm)
            out[m + "self_attention.linear_qkv.layer_norm_weight"] = hf[p + "input_layernorm.weight"]
        else:
            out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        if te_spec and not cfg.is_moe:
            out[m + "mlp.linear_fc1.layer_norm_weight"] = hf[p + "post_attention_layernorm.weight"]
        else:
            out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not cfg.tie_word_embeddings:  # tied: the output layer reads the embedding (no tensor of its own)
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], cfg: MegatronModelConfig) -> dict[str, torch.Tensor]:
    """Full (unsharded) Megatron state dict -> HF names (inverse of `hf_to_megatron`, either spec; a
    MoE's experts under the checkpoint names `mlp.experts.{e}.{gate,up,down}_proj.weight`)."""
    out: dict[str, torch.Tensor] = {}
    hd, ng = cfg.head_dim, cfg.num_query_groups
    q_per_g = cfg.num_attention_heads // ng
    out["model.embed_tokens.weight"] = mg["embedding.word_embeddings.weight"][: cfg.vocab_size]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        m = f"decoder.layers.{i}."
        qkv = mg[m + "self_attention.linear_qkv.weight"].view(ng, (q_per_g + 2) * hd, -1)
        q, k, v = qkv.split([q_per_g * hd, hd, hd], dim=1)
        out[p + "self_attn.q_proj.weight"] = q.reshape(-1, cfg.hidden_size)
        out[p + "self_attn.k_proj.weight"] = k.reshape(-1, cfg.hidden_size)
        out[p + "self_attn.v_proj.weight"] = v.reshape(-1, cfg.hidden_size)
        out[p + "self_attn.o_proj.weight"] = mg[m + "self_attention.linear_proj.weight"]
        if cfg.qk_layernorm:
            out[p + "self_attn.q_norm.weight"] = mg[m + "self_attention.q_layernorm.weight"]
            out[p + "self_attn.k_norm.weight"] = mg[m + "self_attention.k_layernorm.weight"]
        if cfg.num_experts is not None:
            out[p + "mlp.gate.weight"] = mg[m + "mlp.router.weight"]
            for e in range(cfg.num_experts):
                x, y = f"{p}mlp.experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
                out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = mg[y + "linear_fc1.weight"].chunk(
                    2, dim=0
                )
                out[x + "down_proj.weight"] = mg[y + "linear_fc2.weight"]
        else:
            gate, up = mg[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
            out[p + "mlp.down_proj.weight"] = mg[m + "mlp.linear_fc2.weight"]
        te = m + "self_attention.linear_qkv.layer_norm_weight"
        out[p + "input_layernorm.weight"] = mg[te] if te in mg else mg[m + "input_layernorm.weight"]
        te = m + "mlp.linear_fc1.layer_norm_weight"
        out[p + "post_attention_layernorm.weight"] = (
            mg[te] if te in mg else mg[m + "pre_mlp_layernorm.weight"]
        )
    out["model.norm.weight"] = mg["decoder.final_layernorm.weight"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = mg["output_layer.weight"][: cfg.vocab_size]
    return out


# How each Megatron tensor is split over tensor-parallel ranks: dim 0 (column parallel), dim 1 (row
# parallel) or replicated. linear_fc1 is column parallel over the FUSED [gate; up]: each rank holds
# [gate_r; up_r], so gathering must un-fuse per rank first.
def tp_split_dim(name: str) -> int | None:
    if name.endswith(
        ("linear_qkv.weight", "output_layer.weight", "word_embeddings.weight", "linear_fc1.weight")
    ):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def merge_tp_shards(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Rank-ordered TP shards of one tensor -> the full tensor."""
    dim = tp_split_dim(name)
    if dim is None:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards), strict=True)
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(shards, dim=dim)


def split_tp_shard(name: str, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The rank's shard of a full tensor (inverse of `merge_tp_shards`)."""
    dim = tp_split_dim(name)
    if dim is None:
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(world, dim=0)[rank], up.chunk(world, dim=0)[rank]], dim=0)
    return full.chunk(world, dim=dim)[rank]


def _output_layer_input(
    layer: Any, input_: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None, **_: Any
) -> tuple[torch.Tensor, None]:
    """Stands in for the output layer's (ColumnParallelLinear) forward: its input as the layer would
    feed it to its matmul, without the matmul. Gathered from the sequence-parallel region, or copied
    into the tensor-parallel region: the same collectives the layer runs, so in backward the hidden
    states' gradient (each TP rank's partial sum over its vocabulary shard) is reduce-scattered or
    all-reduced over the TP group, as the layer's would be. GPTModel then returns these hidden
    states [b, s, H] where it returned the logits."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if layer.sequence_parallel:
        return gather_from_sequence_parallel_region(
            input_, tensor_parallel_output_grad=True, group=layer.tp_group
        ), None
    return copy_to_tensor_model_parallel_region(input_, group=layer.tp_group), None


def _round_up(n: int, multiple: int) -> int:
    return n + (-n % multiple)


@dataclass(frozen=True)
class PackedMicroBatch:
    """One micro-batch as the model and the loss take it: its sequences back to back in one row (THD),
    on the device."""

    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] restarting at 0 at each sequence
    packed_seq_params: Any  # megatron's PackedSeqParams: the cumulative lengths of the row's sequences
    row_index: torch.Tensor  # [R] position in the row of each loss row's logit
    batch: TokenBatch  # the R loss rows
    tokens: int  # T
    real_tokens: (
        int  # the first T - padding tokens: the sequences (the rest pads the row to a multiple of TP)
    )
    rows: np.ndarray  # the loss rows' indices in the FlatBatch
    compared: (
        np.ndarray | None
    )  # a MoE with the samplers' routing: which rows compare it (routing_compared_rows)

    def routed_here(self, tp: int, tp_rank: int) -> torch.Tensor:
        """[T / tp] bool: which tokens of this TP rank's slice of the row (sequence parallel: rank r
        routes the r-th contiguous slice) are not padding."""
        per_rank = self.tokens // tp
        return (
            torch.arange(tp_rank * per_rank, (tp_rank + 1) * per_rank, device=self.input_ids.device)
            < self.real_tokens
        )


# ---------------------------------------------------------------------------------------------
# The backend (GPU).


class LocalRMSNorm(torch.nn.RMSNorm):
    """The local (no TransformerEngine) spec's RMSNorm: torch's RMSNorm, as megatron's own
    WrappedTorchNorm builds it, that also runs under sequence parallelism. Like megatron's fused
    norms it marks its weight `sequence_parallel`, so `finalize_model_grads` sums the weight's
    gradient over the TP ranks, each of which saw only its slice of the sequence (WrappedTorchNorm
    refuses sequence parallelism instead)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        # megatron's own attribute on a parameter (finalize_model_grads reads it), unknown to torch's stubs
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]


def _megatron(allow_te: bool = True) -> Any:
    """megatron-core's pieces; `allow_te=False` (device "cpu") keeps the local layer spec even where
    TransformerEngine is installed (its kernels need CUDA)."""
    try:
        import megatron.core as mcore  # noqa: F401
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as exc:
        raise BackendUnavailable(
            "trainer backend 'megatron' needs megatron-core 0.19 (pip install 'rlfleet[trainer]' on Python >= 3.12) "
            f"and CUDA; import failed: {exc}"
        ) from None
    te = False
    if allow_te:
        try:
            import transformer_engine  # noqa: F401

            te = True
        except ImportError:  # no TransformerEngine: the local (pure PyTorch) spec
            te = False

    def layer_spec(qk_layernorm: bool, num_layers: int, num_experts: int | None = None) -> Any:
        # qk_layernorm must be set in the spec (q/k norm modules) AND in TransformerConfig. Experts:
        # megatron's SequentialMLP (one MLP per local expert, `local_experts.{j}`) on both specs, so
        # one weight mapping serves both (grouped GEMM would name them otherwise)
        if te:
            return get_gpt_layer_with_transformer_engine_spec(
                num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm
            )
        from rlfleet.trainer.backends.megatron_packed import PackedDotProductAttention

        layer = get_gpt_layer_local_spec(
            num_experts=num_experts,
            moe_grouped_gemm=False,
            qk_layernorm=qk_layernorm,
            normalization="RMSNorm",
        )
        layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = LocalRMSNorm
        layer.submodules.self_attention.submodules.core_attention = (
            PackedDotProductAttention  # the THD layout
        )
        if qk_layernorm:
            attn = layer.submodules.self_attention.submodules
            attn.q_layernorm = attn.k_layernorm = LocalRMSNorm
        return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=LocalRMSNorm)

    ns = dict(
        parallel_state=parallel_state,
        tensor_parallel=tensor_parallel,
        DDP=DistributedDataParallel,
        DDPConfig=DistributedDataParallelConfig,
        finalize_model_grads=finalize_model_grads,
        GPTModel=GPTModel,
        OptimizerConfig=OptimizerConfig,
        get_megatron_optimizer=get_megatron_optimizer,
        get_forward_backward_func=get_forward_backward_func,
        TransformerConfig=TransformerConfig,
        layer_spec=staticmethod(layer_spec),
        te=te,
    )
    return type("Megatron", (), ns)


_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _init_model_parallel(ps: Any, c: MegatronModelConfig) -> None:
    """megatron's parallel state for `c`'s layout, once per process (the world must hold whole TP x EP
    grids; a later backend in the process must use the same layout)."""
    verdict = world_support(
        torch.distributed.get_world_size(), tp=c.tensor_parallel, ep=c.expert_parallel, expert_tp=c.expert_tp
    )
    if not verdict.ok:
        raise UnsupportedModel(f"megatron backend: {verdict.reason}")
    if ps.model_parallel_is_initialized():  # an earlier backend in this process fixed the layout
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(),
        )
        if have != (c.tensor_parallel, c.expert_parallel, c.expert_tp):
            raise UnsupportedModel(
                f"megatron backend: this process's model parallel state is tensor x expert x expert-tensor "
                f"{have}, not {(c.tensor_parallel, c.expert_parallel, c.expert_tp)}: one layout per process"
            )
        return
    ps.initialize_model_parallel(
        tensor_model_parallel_size=c.tensor_parallel,
        pipeline_model_parallel_size=c.pipeline_parallel,
        context_parallel_size=c.context_parallel,
        expert_model_parallel_size=c.expert_parallel,
        expert_tensor_parallel_size=c.expert_tp,
    )


class MegatronBackend(RankCommands):
    """Same interface as HFBackend: train_step(flat, group_index) -> (LossOutput, grad_norm),
    weights() -> HF-named full state dict (on global rank 0; {} elsewhere), state_dict/load_state_dict
    (on global rank 0; they carry every rank's shard). Rank 0 drives, every other rank runs `follow()`
    (backend_common.RankCommands: the commands are broadcast from global rank 0)."""

    name = "megatron"

    def __init__(
        self,
        model_config: MegatronModelConfig,
        objective: ObjectiveConfig,
        optim: OptimConfig | None = None,
        temperature: float = 1.0,
        initial_hf_weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        model_config.check_supported()
        if model_config.device == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable(
                "trainer backend 'megatron' needs CUDA GPUs (use backend 'torch' on CPU)"
            )
        on_cpu = model_config.device == "cpu"
        mg = _megatron(allow_te=not on_cpu)
        if on_cpu:  # a CPU class (gloo): megatron-core's unconditional CUDA calls land on the CPU
            from rlfleet.trainer.backends.megatron_cpu import install_cpu_shims

            install_cpu_shims()
        self.mg = mg
        self.cfg = model_config
        self.device = torch.device(model_config.device)
        self.objective = objective
        self.optim_config = optim or OptimConfig()
        self.temperature = temperature
        on_gpu = self.device.type == "cuda"
        if not torch.distributed.is_initialized():  # torchrun sets RANK / WORLD_SIZE / MASTER_ADDR
            if on_gpu:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.distributed.init_process_group(backend="nccl" if on_gpu else "gloo")
        ps = mg.parallel_state
        _init_model_parallel(ps, model_config)
        if on_gpu:
            mg.tensor_parallel.model_parallel_cuda_manual_seed(model_config.seed)
        else:
            torch.manual_seed(model_config.seed)
        c = model_config
        dtype = _DTYPES[c.params_dtype]
        bf16 = dtype == torch.bfloat16
        self.tconfig = mg.TransformerConfig(
            num_layers=c.num_layers,
            hidden_size=c.hidden_size,
            num_attention_heads=c.num_attention_heads,
            num_query_groups=c.num_query_groups,
            ffn_hidden_size=c.ffn_hidden_size,
            kv_channels=c.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=c.norm_eps,
            qk_layernorm=c.qk_layernorm,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=False,
            hidden_dropout=0.0,  # megatron defaults to 0.1; Qwen3 trains without dropout
            attention_dropout=0.0,
            bf16=bf16,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            use_cpu_initialization=not on_gpu,
            tensor_model_parallel_size=c.tensor_parallel,
            pipeline_model_parallel_size=c.pipeline_parallel,
            context_parallel_size=c.context_parallel,
            sequence_parallel=c.sequence_parallel,
            calculate_per_token_loss=True,  # loss_func returns (sum, n_tokens): token mean over the batch
            **self._moe_config(),
            # activation checkpointing: keep each layer's input only and recompute the layer in backward
            **(
                dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
                if c.activation_checkpointing
                else {}
            ),
        )
        model = mg.GPTModel(
            config=self.tconfig,
            transformer_layer_spec=mg.layer_spec(c.qk_layernorm, c.num_layers, c.num_experts),
            vocab_size=c.vocab_size,
            max_sequence_length=c.max_seq_len,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            parallel_output=True,  # keep logits vocabulary-sharded: the objective is vocab-parallel
            share_embeddings_and_output_weights=c.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(c.rotary_base),
        ).to(self.device)
        if initial_hf_weights is not None:
            self._load_hf(model, initial_hf_weights)
        self.router_aux: RouterAuxLoss | None = None
        self.router_logits: RouterLogits | None = None
        if c.num_experts is not None:
            from rlfleet.trainer.backends.megatron_moe import RouterAuxLoss, RouterLogits, attach

            self.router_logits = RouterLogits()  # the routing mismatch against the samplers' experts
            if c.router_aux_loss_coef > 0:  # transformers' load-balancing loss
                self.router_aux = RouterAuxLoss(
                    c.router_aux_loss_coef,
                    c.num_experts,
                    c.moe_router_topk,
                    c.num_layers,
                    ps.get_tensor_model_parallel_group() if c.sequence_parallel else None,
                )
            observers = [o for o in (self.router_aux, self.router_logits) if o is not None]
            attach([layer.mlp.router for layer in model.decoder.layers], observers)
        if model.post_process:  # the objective projects to the vocabulary itself (the fused lm_head)
            model.output_layer.forward = partial(_output_layer_input, model.output_layer)
        ddp_config = mg.DDPConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        )
        self.model = mg.DDP(config=self.tconfig, ddp_config=ddp_config, module=model)
        self.tconfig.finalize_model_grads_func = mg.finalize_model_grads
        self.optimizer = mg.get_megatron_optimizer(
            mg.OptimizerConfig(
                optimizer="adam",
                lr=self.optim_config.learning_rate,
                weight_decay=self.optim_config.weight_decay,
                adam_beta1=self.optim_config.betas[0],
                adam_beta2=self.optim_config.betas[1],
                clip_grad=self.optim_config.max_grad_norm,
                bf16=bf16,
                params_dtype=dtype,
                use_distributed_optimizer=True,
            ),
            [self.model],
        )

    def _moe_config(self) -> dict[str, Any]:
        """TransformerConfig's mixture-of-experts fields (none for a dense model). Qwen3-MoE's router:
        softmax over all experts, top-k, renormalised when `norm_topk_prob`. megatron's TopKRouter with
        `moe_router_pre_softmax=False` takes the top-k logits and softmaxes them (= the renormalised
        top-k probabilities); with `pre_softmax=True` it softmaxes all, then takes the top k (not
        renormalised). megatron's own load-balancing loss is off (`load_balancing_type` "none"): it is
        per layer and its gradient is divided by the batch's token count under
        `calculate_per_token_loss`, not transformers' loss (see `_router_aux_loss`). Dispatcher:
        alltoall (runs on gloo with the CPU shims); dropless (no capacity factor), no shared expert."""
        c = self.cfg
        if c.num_experts is None:
            return {}
        return dict(
            num_moe_experts=c.num_experts,
            moe_router_topk=c.moe_router_topk,
            moe_ffn_hidden_size=c.moe_ffn_hidden_size,
            moe_router_pre_softmax=not c.norm_topk_prob,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            expert_model_parallel_size=c.expert_parallel,
            expert_tensor_parallel_size=c.expert_tp,
        )

    # -- helpers --
    def _ep(self) -> tuple[int, int]:
        """(expert-parallel rank, experts per rank); (0, E) without expert parallelism."""
        ps = self.mg.parallel_state
        experts = self.cfg.num_experts or 0
        return ps.get_expert_model_parallel_rank(), experts // self.cfg.expert_parallel

    def _tp(self) -> tuple[Any, int, int]:
        ps = self.mg.parallel_state
        return (
            ps.get_tensor_model_parallel_group(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
        )

    def _load_hf(self, model: torch.nn.Module, hf: dict[str, torch.Tensor]) -> None:
        _, rank, world = self._tp()
        full = hf_to_megatron(hf, self.cfg, te_spec=self.mg.te)
        own = {
            k: v
            for k, v in model.state_dict().items()
            if "_extra_state" not in k and isinstance(v, torch.Tensor)
        }
        if self.cfg.expert_parallel > 1:  # this rank's experts: local j is global ep_rank x E/EP + j
            ep_rank, per_rank = self._ep()
            full = {
                name: t
                for name, t in full.items()
                if (e := expert_index(name)) is None or e // per_rank == ep_rank
            }
            full = {
                (name if (e := expert_index(name)) is None else with_expert_index(name, e % per_rank)): t
                for name, t in full.items()
            }
        if set(own) != set(full):  # a name the mapping misses would silently stay at its random init
            raise UnsupportedModel(
                f"megatron backend: HF mapping mismatch: model only {sorted(set(own) - set(full))}, "
                f"mapping only {sorted(set(full) - set(own))}"
            )
        ps = self.mg.parallel_state
        expert_tp = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
        with torch.no_grad():
            for name, tensor in own.items():
                # experts split over megatron's expert-TP group (its size is TP; its members may differ)
                r, w = (rank, world) if expert_index(name) is None else expert_tp
                shard = split_tp_shard(name, full[name], r, w)
                if shard.shape != tensor.shape:
                    raise UnsupportedModel(
                        f"megatron backend: {name}: checkpoint shard {tuple(shard.shape)} != model {tuple(tensor.shape)}"
                    )
                tensor.copy_(shard.to(tensor.dtype))

    # -- the step --
    def train_step(self, flat: FlatBatch, group_index: dict[str, int]) -> tuple[LossOutput, float]:
        """Rank 0: broadcast the batch (it drives the rollouts), then train like every rank."""
        self._command(("step", flat, group_index))
        return self._train_step(flat, group_index)

    def _train_step(self, flat: FlatBatch, group_index: dict[str, int]) -> tuple[LossOutput, float]:
        mg, ps = self.mg, self.mg.parallel_state
        dp_rank, dp_world = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        my_seqs = np.arange(flat.input_ids.shape[0])[dp_rank::dp_world]
        full = to_token_batch(flat, group_index)
        tp = self.cfg.tensor_parallel if self.cfg.sequence_parallel else 1
        micro = self._micro_batches(flat, full, my_seqs, tp)
        tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
        outputs: list[LossOutput] = []

        module = self.model.module
        weight = (
            module.shared_embedding_or_output_weight()
            if self.cfg.tie_word_embeddings
            else module.output_layer.weight
        )

        def loss_func(
            mb: PackedMicroBatch, hidden: torch.Tensor
        ):  # hidden [1, T, H] (the output layer's input)
            rows = hidden[0, mb.row_index]
            batch = mb.batch
            # the fused lm_head: this rank's vocabulary shard of the output weight, logits made tile by tile
            out = policy_loss(
                rows, weight, batch, self.objective, process_group=tp_group, temperature=self.temperature
            )
            assert out.loss_sum is not None  # policy_loss always returns the sum
            if (
                self.router_aux is not None
            ):  # its gradient joins in backward; the reported loss is the policy loss
                self.router_aux.finish(out.num_valid_tokens)
            if mb.compared is not None:
                self._add_routing_metrics(out, flat, full, mb)
            outputs.append(replace(out, loss=out.loss.detach().cpu(), loss_sum=out.loss_sum.detach().cpu()))
            n = torch.tensor(out.num_valid_tokens, dtype=torch.int, device=rows.device)
            return out.loss_sum, n, {"loss_sum": out.loss_sum.detach(), "num_tokens": n}

        def forward_step_func(data_iterator, model):
            mb: PackedMicroBatch = next(data_iterator)
            self._start_routers(mb, tp, tp_rank)
            # causal within each sequence of the row (THD); returns the output layer's input
            hidden = model(
                mb.input_ids, mb.position_ids, attention_mask=None, packed_seq_params=mb.packed_seq_params
            )
            return hidden, partial(loss_func, mb)

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        mg.get_forward_backward_func()(
            forward_step_func=forward_step_func,
            data_iterator=iter(micro),
            model=[self.model],
            num_microbatches=len(micro),
            seq_length=max(
                mb.tokens for mb in micro
            ),  # shapes vary per micro-batch: no pipeline stages to size
            micro_batch_size=1,  # one packed row
            forward_only=False,
        )
        if self.router_aux is not None:
            self.router_aux.stop()
        _ok, grad_norm, _zeros = self.optimizer.step()
        # The loss and metrics of the WHOLE batch: every data-parallel replica trained on its share of
        # the sequences; rank 0 (data-parallel rank 0 of its group) merges them all.
        if dp_world > 1:
            group = ps.get_data_parallel_group()
            parts: list[Any] | None = [None] * dp_world if dp_rank == 0 else None
            torch.distributed.gather_object(
                outputs, parts, dst=torch.distributed.get_global_rank(group, 0), group=group
            )
            outputs = [o for part in parts for o in part] if parts is not None else outputs
        merged = merge_loss_outputs(outputs)
        return merged, float(grad_norm) if grad_norm is not None else float("nan")

    def _micro_batches(
        self, flat: FlatBatch, full: TokenBatch, my_seqs: np.ndarray, tp: int
    ) -> list[PackedMicroBatch]:
        """This data-parallel rank's sequences packed into micro-batches of the token budget."""
        plan = plan_micro_batches(flat, my_seqs, self.cfg.max_tokens_per_micro_batch)
        micro = [self._packed(flat, full, mb, tp) for mb in plan]
        empty = MicroBatch(my_seqs[:0], my_seqs[:0], np.zeros(0, dtype=np.int64))
        if not micro:  # no trained row on this data-parallel rank: an empty micro-batch keeps the schedule
            micro = [self._packed(flat, full, empty, tp)]
        if self.cfg.expert_parallel > 1:
            # every MoE layer's token dispatch is a collective over the expert-parallel ranks, which are
            # different data-parallel ranks: all run as many micro-batches (empty ones make up the count)
            count = torch.tensor([len(micro)], dtype=torch.int64, device=self.device)
            group = self.mg.parallel_state.get_data_parallel_group()
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=group)
            micro += [self._packed(flat, full, empty, tp) for _ in range(int(count.item()) - len(micro))]
        return micro

    def _start_routers(self, mb: PackedMicroBatch, tp: int, tp_rank: int) -> None:
        """A micro-batch's forward begins: the MoE routers' observers start on it (`tp`: the ranks a
        packed row is split over, 1 without sequence parallelism)."""
        if self.router_aux is not None:
            self.router_aux.start(mb.routed_here(tp, tp_rank))
        if self.router_logits is not None:
            self.router_logits.start(active=mb.compared is not None)

    def _add_routing_metrics(
        self, out: LossOutput, flat: FlatBatch, full: TokenBatch, mb: PackedMicroBatch
    ) -> None:
        """The routing mismatch of the micro-batch's compared rows, as the torch backend measures it: the
        trainer's experts are the top-k of each layer's router softmax at the row's position. Under
        sequence parallelism each TP rank routed its slice of the row: the logits are gathered first."""
        assert self.router_logits is not None and flat.routed_experts is not None and mb.compared is not None
        logits = self.router_logits.take()
        tp_group, _, tp_world = self._tp()
        if self.cfg.sequence_parallel and tp_world > 1:
            gathered = []
            for layer in logits:
                parts = [torch.empty_like(layer) for _ in range(tp_world)]
                torch.distributed.all_gather(parts, layer.contiguous(), group=tp_group)
                gathered.append(torch.cat(parts))
            logits = gathered
        trainer = trainer_experts(logits, mb.row_index, int(flat.routed_experts.shape[2]))
        add_routing_metrics(out, flat, full, mb.rows, trainer, mb.compared)

    def _packed(self, flat: FlatBatch, full: TokenBatch, mb: MicroBatch, tp: int) -> PackedMicroBatch:
        """`mb` as one packed row on the device. Under sequence parallelism the row is split over the TP
        ranks (T % TP == 0): a last sequence of padding tokens fills it up, read by no loss row."""
        from rlfleet.trainer.backends.megatron_packed import packed_seq_params

        if len(mb.seqs):
            input_ids, position_ids, row_index = mb.packed(flat)
        else:  # an empty micro-batch (no trained row on this data-parallel rank): padding only
            input_ids = position_ids = row_index = np.zeros(0, dtype=np.int64)
        lengths = mb.lengths.tolist()
        real_tokens = len(input_ids)
        pad = _round_up(max(len(input_ids), 1), tp) - len(input_ids)
        if pad:
            input_ids = np.concatenate([input_ids, np.zeros(pad, dtype=np.int64)])
            position_ids = np.concatenate([position_ids, np.arange(pad, dtype=np.int64)])
            lengths.append(pad)
        dev = self.device
        return PackedMicroBatch(
            input_ids=torch.from_numpy(input_ids).to(dev)[None],
            position_ids=torch.from_numpy(position_ids).to(dev)[None],
            packed_seq_params=packed_seq_params(lengths, dev),
            row_index=torch.from_numpy(row_index).to(dev),
            batch=full.select(torch.from_numpy(mb.rows)).to(dev),
            tokens=len(input_ids),
            real_tokens=real_tokens,
            rows=mb.rows,
            compared=routing_compared_rows(flat, mb.rows) if self.cfg.is_moe else None,
        )

    # -- publishing --
    def weights(self) -> dict[str, torch.Tensor]:
        """Rank 0: the TP group of rank 0 gathers its shards; returns HF-named weights."""
        self._command(("weights",))
        return self._weights()

    def _weights(self) -> dict[str, torch.Tensor]:
        """HF-named full weights on global rank 0 ({} elsewhere). Only the TP group holding rank 0
        (data-parallel rank 0) communicates: each of its ranks sends its shards to rank 0, nobody else
        materialises the whole model; the other data-parallel replicas hold the same weights and skip."""
        ps = self.mg.parallel_state
        experts = self._gathered_experts() if self.cfg.is_moe else {}
        if ps.get_data_parallel_rank() != 0:
            return {}
        group, tp_rank, world = self._tp()
        dst = torch.distributed.get_global_rank(group, 0) if world > 1 else torch.distributed.get_rank()
        full: dict[str, torch.Tensor] = {}
        for name, tensor in self.model.module.state_dict().items():
            if (
                "_extra_state" in name
                or not isinstance(tensor, torch.Tensor)
                or expert_index(name) is not None
            ):
                continue
            if world == 1:
                full[name] = tensor.detach().cpu().clone()
                continue
            shards = [torch.empty_like(tensor) for _ in range(world)] if tp_rank == 0 else None
            torch.distributed.gather(tensor.contiguous(), shards, dst=dst, group=group)
            if tp_rank == 0:
                assert shards is not None  # gathered on TP rank 0
                full[name] = merge_tp_shards(name, [s.cpu() for s in shards])
        if torch.distributed.get_rank() != 0:
            return {}
        return megatron_to_hf(full | experts, self.cfg)

    def _gathered_experts(self) -> dict[str, torch.Tensor]:
        """Every expert's full tensors on global rank 0 under their global index ({} elsewhere). The
        experts are split over the expert-parallel ranks (whole experts) and the expert-TP ranks (each
        expert's fc1 / fc2 like a dense MLP's); the ranks of expert-data-parallel rank 0 hold one copy
        of each shard, and send them to rank 0 (one gather over the world)."""
        ps = self.mg.parallel_state
        ep_rank, per_rank = self._ep()
        etp_rank = ps.get_expert_tensor_parallel_rank()
        mine: dict[str, tuple[int, torch.Tensor]] = {}
        if ps.get_expert_data_parallel_rank() == 0:
            for name, tensor in self.model.module.state_dict().items():
                local = (
                    expert_index(name)
                    if isinstance(tensor, torch.Tensor) and "_extra_state" not in name
                    else None
                )
                if local is not None:
                    mine[with_expert_index(name, ep_rank * per_rank + local)] = (
                        etp_rank,
                        tensor.detach().cpu().clone(),
                    )
        rank = torch.distributed.get_rank()
        parts: list[Any] | None = [None] * torch.distributed.get_world_size() if rank == 0 else None
        torch.distributed.gather_object(mine, parts, dst=0)
        if parts is None:
            return {}
        shards: dict[str, dict[int, torch.Tensor]] = {}
        for part in parts:
            for name, (r, tensor) in part.items():
                shards.setdefault(name, {})[r] = tensor
        return {
            name: merge_tp_shards(name, [by_rank[r] for r in sorted(by_rank)])
            for name, by_rank in shards.items()
        }

    # -- checkpoints: global rank 0 holds every rank's part (the loop saves one file from rank 0) --
    def _layout(self) -> dict[str, int]:
        ps = self.mg.parallel_state
        layout = {
            "world": torch.distributed.get_world_size(),
            "tp": self.cfg.tensor_parallel,
            "pp": self.cfg.pipeline_parallel,
            "cp": self.cfg.context_parallel,
            "dp": ps.get_data_parallel_world_size(),
        }
        if self.cfg.is_moe:  # a rank's `local_experts.{j}` are other experts under another EP (a dense layout has no such keys)
            layout |= {"ep": self.cfg.expert_parallel, "etp": self.cfg.expert_tp}
        return layout

    def state_dict(self) -> dict[str, Any]:
        """Rank 0: every rank's model shard, optimizer state and (on data-parallel rank 0 of each model
        shard) the distributed optimizer's parameter state: fp32 main params and Adam moments, which
        the DistributedOptimizer's own state_dict leaves out."""
        self._command(("state",))
        return self._state_dict()

    def _state_dict(self) -> dict[str, Any]:
        import tempfile

        model = {
            k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
            for k, v in self.model.state_dict().items()
        }
        with tempfile.TemporaryDirectory(prefix="rlfleet-mg-") as tmp:
            path = os.path.join(tmp, "param_state.pt")
            self.optimizer.save_parameter_state(path)  # collective over the DP group; writes on DP rank 0
            # weights only (trainer/publish/checkpoint.py, SAFE_GLOBALS): the same state is unpickled from the store on resume
            param_state = load_checkpoint_file(path) if os.path.exists(path) else None
        local = {"model": model, "optimizer": self.optimizer.state_dict(), "param_state": param_state}
        rank = torch.distributed.get_rank()
        parts: list[Any] | None = [None] * torch.distributed.get_world_size() if rank == 0 else None
        torch.distributed.gather_object(local, parts, dst=0)
        return {"layout": self._layout(), "ranks": parts} if rank == 0 else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Rank 0: restore every rank from `state_dict()`'s output (same parallel layout only)."""
        if state.get("layout") != self._layout():
            raise ValueError(
                f"megatron checkpoint layout {state.get('layout')} != this run's {self._layout()}: "
                "resharding a checkpoint is not supported"
            )
        self._command(("load",))
        self._load_state_dict(state["ranks"])

    def _load_state_dict(self, parts: list[Any] | None) -> None:
        import tempfile

        box: list[Any] = [None]
        torch.distributed.scatter_object_list(box, parts, src=0)
        local = box[0]
        self.model.load_state_dict(local["model"])
        # The fp32 main params are the optimizer's own copy: without this they keep the weights the
        # optimizer was built from, and the next step would write them back over the restored model.
        self.optimizer.reload_model_params()
        self.optimizer.load_state_dict(local["optimizer"])
        self._unshare_step_tensors()
        with tempfile.TemporaryDirectory(prefix="rlfleet-mg-") as tmp:
            path = os.path.join(tmp, "param_state.pt")
            if local["param_state"] is not None:
                torch.save(local["param_state"], path)
            with torch.no_grad(), self._step_tensors_set_aside():  # copies into leaf main params
                self.optimizer.load_parameter_state(
                    path
                )  # DP rank 0 reads it and scatters main params + moments

    def _inner_optimizers(self) -> list[Any]:
        return [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]

    def _unshare_step_tensors(self) -> None:
        """megatron-core 0.19.2 without Apex/TE (torch's own Adam): `load_state_dict` gives every
        parameter's state the SAME `step` tensor, which torch's Adam then increments once per
        parameter per step (wrong bias correction from the first step after a restore). One each."""
        for opt in self._inner_optimizers():
            for st in opt.state.values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].clone()

    @contextmanager
    def _step_tensors_set_aside(self) -> Iterator[None]:
        """megatron-core 0.19.2 without Apex/TE (torch's own Adam): `load_state_dict` puts a `step`
        tensor into every parameter's state, and `load_parameter_state` then copies every tensor of
        that state from the checkpoint, which has no `step` (KeyError). Set the steps aside while the
        parameter state loads. With TE's FusedAdam (the GPU image) there are none: a no-op."""
        aside = [
            (st, st.pop("step"))
            for opt in self._inner_optimizers()
            for st in opt.state.values()
            if isinstance(st.get("step"), torch.Tensor)
        ]
        try:
            yield
        finally:
            for st, step in aside:
                st["step"] = step
