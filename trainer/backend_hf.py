"""The `torch` backend of an RLJob (`trainer.backend: torch`, local mode, the ablation): any Hugging Face
causal LM (Qwen3, Llama, ...) through transformers' `AutoModelForCausalLM`.

The training loop drives it through `train_step(flat, group_index) -> (LossOutput, grad_norm)`, `weights()` (HF-named fp32
tensors for the publisher), `state_dict()` / `load_state_dict()` (checkpoints). The objective is the
one corrected policy loss of trainer/objective.py, on the same gathered logit rows.

Precision: fp32 master weights always. On CPU the compute is fp32 (a reference); on a GPU the
forward runs in bf16 (autocast on one GPU, FSDP2's MixedPrecisionPolicy with fp32 gradient
reduction on several), and the logits are cast to fp32 before the objective.

Several processes (FSDP2, `torch.distributed.fsdp.fully_shard`, one shard per rank; `trainer.backend:
torch` on one node, one rank per GPU under torchrun, which this backend joins when WORLD_SIZE > 1): rank
0 drives and every other rank runs `follow()` (backend_common.RankCommands, the same commands as the
megatron backend): each public call on rank 0 broadcasts its command (a step carries the FlatBatch and
group index), and every rank then executes the same collectives with the same inputs. Every rank gets
the SAME FlatBatch and trains on its share of the sequences (sequence b goes to rank b % world). The
loss is the token mean over the WHOLE batch: each rank's sum over its tokens is divided by the global
token count and multiplied by the world size, because FSDP2 averages gradients over ranks in its
reduce-scatter; the reduced gradient is then exactly the one-process gradient (tests pin 1e-6 in
fp32 with 2 gloo processes). Reported loss and mean metrics are combined across ranks (token-weighted,
exact); `ess` is not decomposable from per-rank means and is reported only with one process.

Logits: only the positions from the first sampled token on are projected (`logits_to_keep`), so the
prompt's [S, V] block is never materialised.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlfleet.trainer.backend_common import OptimConfig, RankCommands, to_token_batch
from rlfleet.trainer.batching import FlatBatch
from rlfleet.trainer.objective import MEAN_METRICS, LossOutput, ObjectiveConfig, policy_loss

SUM_KEYS = ("num_tokens", "invalid_tokens")
MAX_KEYS = ("sc_tail_ratio_max",)


def combine_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Per-rank metric dicts of one scope -> the whole batch's: counts add, token means are
    token-weighted, maxima take the max. Non-decomposable keys (ess) are dropped."""
    out: dict[str, float] = {k: sum(p.get(k, 0.0) for p in parts) for k in SUM_KEYS}
    n = out["num_tokens"]
    for k in MEAN_METRICS:
        have = [p for p in parts if k in p]
        if have and n:
            out[k] = sum(p[k] * p["num_tokens"] for p in have) / n
    for k in MAX_KEYS:
        vals = [p[k] for p in parts if k in p]
        if vals:
            out[k] = max(vals)
    return out


class HFBackend(RankCommands):
    name = "hf"

    def __init__(
        self,
        model: torch.nn.Module,
        objective: ObjectiveConfig,
        optim: OptimConfig | None = None,
        temperature: float = 1.0,
        device: str | torch.device | None = None,
        distributed: bool | None = None,
    ) -> None:
        """`model`: an HF causal LM in fp32 (see `from_pretrained`). `distributed`: shard with FSDP2
        over the default process group (default: when torch.distributed is initialised with > 1 rank;
        under torchrun with WORLD_SIZE > 1 the process group is initialised here, nccl on GPUs)."""
        if distributed is None and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            _join_torchrun_group(cpu=device is not None and torch.device(device).type == "cpu")
        self.device = (
            torch.device(device)
            if device is not None
            else torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        if distributed is None:
            distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.distributed = bool(distributed)
        self.world = dist.get_world_size() if self.distributed else 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.bf16 = self.device.type == "cuda"
        model = model.to(device=self.device, dtype=torch.float32)
        if self.distributed:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = (
                MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                if self.bf16
                else MixedPrecisionPolicy()
            )
            for layer in _decoder_layers(model):
                fully_shard(layer, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
        self.model = model
        self.objective = objective
        self.optim_config = optim or OptimConfig()
        self.temperature = temperature
        self.optimizer = self.optim_config.adamw(self.model.parameters())

    @classmethod
    def from_pretrained(cls, path: str | Path, objective: ObjectiveConfig, **kwargs: Any) -> HFBackend:
        """Load a local HF checkpoint directory (config.json + safetensors) in fp32."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        return cls(model, objective, **kwargs)

    # ------------------------------------------------------------------ forward
    def local_sequences(self, flat: FlatBatch) -> np.ndarray:
        """The sequences this rank trains on (b % world == rank)."""
        n = int(flat.input_ids.shape[0])
        if n < self.world:
            raise ValueError(f"a batch of {n} sequences cannot be split over {self.world} trainer ranks")
        return np.arange(self.rank, n, self.world)

    def row_logits(self, flat: FlatBatch, seqs: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """fp32 logits [len(rows), V] / temperature at the rows (of sequences `seqs`) of sampled tokens."""
        local_index = np.full(int(flat.input_ids.shape[0]), -1, dtype=np.int64)
        local_index[seqs] = np.arange(len(seqs))
        input_ids = torch.from_numpy(flat.input_ids[seqs]).to(self.device)
        seq_len = int(input_ids.shape[1])
        row_pos = flat.row_pos[rows]
        first = int(row_pos.min()) if len(rows) else seq_len - 1
        keep = seq_len - first  # logits of positions first..S-1
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.bf16 and not self.distributed):
            # Right padding needs no attention mask with causal attention: pads come after every row.
            logits = self.model(input_ids=input_ids, logits_to_keep=keep, use_cache=False).logits
        b = torch.from_numpy(local_index[flat.row_seq[rows]]).to(self.device)
        p = torch.from_numpy(row_pos - first).to(self.device)
        return logits[b, p].float() / self.temperature

    def _has_followers(self) -> bool:
        return self.distributed

    def train_step(self, flat: FlatBatch, group_index: dict[str, int]) -> tuple[LossOutput, float]:
        """One optimizer step on the batch; returns the objective's output and the pre-clip grad norm
        (rank 0: the batch is broadcast to the followers first)."""
        self._send(("step", flat, group_index))
        return self._train_step(flat, group_index)

    def _train_step(self, flat: FlatBatch, group_index: dict[str, int]) -> tuple[LossOutput, float]:
        self.model.train()
        full = to_token_batch(flat, group_index)
        seqs = self.local_sequences(flat)
        rows = np.flatnonzero(np.isin(flat.row_seq, seqs))
        batch = full.select(torch.from_numpy(rows))
        batch = batch if self.device.type == "cpu" else batch.to(self.device)
        out = policy_loss(self.row_logits(flat, seqs, rows), batch, self.objective)
        total_valid = self._all_sum(float(out.num_valid_tokens))
        loss_sum = out.loss_sum if out.loss_sum is not None else out.loss * out.num_valid_tokens
        # FSDP2 averages gradients over ranks: scale by world so the reduced gradient is the global mean.
        scaled = loss_sum * (self.world / max(total_valid, 1.0))
        self.optimizer.zero_grad(set_to_none=True)
        scaled.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_config.max_grad_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if np.isfinite(grad_norm):
            self.optimizer.step()
        return self._global_output(out, total_valid), grad_norm

    # ------------------------------------------------------------------ reductions
    def _all_sum(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t)
        return float(t.item())

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _global_output(self, out: LossOutput, total_valid: float) -> LossOutput:
        """The batch-wide LossOutput: the global token-mean loss (a detached value) and combined metrics."""
        if not self.distributed:
            return out
        loss_sum = float((out.loss_sum if out.loss_sum is not None else out.loss).detach())
        global_loss = self._all_sum(loss_sum) / max(total_valid, 1.0)
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, (out.metrics, out.per_group, out.per_staleness))
        per_group: dict[int, dict[str, float]] = {}
        for gid in sorted({g for p in parts for g in p[1]}):
            per_group[gid] = combine_metrics([p[1][gid] for p in parts if gid in p[1]])
        per_stale: dict[str, dict[str, float]] = {}
        for bucket in sorted({b for p in parts for b in p[2]}):
            per_stale[bucket] = combine_metrics([p[2][bucket] for p in parts if bucket in p[2]])
        return LossOutput(
            loss=torch.tensor(global_loss),
            metrics=combine_metrics([p[0] for p in parts]),
            per_group=per_group,
            per_staleness=per_stale,
            loss_sum=torch.tensor(global_loss * total_valid),
            num_valid_tokens=int(total_valid),
        )

    # ------------------------------------------------------------------ weights and checkpoints
    def weights(self) -> dict[str, torch.Tensor]:
        """HF-named fp32 full tensors on CPU, on rank 0 ({} on the other ranks, which take part in the
        gather through `follow()`)."""
        self._send(("weights",))
        return self._weights()

    def _weights(self) -> dict[str, torch.Tensor]:
        # One parameter at a time: every rank all-gathers it (full_tensor), only rank 0 keeps a CPU copy.
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for k, v in self.model.state_dict(keep_vars=True).items():
            if id(v) in seen:  # a tied weight (lm_head = embed_tokens): HF checkpoints store it once
                continue
            seen.add(id(v))
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            if self.rank == 0:
                out[k] = full.detach().to("cpu", torch.float32).clone()
        return out

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint state {"model", "optimizer"}. One process: the module's and optimizer's own
        state dicts (live tensors: save them before the next step, as trainer/checkpoint.py does).
        Several: a collective; rank 0 gets the FULL (unsharded, CPU) model and optimizer state, keyed by
        parameter name (torch.distributed.checkpoint), every other rank (through `follow()`) empty dicts;
        rank 0 saves it."""
        self._send(("state",))
        return self._state_dict()

    def _state_dict(self) -> dict[str, Any]:
        if not self.distributed:
            return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(
            self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state()`. Several processes: a collective; RANK 0's `state` is the checkpoint and is
        broadcast tensor by tensor, each rank keeping its own shard of the weights and of the Adam
        moments (and the step count); what the other ranks pass is ignored (their `state_dict()` was
        empty; through `follow()` they pass nothing), so only rank 0 needs to read the file."""
        self._send(("load",))
        self._load_state_dict(state)

    def _load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not self.distributed:
            assert state is not None
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        # Copies: these functions write their sharded tensors into the dicts they are given (the
        # caller's checkpoint stays as loaded). Two calls, not set_state_dict: that one skips the model
        # on a rank whose model dict is empty, so ranks != 0 would miss rank 0's broadcast.
        model_sd = dict(state["model"]) if self.rank == 0 and state is not None else {}
        optim_sd = dict(state["optimizer"]) if self.rank == 0 and state is not None else {}
        set_optimizer_state_dict(self.model, self.optimizer, optim_sd, options=options)
        set_model_state_dict(self.model, model_sd, options=options)


def _join_torchrun_group(cpu: bool = False) -> None:
    """The process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK): nccl with
    this rank's GPU when there are GPUs, else (or with `cpu`: a trainer on a CPU class) gloo."""
    on_gpu = torch.cuda.is_available() and not cpu
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if on_gpu else "gloo")


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks (the FSDP2 units): `model.model.layers` in the Llama/Qwen3 families."""
    get_decoder = getattr(model, "get_decoder", None)  # transformers' PreTrainedModel method
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (expected model.model.layers)")
    return list(layers)
