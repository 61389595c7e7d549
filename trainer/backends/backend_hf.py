"""The `torch` backend of an RLJob (`trainer.backend: torch`, local mode, the ablation): any Hugging Face
causal LM (Qwen3, Llama, ...) through transformers' `AutoModelForCausalLM`.

The training loop drives it through `train_step(flat, group_index) -> (LossOutput, grad_norm)`, `weights()` (HF-named fp32
tensors for the publisher), `state_dict()` / `load_state_dict()` (checkpoints). The objective is the
one corrected policy loss of trainer/objective.py, handed the final hidden states of the sampled
tokens' positions and the output embedding (the fused lm_head: no [T, V] logits exist).

Precision: fp32 master weights always. On CPU the compute is fp32 (a reference); on a GPU the
forward runs in bf16 (autocast on one GPU, FSDP2's MixedPrecisionPolicy with fp32 gradient
reduction on several); the objective's logit tiles are computed and reduced in fp32.

Micro-batches: each rank's sequences are packed (back to back, no padding, position ids restarting at
each sequence) into micro-batches of at most `max_tokens_per_micro_batch` tokens (trainer/rollout/batching.py
`plan_micro_batches`; a longer sequence trains alone), each forwarded and backwarded in turn, its
gradient accumulated. A sequence is cut after its last sampled token (causal attention: what follows
changes no trained row). Attention over a packed row runs per sequence (trainer/backends/attention.py, the
variable-length path: no pair across sequences is computed, no [L, L] mask exists); a model whose
attention does not go through transformers' AttentionInterface keeps its own, with transformers'
block-causal mask. The model's forward projects no position to the vocabulary
(`logits_to_keep` empty); the objective does, for the rows of sampled tokens only, tile by tile.

Several processes (FSDP2, `torch.distributed.fsdp.fully_shard`, one shard per rank; `trainer.backend:
torch` on one node, one rank per GPU under torchrun, which this backend joins when WORLD_SIZE > 1): rank
0 drives and every other rank runs `follow()` (backend_common.RankCommands, the same commands as the
megatron backend): each public call on rank 0 broadcasts its command (a step carries the FlatBatch and
group index), and every rank then executes the same collectives with the same inputs. Every rank gets
the SAME FlatBatch and trains on its share of the sequences (sequence b goes to rank b % world); every
rank plans every rank's micro-batches, and one with fewer runs idle ones (a one-token forward and
backward with a zero loss) so that FSDP2's collectives pair up. The loss is the token mean over the
WHOLE batch (docs/objective.md): the backward of each micro-batch is its loss SUM, and once all are
done the accumulated gradient is multiplied by world / (the global valid-token count), the world
size because FSDP2 averages gradients over ranks in its reduce-scatter; the reduced gradient is then
exactly the one-process, one-micro-batch gradient (tests pin 1e-6 in fp32 with 2 gloo processes). On
gloo (CPU ranks) whether the reduce-scatter really averages is measured at startup: torch 2.6's gloo
sums where FSDP2 asks for the average (`_fsdp2_averages_gradients`), and the multiplier is then 1.
Reported loss and mean metrics are combined across micro-batches and ranks (backend_common
`merge_loss_outputs`: token-weighted, exact); `ess` is not decomposable from per-part means and is
reported only when the whole batch was one micro-batch on one process.

Mixture of experts (Qwen3-MoE, transformers' `Qwen3MoeForCausalLM`): trained like a dense model; when its
config sets `output_router_logits`, the model's router load-balancing loss (transformers' `aux_loss`, over
every token of the packed micro-batch) times the config's `router_aux_loss_coef` is added to the policy
loss, each micro-batch's weighted by its valid tokens (docs/objective.md "Mixture of experts"). The reported
loss is the policy loss alone. With `routing_replay` (RLJob `correction.routingReplay`) each trained token's
logit position is routed to the experts its sampler chose (trainer/backends/routing_replay.py, docs/objective.md
"Routing replay").

LoRA (RLJob `trainer.lora`, docs/weights.md "LoRA"; trainer/backends/lora.py): PEFT's LoRA layers are injected
into the model before FSDP2 shards it and the model's own weights are frozen. The forward, the objective and
the loop are the same; the optimizer holds the adapter only, `weights()` returns the adapter only (PEFT's
names: what the `lora` view's adapter_model.safetensors holds) and checkpoints hold the adapter and its
optimizer state only (the base is the model source, which a resume loads again).
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from rlfleet.api.rljob import MAX_TOKENS_PER_MICRO_BATCH
from rlfleet.hf_config import is_moe_config
from rlfleet.trainer.backends.attention import use_varlen_attention
from rlfleet.trainer.backends.backend_common import (
    OptimConfig,
    RankCommands,
    add_routing_metrics,
    merge_loss_outputs,
    routing_compared_rows,
    to_token_batch,
    trainer_experts,
)
from rlfleet.trainer.backends.routing_replay import check_replayable, replay_routing
from rlfleet.trainer.objective import LossOutput, ObjectiveConfig, TokenBatch, policy_loss
from rlfleet.trainer.rollout.batching import FlatBatch, MicroBatch, plan_micro_batches

if TYPE_CHECKING:
    from peft import PeftModel

    from rlfleet.api.lora_spec import LoraSpec

log = logging.getLogger(__name__)


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
        max_tokens_per_micro_batch: int = MAX_TOKENS_PER_MICRO_BATCH,
        activation_checkpointing: bool = False,
        routing_replay: bool = False,
        lora: LoraSpec | None = None,
    ) -> None:
        """`model`: an HF causal LM in fp32 (see `from_pretrained`). `distributed`: shard with FSDP2
        over the default process group (default: when torch.distributed is initialised with > 1 rank;
        under torchrun with WORLD_SIZE > 1 the process group is initialised here, nccl on GPUs).
        `max_tokens_per_micro_batch`: the token budget of one packed forward and backward (RLJob
        `trainer.maxTokensPerMicroBatch`). `activation_checkpointing`: keep only each decoder layer's
        input and recompute the layer in backward (transformers' gradient checkpointing).
        `routing_replay`: route each token to the experts its sampler's router chose (RLJob
        `correction.routingReplay`, trainer/backends/routing_replay.py); refused for a model with no Qwen3-MoE router.
        `lora`: train a LoRA adapter of the frozen model (RLJob `trainer.lora`, trainer/backends/lora.py);
        targets the model lacks, and MLP targets on a mixture of experts, are refused here (ValueError)."""
        if max_tokens_per_micro_batch < 1:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens_per_micro_batch}")
        self.max_tokens = max_tokens_per_micro_batch
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
        if routing_replay:
            check_replayable(model)
        self.routing_replay = routing_replay
        self.varlen_attention = use_varlen_attention(model)
        self.lora = lora
        self.peft: PeftModel | None = None
        if lora is not None:  # before checkpointing and FSDP2: both then see PEFT's layers like any other
            from rlfleet.trainer.backends.lora import wrap

            self.peft = wrap(model, lora)  # injects into `model`, which stays the module forwarded
        if (
            activation_checkpointing
        ):  # before FSDP2 wraps the layers; non-reentrant: works under FSDP2 and autocast
            enable: Any = getattr(
                model, "gradient_checkpointing_enable", None
            )  # transformers' PreTrainedModel
            if enable is None:
                raise ValueError(
                    f"{type(model).__name__} has no gradient checkpointing (not a transformers model)"
                )
            enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # Whether the FSDP2 reduce-scatter averages the ranks' gradients (else it sums them: gloo on torch 2.6).
        self.grads_averaged = True
        if self.distributed:
            self.grads_averaged = _fully_shard(model, self.bf16, cpu=self.device.type == "cpu")
        self.model = model
        self.objective = objective
        self.optim_config = optim or OptimConfig()
        self.temperature = temperature
        # After fully_shard (it replaces the parameters by sharded ones); all of them without LoRA.
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self.optim_config.adamw(self.trainable)
        if self.peft is not None and self.rank == 0:
            trained, total = self.peft.get_nb_trainable_parameters()
            log.info("LoRA: %d of %d parameters trained (%.3f%%)", trained, total, 100.0 * trained / total)

    @classmethod
    def from_pretrained(cls, path: str | Path, objective: ObjectiveConfig, **kwargs: Any) -> HFBackend:
        """Load a local HF checkpoint directory (config.json + safetensors) in fp32."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        return cls(model, objective, **kwargs)

    # ------------------------------------------------------------------ forward
    def local_sequences(self, flat: FlatBatch, rank: int | None = None) -> np.ndarray:
        """The sequences a rank (default: this one) trains on (b % world == rank)."""
        n = int(flat.input_ids.shape[0])
        if n < self.world:
            raise ValueError(f"a batch of {n} sequences cannot be split over {self.world} trainer ranks")
        return np.arange(self.rank if rank is None else rank, n, self.world)

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
        # Every rank plans every rank's micro-batches (the same FlatBatch everywhere): with FSDP2 each
        # forward and backward is a collective, so a rank with fewer runs idle ones.
        plans = [
            plan_micro_batches(flat, self.local_sequences(flat, r), self.max_tokens)
            for r in range(self.world)
        ]
        mine = plans[self.rank]
        self.optimizer.zero_grad(set_to_none=True)
        outs = [self._micro_batch_backward(flat, full, mb) for mb in mine]
        for _ in range(max(len(p) for p in plans) - len(mine)):
            self._idle_backward()
        local = merge_loss_outputs(outs)
        total_valid = self._all_sum(float(local.num_valid_tokens))
        # The gradients hold d(sum of per-token losses): the token mean over the WHOLE batch divides
        # by the global count, times the world size where FSDP2 averages gradients over ranks.
        scale = (self.world if self.grads_averaged else 1) / max(total_valid, 1.0)
        for p in self.trainable:
            if p.grad is not None:
                p.grad.mul_(scale)
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.optim_config.max_grad_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if np.isfinite(grad_norm):
            self.optimizer.step()
        return self._global_output(local), grad_norm

    def _micro_batch_backward(self, flat: FlatBatch, full: TokenBatch, mb: MicroBatch) -> LossOutput:
        """Forward the micro-batch's sequences packed into one row (position ids restart at each
        sequence: attention stays within each, trainer/backends/attention.py), the fused lm_head + objective on the final hidden states of its rows,
        backward of its loss SUM."""
        input_ids, position_ids, row_index = mb.packed(flat)
        batch = full.select(torch.from_numpy(mb.rows))
        batch = batch if self.device.type == "cpu" else batch.to(self.device)
        compared = self._routing_compared(flat, mb)
        # The replay stays on through the backward: activation checkpointing recomputes each layer's
        # forward there, which must route as the first forward did.
        with self._replayed_routing(flat, mb, row_index, len(input_ids)):
            hidden, router_aux, router_logits = self._final_hidden_states(
                input_ids, position_ids, compared is not None
            )
            rows = hidden[torch.from_numpy(row_index).to(self.device)]
            # The output embedding read after the forward: under FSDP2 the root's parameters (embedding,
            # final norm, lm_head) stay unsharded from its forward until the backward.
            weight = _output_weight(self.model)
            out = policy_loss(rows, weight, batch, self.objective, temperature=self.temperature)
            assert out.loss_sum is not None  # policy_loss always returns the sum
            total = out.loss_sum
            if router_aux is not None:
                # A mixture of experts' load-balancing loss (docs/objective.md "Mixture of experts"): the
                # micro-batch's, weighted by its valid tokens, so that after the division by the global
                # count the step adds coef x (the token-weighted mean of the micro-batches' aux losses).
                total = total + _router_aux_loss_coef(self.model) * router_aux * out.num_valid_tokens
            total.backward()
        out = replace(out, loss=out.loss.detach(), loss_sum=out.loss_sum.detach())
        if compared is not None and router_logits is not None:
            self._add_routing_metrics(out, flat, full, mb, row_index, router_logits, compared)
        return out

    def _replayed_routing(
        self, flat: FlatBatch, mb: MicroBatch, row_index: np.ndarray, pack_len: int
    ) -> AbstractContextManager[None]:
        """With routing replay on and routing in the batch: the forward routes each row's logit position
        (`row_index`, where `_add_routing_metrics` reads the trainer's own choice) to the row's sampler
        experts (trainer/backends/routing_replay.py); positions of no row, and rows of -1, route as usual."""
        if not self.routing_replay or flat.routed_experts is None:
            return nullcontext()
        routed = flat.routed_experts[mb.rows]
        at_position = np.full((pack_len, *routed.shape[1:]), -1, dtype=np.int64)
        present = (routed >= 0).all(axis=(1, 2))
        at_position[row_index[present]] = routed[present]
        return replay_routing(self.model, torch.from_numpy(at_position).to(self.device))

    def _routing_compared(self, flat: FlatBatch, mb: MicroBatch) -> np.ndarray | None:
        """Which of the micro-batch's rows get their sampler routing compared with the trainer's (bool
        [R]); None when the batch has no routing or the model is dense (then the forward asks for no
        router logits: no cost)."""
        return routing_compared_rows(flat, mb.rows) if _is_moe(self.model) else None

    def _add_routing_metrics(
        self,
        out: LossOutput,
        flat: FlatBatch,
        full: TokenBatch,
        mb: MicroBatch,
        row_index: np.ndarray,
        router_logits: tuple[torch.Tensor, ...],
        compared: np.ndarray,
    ) -> None:
        """The routing mismatch of the micro-batch's compared rows (trainer/backends/routing.py) into `out`'s
        metrics and per-group metrics. The trainer's experts are its router's own choice: the top-k of
        the float32 softmax of each layer's router logits at the row's position."""
        assert flat.routed_experts is not None  # _routing_compared said so
        index = torch.from_numpy(row_index).to(router_logits[0].device)
        trainer = trainer_experts(list(router_logits), index, int(flat.routed_experts.shape[2]))
        add_routing_metrics(out, flat, full, mb.rows, trainer, compared)

    def _final_hidden_states(
        self, input_ids: np.ndarray, position_ids: np.ndarray, router_logits: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
        """The decoder's output (after the final norm) [L, H] of one packed row, through the model's
        own forward (FSDP2's hooks run on it), with no position projected to the vocabulary
        (`logits_to_keep` empty): the objective does that tile by tile. Second: the model's router
        load-balancing loss over the row's tokens when it is a mixture of experts whose config sets
        `output_router_logits` (transformers' `aux_loss`; without an attention mask every token of the
        pack counts, and a pack has no padding), else None. Third, with `router_logits` (a mixture of
        experts): each layer's router logits [L, num_experts] (transformers' `output_router_logits`)."""
        captured: list[torch.Tensor] = []
        hook = _decoder(self.model).register_forward_hook(
            lambda _module, _args, output: captured.append(output.last_hidden_state)
        )
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.bf16 and not self.distributed):
                output = self.model(
                    input_ids=torch.from_numpy(input_ids).to(self.device)[None],
                    position_ids=torch.from_numpy(position_ids).to(self.device)[None],
                    logits_to_keep=torch.zeros(0, dtype=torch.long, device=self.device),
                    use_cache=False,  # with a cache transformers ignores the restarts: plain causal over the pack
                    **({"output_router_logits": True} if router_logits else {}),
                )
        finally:
            hook.remove()
        # MoeCausalLMOutputWithPast; dense outputs have none. Asked for router logits, transformers computes
        # the aux loss too: it is trained on only when the config sets output_router_logits.
        router_aux = (
            getattr(output, "aux_loss", None)
            if getattr(self.model.config, "output_router_logits", False)
            else None
        )
        logits = tuple(output.router_logits) if router_logits else None
        return captured[0][0], router_aux if isinstance(router_aux, torch.Tensor) else None, logits

    def _idle_backward(self) -> None:
        """A forward and backward of one token with a zero loss: every parameter gets a (zero)
        gradient, so this rank joins FSDP2's all-gathers and reduce-scatters of a busier rank's
        micro-batch."""
        one = np.zeros(1, dtype=np.int64)
        hidden, router_aux, _ = self._final_hidden_states(one, one)
        weight = _output_weight(self.model)
        zero = (hidden.float().sum() + weight.sum()) * 0.0
        (zero if router_aux is None else zero + router_aux * 0.0).backward()

    # ------------------------------------------------------------------ reductions
    def _all_sum(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t)
        return float(t.item())

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _global_output(self, local: LossOutput) -> LossOutput:
        """The batch-wide LossOutput: every rank's merged (merge_loss_outputs: the global token-mean
        loss as a detached value, token-weighted metrics)."""
        if not self.distributed:
            return local
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(
            parts,
            replace(
                local,
                loss=local.loss.cpu(),
                loss_sum=None if local.loss_sum is None else local.loss_sum.cpu(),
            ),
        )
        return merge_loss_outputs(parts)

    # ------------------------------------------------------------------ weights and checkpoints
    def weights(self) -> dict[str, torch.Tensor]:
        """HF-named fp32 full tensors on CPU, on rank 0 ({} on the other ranks, which take part in the
        gather through `follow()`). With LoRA: the adapter's tensors only, named as PEFT's
        `get_peft_model_state_dict` names them (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`
        [r, in], `...lora_B.weight` [out, r]; trainer/backends/lora.py `adapter_tensors`)."""
        self._send(("weights",))
        return self._weights()

    def _weights(self) -> dict[str, torch.Tensor]:
        if self.peft is not None:
            from rlfleet.trainer.backends.lora import adapter_tensors

            return adapter_tensors(self.peft, _full_tensor, keep=self.rank == 0)
        # One parameter at a time: every rank all-gathers it (full_tensor), only rank 0 keeps a CPU copy.
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for k, v in self.model.state_dict(keep_vars=True).items():
            if id(v) in seen:  # a tied weight (lm_head = embed_tokens): HF checkpoints store it once
                continue
            seen.add(id(v))
            full = _full_tensor(v)
            if self.rank == 0:
                out[k] = full.detach().to("cpu", torch.float32).clone()
        return out

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint state {"model", "optimizer"}. One process: the module's and optimizer's own
        state dicts (live tensors: save them before the next step, as trainer/publish/checkpoint.py does).
        Several: a collective; rank 0 gets the FULL (unsharded, CPU) model and optimizer state, keyed by
        parameter name (torch.distributed.checkpoint), every other rank (through `follow()`) empty dicts;
        rank 0 saves it. With LoRA the model state is the adapter's parameters only (the frozen base is the
        model source, loaded again on resume)."""
        self._send(("state",))
        return self._state_dict()

    def _state_dict(self) -> dict[str, Any]:
        if not self.distributed:
            model_sd = self.model.state_dict()
            if self.peft is not None:
                trained = self._trainable_names()
                model_sd = {k: v for k, v in model_sd.items() if k in trained}
            return {"model": model_sd, "optimizer": self.optimizer.state_dict()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.peft is not None
        )
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state()`. Several processes: a collective; RANK 0's `state` is the checkpoint and is
        broadcast tensor by tensor, each rank keeping its own shard of the weights and of the Adam
        moments (and the step count); what the other ranks pass is ignored (their `state_dict()` was
        empty; through `follow()` they pass nothing), so only rank 0 needs to read the file."""
        self._send(("load",))
        self._load_state_dict(state)

    def _load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.peft is not None and state is not None and (not self.distributed or self.rank == 0):
            self._check_adapter_state(state["model"])
        if not self.distributed:
            assert state is not None
            self.model.load_state_dict(state["model"], strict=self.peft is None)
            self.optimizer.load_state_dict(state["optimizer"])
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # With LoRA not strict: the checkpoint lacks the frozen base, which every rank already holds.
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=self.peft is None)
        # Copies: these functions write their sharded tensors into the dicts they are given (the
        # caller's checkpoint stays as loaded). Two calls, not set_state_dict: that one skips the model
        # on a rank whose model dict is empty, so ranks != 0 would miss rank 0's broadcast.
        model_sd = dict(state["model"]) if self.rank == 0 and state is not None else {}
        optim_sd = dict(state["optimizer"]) if self.rank == 0 and state is not None else {}
        set_optimizer_state_dict(self.model, self.optimizer, optim_sd, options=options)
        set_model_state_dict(self.model, model_sd, options=options)

    def _trainable_names(self) -> set[str]:
        return {name for name, p in self.model.named_parameters() if p.requires_grad}

    def _check_adapter_state(self, model_state: dict[str, Any]) -> None:
        """A LoRA checkpoint holds exactly this adapter's parameters (the loads are not strict: they skip
        the frozen base, so a full-weights or other-targets checkpoint is refused here)."""
        got, want = set(model_state), self._trainable_names()
        if got != want:
            raise ValueError(
                f"not a checkpoint of this LoRA adapter: {len(got - want)} unexpected tensor(s) "
                f"(e.g. {sorted(got - want)[:3]}), {len(want - got)} missing (e.g. {sorted(want - got)[:3]})"
            )


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a parameter (under FSDP2 a DTensor shard: an all-gather, a collective)."""
    full: Any = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _fully_shard(model: torch.nn.Module, bf16: bool, cpu: bool = False) -> bool:
    """FSDP2 over the default process group: each decoder layer, then the root (embedding, final norm,
    lm_head); with bf16 the forward runs in bf16 and gradients are reduced in fp32. With LoRA a unit holds
    frozen base and trained adapter parameters together: FSDP2 reduce-scatters only the gradients there are.
    Returns whether the gradient reduce-scatter averages over ranks (else it sums): measured with `cpu`
    (`_fsdp2_averages_gradients`), True on GPUs (nccl's average).

    `cpu` (ranks on a CPU class, gloo): the layers keep their gathered parameters from forward to backward
    (`reshard_after_forward=False`; memory is not what a CPU rank runs short of), and torch's CPU stream
    stand-in gets the no-op `record_event` / `wait_event` FSDP2 calls (`_cpu_streams_for_fsdp2`). The
    trainer image's torch (Debian's 2.6) failed both ways in the dev cluster's trainer pod at its first
    step: "'Stream' object has no attribute 'record_event'", and with that added, resharding after forward
    then gathering again in backward failed autograd's check ("modified by an inplace operation")."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    if cpu:
        _cpu_streams_for_fsdp2()
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=mp, reshard_after_forward=not cpu)
    fully_shard(model, mp_policy=mp, reshard_after_forward=not cpu)
    if not cpu:
        return True
    averages = _fsdp2_averages_gradients(mp)
    if dist.get_rank() == 0:  # what the gradients' scale assumes (HFBackend.train_step)
        log.info(
            "FSDP2 over %d gloo ranks (torch %s): the gradient reduce-scatter %s",
            dist.get_world_size(),
            torch.__version__,
            "averages" if averages else "sums, so gradients are not multiplied by the world size",
        )
    return averages


def _fsdp2_averages_gradients(mp: Any) -> bool:
    """Whether FSDP2's gradient reduce-scatter over the default process group (gloo) averages the ranks'
    gradients (True) or sums them (False), measured (a collective): a throwaway FSDP2 module whose
    gradient is 1 on every rank, reduced. FSDP2 asks for `ReduceOp.AVG` in fp32; torch 2.6's gloo
    reduce-scatter silently sums instead (pytorch/pytorch#162338: FSDP2 gradients world times too large
    on CPU ranks; newer torch averages). Built without the random generator (`skip_init`): the ranks'
    random state stays as a process without the check has it."""
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    probe = torch.nn.utils.skip_init(torch.nn.Linear, 1, world, bias=False)  # weight [world, 1]: a row a rank
    with torch.no_grad():
        probe.weight.fill_(1.0)
    fully_shard(probe, mp_policy=mp, reshard_after_forward=False)
    probe(torch.ones(1, 1)).sum().backward()  # d/d(weight) = 1 everywhere, on every rank
    grad: Any = probe.weight.grad
    reduced = float(grad.to_local().sum())  # this rank's row: 1 if averaged, world if summed
    if reduced in (1.0, float(world)):
        return reduced == 1.0
    raise RuntimeError(
        f"FSDP2 reduced a gradient of 1 on each of {world} ranks to {reduced}: neither their mean nor their sum"
    )


def _cpu_streams_for_fsdp2() -> None:
    """FSDP2 records and waits on events of its streams; on CPU they are `torch.cpu.Stream`, a stand-in
    that torch 2.6 gives neither method (newer torch has both; left as they are). CPU work is synchronous:
    the event is already complete and a wait returns at once."""
    stream: Any = torch.cpu.Stream
    if not hasattr(stream, "record_event"):
        stream.record_event = lambda self, event=None: torch.cpu.Event()
    if not hasattr(stream, "wait_event"):
        stream.wait_event = lambda self, event: None


def _join_torchrun_group(cpu: bool = False) -> None:
    """The process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK): nccl with
    this rank's GPU when there are GPUs, else (or with `cpu`: a trainer on a CPU class) gloo."""
    on_gpu = torch.cuda.is_available() and not cpu
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if on_gpu else "gloo")


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (`model.model` in the Llama/Qwen3 families): transformers' `get_decoder()`."""
    get_decoder: Any = getattr(model, "get_decoder", None)  # transformers' PreTrainedModel method
    if not callable(get_decoder):
        raise ValueError(f"{type(model).__name__} has no get_decoder() (not a transformers causal LM)")
    return get_decoder()


def _output_weight(model: torch.nn.Module) -> torch.Tensor:
    """The output embedding (lm_head, or the tied input embedding) [V, H]: transformers'
    `get_output_embeddings()`."""
    get_output: Any = getattr(model, "get_output_embeddings", None)
    if not callable(get_output):
        raise ValueError(
            f"{type(model).__name__} has no get_output_embeddings() (not a transformers causal LM)"
        )
    return get_output().weight


def _is_moe(model: torch.nn.Module) -> bool:
    """Whether the model is a mixture of experts (its HF config, rlfleet/hf_config.py `is_moe_config`)."""
    config = getattr(model, "config", None)
    return config is not None and is_moe_config(config.to_dict())


def _router_aux_loss_coef(model: torch.nn.Module) -> float:
    """The weight of a mixture of experts' load-balancing loss: its config's `router_aux_loss_coef`
    (transformers' MoE configs; Qwen3-MoE: 0.001)."""
    coef = getattr(getattr(model, "config", None), "router_aux_loss_coef", None)
    if coef is None:
        raise ValueError(
            f"{type(model).__name__} returns a router aux loss but its config has no router_aux_loss_coef"
        )
    return float(coef)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks (the FSDP2 units): `model.model.layers` in the Llama/Qwen3 families."""
    layers = getattr(_decoder(model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (expected model.model.layers)")
    return list(layers)
