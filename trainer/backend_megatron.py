"""The `megatron` backend: megatron-core (0.19) GPTModel, its pipeline schedules and the distributed
optimizer, with the vocab-parallel corrected objective. GPU only; megatron is imported lazily so this
module imports (and its pure parts are tested) anywhere.

How a step runs (documented megatron-core API, nothing private):
- `parallel_state.initialize_model_parallel(tp, pp, context_parallel_size=cp)` once, under torchrun.
- `GPTModel(config=TransformerConfig(...), transformer_layer_spec=..., vocab_size, max_sequence_length,
  pre_process, post_process, parallel_output=True, share_embeddings_and_output_weights=False,
  position_embedding_type="rope")`, wrapped in `DistributedDataParallel`; optimizer from
  `get_megatron_optimizer(OptimizerConfig(...), [model])`.
- Rank 0 drives the rollouts and the loop; every other rank runs `follow()`, executing the commands
  rank 0 broadcasts (`step` with the batch, `weights`, `stop`). Each data-parallel rank takes its
  share of the batch's sequences and cuts it into micro-batches.
- `get_forward_backward_func()(forward_step_func=..., data_iterator=..., model=[model],
  num_microbatches=n, seq_length=S, micro_batch_size=m, forward_only=False)`.
  `forward_step_func(data_iterator, model) -> (logits, partial(loss_func, micro_batch))`; with
  labels=None GPTModel returns vocabulary-SHARDED logits [b, s, V/tp].
  `loss_func(micro_batch, logits) -> (loss_sum, num_valid_tokens, log_dict)`: rows of the sampled
  tokens / temperature -> `policy_loss(rows, batch, cfg, process_group=tp_group)`, which all-reduces
  the max / sum-exp / target logits over the TP group and never gathers the vocabulary.
  `TransformerConfig.calculate_per_token_loss=True` + `finalize_model_grads` make the gradient a
  token mean over the WHOLE batch (all micro-batches, all DP ranks), as method.md prescribes.
- `optimizer.step() -> (ok, grad_norm, num_zeros)` (clipping inside, `OptimizerConfig.clip_grad`).
- Publishing: the TP shards are all-gathered and renamed to Hugging Face names (`megatron_to_hf`),
  the same names TinyGPT and SGLang use, so the weight publisher makes every view from them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from rlfleet.trainer.backend_torch import OptimConfig, to_token_batch
from rlfleet.trainer.batching import FlatBatch
from rlfleet.trainer.objective import LossOutput, ObjectiveConfig, policy_loss


class BackendUnavailable(RuntimeError):
    """megatron-core or CUDA is missing (clear message, raised at construction)."""


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
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    micro_batch_size: int = 1
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# ---------------------------------------------------------------------------------------------
# Pure name/layout conversion between Megatron (fused qkv, fused gate/up) and Hugging Face names.
# Tested on CPU; used to initialise Megatron from an HF checkpoint and to publish HF-named weights.


def hf_to_megatron(hf: dict[str, torch.Tensor], cfg: MegatronModelConfig, te_spec: bool = True) -> dict[str, torch.Tensor]:
    """Full (unsharded) HF state dict -> full Megatron state dict (GPTModel names)."""
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
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0)
        out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
        if te_spec:  # TransformerEngine fuses the pre-norms into the following linear
            out[m + "self_attention.linear_qkv.layer_norm_weight"] = hf[p + "input_layernorm.weight"]
            out[m + "mlp.linear_fc1.layer_norm_weight"] = hf[p + "post_attention_layernorm.weight"]
        else:
            out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
            out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], cfg: MegatronModelConfig) -> dict[str, torch.Tensor]:
    """Full (unsharded) Megatron state dict -> HF names (inverse of `hf_to_megatron`, either spec)."""
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
        gate, up = mg[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = mg[m + "mlp.linear_fc2.weight"]
        te = m + "self_attention.linear_qkv.layer_norm_weight"
        out[p + "input_layernorm.weight"] = mg[te] if te in mg else mg[m + "input_layernorm.weight"]
        te = m + "mlp.linear_fc1.layer_norm_weight"
        out[p + "post_attention_layernorm.weight"] = mg[te] if te in mg else mg[m + "pre_mlp_layernorm.weight"]
    out["model.norm.weight"] = mg["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = mg["output_layer.weight"][: cfg.vocab_size]
    return out


# How each Megatron tensor is split over tensor-parallel ranks: dim 0 (column parallel), dim 1 (row
# parallel) or replicated. linear_fc1 is column parallel over the FUSED [gate; up]: each rank holds
# [gate_r; up_r], so gathering must un-fuse per rank first.
def tp_split_dim(name: str) -> int | None:
    if name.endswith(("linear_qkv.weight", "output_layer.weight", "word_embeddings.weight", "linear_fc1.weight")):
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


def merge_loss_outputs(outs: list[LossOutput]) -> LossOutput:
    """Token-weighted merge of the objective's outputs of several micro-batches (means of means;
    the *_max metrics take the max; ESS is approximated by its token-weighted mean)."""

    def merge(dicts: list[dict[str, float]]) -> dict[str, float]:
        total = sum(d.get("num_tokens", 0.0) for d in dicts)
        merged: dict[str, float] = {"num_tokens": total, "invalid_tokens": sum(d.get("invalid_tokens", 0.0) for d in dicts)}
        keys = {k for d in dicts for k in d} - {"num_tokens", "invalid_tokens"}
        for k in keys:
            if k.endswith("_max"):
                merged[k] = max(d[k] for d in dicts if k in d)
            else:
                w = [(d.get("num_tokens", 0.0), d[k]) for d in dicts if k in d]
                n = sum(x for x, _ in w)
                if n > 0:
                    merged[k] = sum(x * v for x, v in w) / n
        return merged

    per_group: dict[int, list] = {}
    per_stale: dict[str, list] = {}
    for o in outs:
        for g, m in o.per_group.items():
            per_group.setdefault(g, []).append(m)
        for b, m in o.per_staleness.items():
            per_stale.setdefault(b, []).append(m)
    loss_sum = sum(float(o.loss_sum.detach()) if o.loss_sum is not None else 0.0 for o in outs)
    n_valid = sum(o.num_valid_tokens for o in outs)
    return LossOutput(
        loss=torch.tensor(loss_sum / max(n_valid, 1)),
        metrics=merge([o.metrics for o in outs]),
        per_group={g: merge(ms) for g, ms in per_group.items()},
        per_staleness={b: merge(ms) for b, ms in per_stale.items()},
        loss_sum=torch.tensor(loss_sum),
        num_valid_tokens=n_valid,
    )


def slice_batch(flat: FlatBatch, seqs: np.ndarray) -> FlatBatch:
    """The sub-batch of the given sequence indices (rows renumbered; CSR candidates re-based)."""
    seqs = np.asarray(seqs, dtype=np.int64)
    remap = -np.ones(flat.input_ids.shape[0], dtype=np.int64)
    remap[seqs] = np.arange(len(seqs))
    rows = np.nonzero(remap[flat.row_seq] >= 0)[0]
    counts = np.diff(flat.cand_offsets)[rows]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    cand_idx = np.concatenate([np.arange(flat.cand_offsets[r], flat.cand_offsets[r + 1]) for r in rows]) if len(rows) else np.zeros(0, dtype=np.int64)
    return FlatBatch(
        input_ids=flat.input_ids[seqs],
        seq_lens=flat.seq_lens[seqs],
        row_seq=remap[flat.row_seq[rows]],
        row_pos=flat.row_pos[rows],
        target_ids=flat.target_ids[rows],
        advantages=flat.advantages[rows],
        logq=flat.logq[rows],
        logq_support=flat.logq_support[rows],
        cand_offsets=offsets,
        cand_ids=flat.cand_ids[cand_idx],
        cand_logq=flat.cand_logq[cand_idx],
        candidate_mode=flat.candidate_mode,
        versions=flat.versions[rows],
        staleness=flat.staleness[rows],
        groups=flat.groups[rows],
        rollout_uids=[flat.rollout_uids[i] for i in seqs] if flat.rollout_uids else [],
        dropped_invalid_tokens=0,
    )


# ---------------------------------------------------------------------------------------------
# The backend (GPU).


def _megatron() -> Any:
    try:
        import megatron.core as mcore  # noqa: F401
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as exc:
        raise BackendUnavailable(
            "trainer backend 'megatron' needs megatron-core 0.19 (pip install 'rlfleet[trainer]' on Python >= 3.12) "
            f"and CUDA; import failed: {exc}"
        ) from None
    ns = dict(
        parallel_state=parallel_state, tensor_parallel=tensor_parallel, DDP=DistributedDataParallel,
        DDPConfig=DistributedDataParallelConfig, finalize_model_grads=finalize_model_grads, GPTModel=GPTModel,
        OptimizerConfig=OptimizerConfig, get_megatron_optimizer=get_megatron_optimizer,
        get_forward_backward_func=get_forward_backward_func, TransformerConfig=TransformerConfig,
    )
    try:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        ns["layer_spec"], ns["te"] = get_gpt_layer_with_transformer_engine_spec(), True
    except ImportError:  # no TransformerEngine: the local (pure PyTorch) spec
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        ns["layer_spec"], ns["te"] = get_gpt_layer_local_spec(), False
    return type("Megatron", (), ns)


class MegatronBackend:
    """Same interface as TorchBackend: train_step(flat, group_index) -> (LossOutput, grad_norm),
    weights() -> HF-named full state dict (on global rank 0; {} elsewhere), state_dict/load_state_dict."""

    name = "megatron"

    def __init__(
        self,
        model_config: MegatronModelConfig,
        objective: ObjectiveConfig,
        optim: OptimConfig | None = None,
        temperature: float = 1.0,
        initial_hf_weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailable("trainer backend 'megatron' needs CUDA GPUs (use backend 'torch' on CPU)")
        mg = _megatron()
        self.mg = mg
        self.cfg = model_config
        self.objective = objective
        self.optim_config = optim or OptimConfig()
        self.temperature = temperature
        if not torch.distributed.is_initialized():  # torchrun sets RANK / WORLD_SIZE / MASTER_ADDR
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.distributed.init_process_group(backend="nccl")
        ps = mg.parallel_state
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=model_config.tensor_parallel,
                pipeline_model_parallel_size=model_config.pipeline_parallel,
                context_parallel_size=model_config.context_parallel,
            )
        mg.tensor_parallel.model_parallel_cuda_manual_seed(model_config.seed)
        c = model_config
        self.tconfig = mg.TransformerConfig(
            num_layers=c.num_layers,
            hidden_size=c.hidden_size,
            num_attention_heads=c.num_attention_heads,
            num_query_groups=c.num_query_groups,
            ffn_hidden_size=c.ffn_hidden_size,
            kv_channels=c.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=c.norm_eps,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            bf16=True,
            params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16,
            tensor_model_parallel_size=c.tensor_parallel,
            pipeline_model_parallel_size=c.pipeline_parallel,
            context_parallel_size=c.context_parallel,
            sequence_parallel=c.tensor_parallel > 1,
            calculate_per_token_loss=True,  # loss_func returns (sum, n_tokens): token mean over the batch
        )
        model = mg.GPTModel(
            config=self.tconfig,
            transformer_layer_spec=mg.layer_spec,
            vocab_size=c.vocab_size,
            max_sequence_length=c.max_seq_len,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            parallel_output=True,  # keep logits vocabulary-sharded: the objective is vocab-parallel
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            rotary_base=int(c.rotary_base),
        ).cuda()
        if initial_hf_weights is not None:
            self._load_hf(model, initial_hf_weights)
        ddp_config = mg.DDPConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True)
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
                bf16=True,
                use_distributed_optimizer=True,
            ),
            [self.model],
        )

    # -- helpers --
    def _tp(self) -> tuple[Any, int, int]:
        ps = self.mg.parallel_state
        return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()

    def _load_hf(self, model: torch.nn.Module, hf: dict[str, torch.Tensor]) -> None:
        if self.cfg.pipeline_parallel != 1:
            raise NotImplementedError("loading HF weights with pipeline parallelism > 1 is not supported yet")
        _, rank, world = self._tp()
        full = hf_to_megatron(hf, self.cfg, te_spec=self.mg.te)
        own = model.state_dict()
        with torch.no_grad():
            for name, tensor in own.items():
                if name in full:
                    tensor.copy_(split_tp_shard(name, full[name], rank, world).to(tensor.dtype))

    # -- rank 0 drives, every other rank follows (commands broadcast from global rank 0) --
    def _command(self, command: tuple | None = None) -> tuple:
        box = [command]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def follow(self) -> None:
        """Non-zero ranks: execute rank 0's commands until it says stop."""
        while True:
            command = self._command()
            if command[0] == "step":
                self._train_step(command[1], command[2])
            elif command[0] == "weights":
                self._weights()
            else:
                return

    def close(self) -> None:
        if torch.distributed.get_rank() == 0:
            self._command(("stop",))

    # -- the step --
    def train_step(self, flat: FlatBatch, group_index: dict[str, int]) -> tuple[LossOutput, float]:
        """Rank 0: broadcast the batch (it drives the rollouts), then train like every rank."""
        self._command(("step", flat, group_index))
        return self._train_step(flat, group_index)

    def _train_step(self, flat: FlatBatch, group_index: dict[str, int]) -> tuple[LossOutput, float]:
        mg, ps = self.mg, self.mg.parallel_state
        dp_rank, dp_world = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        my_seqs = np.arange(flat.input_ids.shape[0])[dp_rank::dp_world]
        mbs = self.cfg.micro_batch_size
        micro = [slice_batch(flat, my_seqs[i : i + mbs]) for i in range(0, len(my_seqs), mbs)] or [slice_batch(flat, my_seqs[:0])]
        seq_len = int(flat.input_ids.shape[1])
        tp_group = ps.get_tensor_model_parallel_group()
        outputs: list[LossOutput] = []

        def loss_func(mb: FlatBatch, logits: torch.Tensor):  # logits [b, s, V/tp], vocabulary-sharded
            rows = logits[torch.from_numpy(mb.row_seq).cuda(), torch.from_numpy(mb.row_pos).cuda()].float() / self.temperature
            batch = to_token_batch(mb, group_index)
            batch = type(batch)(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in batch.__dict__.items()})
            out = policy_loss(rows, batch, self.objective, process_group=tp_group)
            outputs.append(out)
            n = torch.tensor(out.num_valid_tokens, dtype=torch.int, device=rows.device)
            return out.loss_sum, n, {"loss_sum": out.loss_sum.detach(), "num_tokens": n}

        def forward_step_func(data_iterator, model):
            mb: FlatBatch = next(data_iterator)
            ids = torch.from_numpy(mb.input_ids).cuda()
            pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            logits = model(ids, pos, attention_mask=None)  # causal mask from the layer spec
            return logits, partial(loss_func, mb)

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        mg.get_forward_backward_func()(
            forward_step_func=forward_step_func,
            data_iterator=iter(micro),
            model=[self.model],
            num_microbatches=len(micro),
            seq_length=seq_len,
            micro_batch_size=mbs,
            forward_only=False,
        )
        _ok, grad_norm, _zeros = self.optimizer.step()
        merged = merge_loss_outputs(outputs) if outputs else LossOutput(loss=torch.tensor(0.0), metrics={})
        return merged, float(grad_norm) if grad_norm is not None else float("nan")

    def weights(self) -> dict[str, torch.Tensor]:
        """Rank 0: all ranks gather the TP shards; returns HF-named bf16 weights."""
        self._command(("weights",))
        return self._weights()

    def _weights(self) -> dict[str, torch.Tensor]:
        """All-gather the TP shards and return HF-named bf16 weights on global rank 0 ({} elsewhere)."""
        if self.cfg.pipeline_parallel != 1:
            raise NotImplementedError("publishing with pipeline parallelism > 1 is not supported yet")
        group, _, world = self._tp()
        full: dict[str, torch.Tensor] = {}
        for name, tensor in self.model.module.state_dict().items():
            if "_extra_state" in name or not isinstance(tensor, torch.Tensor):
                continue
            shards = [torch.empty_like(tensor) for _ in range(world)]
            torch.distributed.all_gather(shards, tensor.contiguous(), group=group)
            full[name] = merge_tp_shards(name, [s.cpu() for s in shards])
        if torch.distributed.get_rank() != 0:
            return {}
        return megatron_to_hf(full, self.cfg)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
