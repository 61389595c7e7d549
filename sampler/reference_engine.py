"""The reference sampler engine: a Qwen3 checkpoint on CPU with precision emulation and a batching
scheduler (the model implementation: rlfleet/numerics/engine_model.py, held against transformers).

What it emulates (so that q really differs from the trainer's p the way a GPU fleet's does):
- weight precision: `precision_view(weights, fmt)` (bf16; fp8 per-channel / block-128; nvfp4; mxfp4);
  a pre-quantized view loaded from disk is used as is (like SGLang reading a quantized checkpoint);
- KV cache dtype: auto (the model dtype, as in SGLang: bf16 with the bf16 kernel every group runs) | bf16 |
  fp8_e4m3 (K and V rounded through E4M3, scale 1.0);
- kernels: `KernelConfig(act_dtype, split_k)`: bf16 activations and a split-K reduction order make even
  bf16-vs-bf16 differ slightly;
- speed: `max_tokens_per_second` throttles generation, to build deliberately slow / fast groups.

Scheduling: continuous batching. A single loop admits waiting requests into free KV slots; each step
runs one batched decode forward for the running rows and one prefill per admitted prompt (ragged), then
samples every row in one batched call (sampling.py: SGLang's sampler). Model work runs in a worker
thread so the HTTP side (health, metrics) stays responsive; a lock keeps weight swaps between steps.

In process (no HTTP, no event loop): `run_batch` runs requests to completion with the same steps;
rlfleet_experiments' emulated samplers are this engine driven that way.

Weight versions: each token records the version of the weights that computed its logits, which is the
version at its step (forward and sample happen in the same step, as in SGLang). meta_info carries them
as SGLang 0.5.23 does (srt/utils/weight_versions.py): `weight_versions` = spans
`[{version, start, end}, ...]` over the output tokens, several when an update landed mid-request, and
`weight_version` = the last span's version.

Routed experts (a Qwen3-MoE served with `return_routed_experts: true`): every forward's routing is kept
per request (the prefill's positions, then one per decode) and returned as SGLang 0.5.23 does, base64 of
the int32 bytes of [P + n - 1 - routed_experts_start_len, layers, top_k] in `meta_info.routed_experts`
(SGLang needs --enable-return-routed-experts; this engine always captures for a mixture of experts and,
like SGLang without a MoE, returns nothing for a dense model).

LoRA (docs/sampler.md, "LoRA"; SGLang 0.5.23's flags `EngineConfig.lora`): `LoraRegistry` is SGLang's
tokenizer-side registry and the scheduler's loaded adapters in one (load / unload with SGLang's answers,
the implicit reload of an evicted adapter from its path, an unload that waits for the requests in flight
on it); a request's adapter (`GenRequest.lora`) computes every one of its tokens, and a batch holds at
most `max_loras_per_batch` distinct adapters, the base counting as one (SGLang's validate_lora_batch).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import random
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlfleet.lora import ADAPTER_CONFIG_FILE, TARGET_MODULES
from rlfleet.numerics.engine_model import (
    EngineModel,
    KernelConfig,
    LoraAdapter,
    ModelShape,
    precision_view,
    read_lora_adapter,
)
from rlfleet.sampler.sampling import SAMPLING_BACKENDS, MaskStatus, RowParams, SampleResult, sample

log = logging.getLogger("rlfleet.sampler.engine")


def tiny_shape(**sizes: Any) -> ModelShape:
    """The shape of the project's tiny Qwen3 (rlfleet/tiny_qwen3.py) with `sizes` overridden."""
    from huggingface_hub.errors import StrictDataclassError

    from rlfleet.tiny_qwen3 import TinyQwen3

    try:
        config = TinyQwen3(**sizes).hf_config()
    except (
        StrictDataclassError
    ) as exc:  # transformers' config validators (e.g. an odd head_dim): not a ValueError
        raise ValueError(f"invalid tiny Qwen3 sizes: {exc.__cause__ or exc}") from None
    return ModelShape.from_hf_config(config.to_dict())


def seeded_weights(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    """The tiny Qwen3 init (rlfleet/tiny_qwen3.py `init_weights`) of `shape` from `seed`: what an engine
    started without a checkpoint serves until its first weight update."""
    from rlfleet.numerics.views import checkpoint_tensors
    from rlfleet.tiny_qwen3 import SIZES, TinyQwen3, tiny_model

    # the shape's fields a TinyQwen3 takes under the same names (a MoE's: its experts and routing too)
    names = ["vocab_size", *SIZES, "tie_word_embeddings"]
    if shape.is_moe:
        names += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"]
    sizes = {name: getattr(shape, name) for name in names}
    architecture = "qwen3_moe" if shape.is_moe else "qwen3"
    spec = TinyQwen3(**sizes, seed=seed, architecture=architecture)
    # checkpoint names: a Qwen3-MoE's experts one by one, as its checkpoints and views hold them
    return {k: v.detach() for k, v in checkpoint_tensors(tiny_model(spec).state_dict()).items()}


WEIGHT_FORMATS = ("fp32", "bf16", "fp8", "fp8_block", "nvfp4", "mxfp4")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3")
# The one table from an RLJob group's precision to this engine's (local mode's fleet and the
# experiments' in-process samplers read it; the cpu class offers only the dtypes the engine has). The
# weight format needs none: a group serves the channel's view of its weightFormat as stored (view names
# are the formats; `rlfleet.numerics.views.view_weights` is that view in memory).
# SGLang --kv-cache-dtype -> the engine's KV cache: dtypes it cannot emulate exactly round like fp8 e4m3.
ENGINE_KV = {
    "auto": "auto",
    "bf16": "bf16",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e4m3",
    "mxfp8": "fp8_e4m3",
    "nvfp4": "fp8_e4m3",
}
THROTTLE_BURST_S = 0.1  # budget (in seconds of the cap) the throttle may bank

# SGLang 0.5.23's --lora-target-modules names this engine has (srt/utils/common.py
# SUPPORTED_LORA_TARGET_MODULES lists more, for other architectures; rlfleet/lora.py's), and "all".
LORA_TARGET_MODULES = TARGET_MODULES
LORA_TARGET_ALL = "all"
# srt/lora/utils.py get_normalized_target_modules: SGLang's fused LoRA buffers (q/k/v share qkv_proj,
# gate/up share gate_up_proj), so enabling q_proj lets an adapter of k_proj load too.
_LORA_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
_LORA_FUSED["up_proj"] = "gate_up_proj"


def normalized_lora_modules(names: Iterable[str]) -> set[str]:
    """SGLang's normalized LoRA module names of `names` ("all": every module this engine has)."""
    names = list(names)
    if LORA_TARGET_ALL in names:
        names = list(LORA_TARGET_MODULES)
    return {_LORA_FUSED.get(n.rpartition(".")[2], n.rpartition(".")[2]) for n in names}


@dataclass(frozen=True)
class LoraSettings:
    """SGLang 0.5.23's LoRA launch flags (server_args `lora` namespace, checked as its
    check_lora_server_args does): --enable-lora with --max-lora-rank, --lora-target-modules,
    --max-loras-per-batch (default 8; distinct adapters in one batch, the base counting as one) and
    --max-loaded-loras (default None: no limit; over it the least recently used adapter is unloaded)."""

    max_lora_rank: int
    target_modules: tuple[str, ...]
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras_per_batch <= 0:
            raise ValueError("max_loras_per_batch must be positive")
        if self.max_lora_rank <= 0 or not self.target_modules:  # no --lora-paths here: both are required
            raise ValueError(
                "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
                "--lora-target-modules for LoRA initialization."
            )
        unknown = sorted(set(self.target_modules) - {*LORA_TARGET_MODULES, LORA_TARGET_ALL})
        if unknown:
            raise ValueError(
                f"--lora-target-modules: unsupported {unknown}; choose from {LORA_TARGET_MODULES}"
            )
        if LORA_TARGET_ALL in self.target_modules and len(self.target_modules) != 1:
            raise ValueError(
                "If 'all' is specified in --lora-target-modules, it should be the only module specified."
            )
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(
                "max_loaded_loras should be greater than or equal to max_loras_per_batch. "
                f"max_loaded_loras={self.max_loaded_loras}, max_loras_per_batch={self.max_loras_per_batch}"
            )


@dataclass
class EngineConfig:
    model: ModelShape = field(default_factory=lambda: tiny_shape())
    weight_format: str = "bf16"
    kv_cache_dtype: str = "auto"
    kernel: KernelConfig = field(default_factory=lambda: KernelConfig(act_dtype="bfloat16"))
    max_running_requests: int = 32
    max_tokens_per_second: float | None = None  # None = as fast as the CPU goes
    sampling_mask_max_tokens: int = 4096
    sampling_backend: str = "pytorch"  # SGLang --sampling-backend whose kept sets to emulate (sampling.py)
    weight_version: int = 0
    served_model_name: str = "tiny-qwen3"
    model_path: str | None = None
    seed: int = 0
    lora: LoraSettings | None = None  # None: LoRA not enabled (SGLang without --enable-lora)

    def __post_init__(self) -> None:
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_tokens_per_second is not None and self.max_tokens_per_second <= 0:
            raise ValueError("max_tokens_per_second must be > 0")
        if self.weight_version < 0:
            raise ValueError("weight_version must be >= 0")
        if self.sampling_backend not in SAMPLING_BACKENDS:
            raise ValueError(
                f"sampling_backend must be one of {SAMPLING_BACKENDS}, got {self.sampling_backend!r}"
            )


@dataclass
class GenRequest:
    """One /generate request inside the engine (already validated by the HTTP layer)."""

    input_ids: list[int]
    params: RowParams
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    return_logprob: bool = False
    return_mask: bool = False
    logprob_mode: str = "selected"  # sampling_logprobs_mode: "selected" (SGLang's default) | "support"
    top_logprobs_num: int = 0
    seed: int | None = None
    log_metrics: bool = True  # False for /health_generate (SGLang does not count it either)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    # filled by the engine
    future: asyncio.Future | None = None
    slot: int = -1
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    masks: list[list[int]] = field(default_factory=list)
    mask_logprobs: list[list[float] | float] = field(default_factory=list)
    heads: list[list[list]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    generator: torch.Generator | None = None
    cancelled: bool = False  # the client went away: free the slot at the next step (SGLang aborts too)
    return_routed_experts: bool = False  # a mixture of experts only (SGLang omits them for others too)
    routed_experts_start_len: int = 0
    routed: list[torch.Tensor] = field(
        default_factory=list
    )  # per forward of this request, [tokens, layers, k]
    lora: LoraAdapter | None = None  # the adapter every token of this request is computed with

    @property
    def error_status(self) -> int | None:
        """The HTTP status SGLang answers for this request's abort (None: a normal response)."""
        code = (self.finish or {}).get("status_code")
        return int(code) if code is not None and 400 <= int(code) < 600 else None


def abort_reason(message: str, status_code: int | None = None, err_type: str | None = None) -> dict[str, Any]:
    """SGLang's FINISH_ABORT.to_json() (srt/managers/schedule_batch.py)."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


# SGLang's scheduler messages for a mask that cannot be committed (batch_result_processor.py
# get_sampling_mask_finish_reason); the request aborts and its token is not committed.
def mask_abort_reason(status: int, mask_max_tokens: int) -> dict[str, Any]:
    if status == MaskStatus.OVERFLOW:
        return abort_reason(
            f"Sampling support exceeds --sampling-mask-max-tokens={mask_max_tokens}, commonly because "
            "of cutoff ties. Lower top_k to leave more headroom or increase the server limit.",
            400,
            "BadRequestError",
        )
    return abort_reason(
        "The sampling backend selected a token outside its captured sampling support.",
        500,
        "InternalServerError",
    )


def weight_version_spans(versions: list[int], current: int) -> list[dict[str, Any]]:
    """meta_info.weight_versions: runs of equal versions over the output tokens as SGLang's
    compute_weight_version_spans + add_weight_versions_to_meta_info build them ({version: str,
    start, end}); no token yet: one empty span of the current version."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans or [{"version": str(current), "start": 0, "end": 0}]


class ReferenceEngine:
    def __init__(
        self, config: EngineConfig, weights: dict[str, torch.Tensor] | None = None, view: str = "fp32"
    ):
        self.config = config
        self.model = EngineModel(config.model, config.kernel).eval()
        self.view = "init"
        self.effective_format = config.weight_format
        self.weight_version = config.weight_version
        self.load_weights(
            weights if weights is not None else seeded_weights(config.model, config.seed),
            view,
            config.weight_version,
        )
        self.cache = self.model.new_cache(config.max_running_requests, kv_dtype=config.kv_cache_dtype)
        self.free_slots = list(range(config.max_running_requests))[::-1]
        self.waiting: deque[GenRequest] = deque()
        self.running: list[GenRequest] = []
        self.paused = False
        self.lock = asyncio.Lock()  # held for every model step and every weight swap
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._rng = random.Random(config.seed)
        self._next_step_at = 0.0
        self.stats = EngineStats()
        self.loras = LoraRegistry(config.lora, config.model)

    # ------------------------------------------------------------------------------------ weights
    def load_weights(self, weights: dict[str, torch.Tensor], view: str, version: int) -> None:
        """Install weights (synchronous; call between steps). A bf16/fp32 view is quantized online to the
        engine's format; a quantized view is used as is (what SGLang does with a quantized checkpoint)."""
        if view in ("fp32", "bf16", "init"):
            emulated = precision_view(weights, self.config.weight_format)
            self.effective_format = self.config.weight_format
        else:
            if view != self.config.weight_format:
                log.warning(
                    "loaded a %s view into a %s engine: serving it as %s",
                    view,
                    self.config.weight_format,
                    view,
                )
            emulated = precision_view(weights, "fp32")
            self.effective_format = view
        self.model.load_weights(emulated)  # names and shapes checked before anything is copied
        self.view = view
        self.weight_version = int(version)

    # ------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="reference-engine")

    async def stop(self) -> None:
        """Stop after the current step (a step runs in a thread and cannot be cancelled midway)."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        async with self.lock:
            self.abort_all("server shutting down")

    def _prepare(self, req: GenRequest) -> bool:
        """Seed the request's sampling generator (its `sampling_seed`, else the engine's seeded stream;
        a generator set by an in-process caller is kept); False when it is finished already."""
        if req.generator is None:
            seed = req.seed if req.seed is not None else self._rng.getrandbits(63)
            req.generator = torch.Generator().manual_seed(int(seed) % (1 << 64))
        if req.max_new_tokens == 0:
            req.finish = {"type": "length", "length": 0}
            self.stats.record_finish(req, time.monotonic())
            return False
        return True

    async def submit(self, req: GenRequest) -> GenRequest:
        req.future = asyncio.get_running_loop().create_future()
        if not self._prepare(req):
            return req
        self.waiting.append(req)
        self._wake.set()
        try:
            return await req.future
        except asyncio.CancelledError:
            req.cancelled = True
            raise

    def run_batch(self, reqs: list[GenRequest]) -> list[GenRequest]:
        """Run `reqs` to completion in the calling thread with the scheduler's own steps (admission into
        free slots, prefill, batched decode, one batched sample per step): the engine without HTTP or an
        event loop. Only while the engine's loop is not started (the loop owns the queues then)."""
        if self._task is not None:
            raise RuntimeError("run_batch on a started engine: submit requests to its loop instead")
        self.waiting.extend(req for req in reqs if self._prepare(req))
        while self.waiting or self.running:
            self._step(self._admit())
        return reqs

    def abort_all(self, message: str) -> int:
        """Finish every waiting and running request now with finish_reason abort (partial output kept).
        Call from the event loop while holding `lock` (never during a step)."""
        victims = list(self.waiting) + list(self.running)
        self.waiting.clear()
        self.running = []
        for req in victims:
            req.finish = abort_reason(message)
            self._release(req)
            self._resolve(req)
        return len(victims)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._wake.set()

    # ------------------------------------------------------------------------------------ scheduler
    async def _loop(self) -> None:
        while not self._stopping:
            if self.paused or not (self.waiting or self.running):
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._throttle()
            step_started = time.monotonic()
            async with self.lock:
                if self.paused:
                    continue
                admitted = self._admit()
                produced, finished = await asyncio.to_thread(self._step, admitted)
                for req in finished:
                    self._resolve(req)
            self.stats.record_step(produced, len(self.running), len(self.waiting))
            if self.config.max_tokens_per_second:
                # Token bucket: pacing counts from the step's START (compute time is part of the budget) and
                # up to THROTTLE_BURST_S of budget survives a late wake-up or a short idle gap, so the
                # long-run rate is min(cap, what the CPU delivers), not the cap diluted by event-loop jitter.
                floor = step_started - THROTTLE_BURST_S
                self._next_step_at = (
                    max(self._next_step_at, floor) + produced / self.config.max_tokens_per_second
                )
            await asyncio.sleep(0)  # let handlers run between steps

    async def _throttle(self) -> None:
        delay = self._next_step_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    def _admit(self) -> list[GenRequest]:
        """Waiting requests into free slots, in order; with LoRA, one whose adapter would make the batch
        hold more than max_loras_per_batch distinct adapters (the base is one) waits (SGLang's
        scheduler: _can_schedule_lora_req)."""
        admitted: list[GenRequest] = []
        deferred: list[GenRequest] = []
        limit = self.config.lora.max_loras_per_batch if self.config.lora else None
        in_batch = {r.lora for r in self.running}
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            if req.cancelled:
                continue
            if limit is not None and req.lora not in in_batch and len(in_batch) >= limit:
                deferred.append(req)
                continue
            in_batch.add(req.lora)
            req.slot = self.free_slots.pop()
            self.cache.reset([req.slot])
            admitted.append(req)
        self.waiting.extendleft(reversed(deferred))
        return admitted

    @torch.no_grad()
    def _step(self, admitted: list[GenRequest]) -> tuple[int, list[GenRequest]]:
        """One scheduler step (worker thread), in SGLang's order: the forward that computes each running
        request's next-token logits (a batched decode of the last token; a prefill for the newly
        admitted), then one batched sample, so every token carries the weight version that computed it.
        Returns (tokens produced, finished requests); their futures are resolved on the event loop."""
        version = self.weight_version
        for req in [r for r in self.running if r.cancelled]:
            req.finish = abort_reason("client disconnected")
            self._release(req)
        self.running = [r for r in self.running if not r.cancelled]
        rows: list[torch.Tensor] = []
        if self.running:
            slots = torch.tensor([r.slot for r in self.running])
            nxt = torch.tensor([[r.out_ids[-1]] for r in self.running])
            rows.extend(self.model(nxt, self.cache, slots, _adapters(self.running))[:, 0])  # [B, V]
            self._capture_routing(self.running)
        for req in admitted:  # ragged prompts: one prefill each
            ids, slot = torch.tensor([req.input_ids]), torch.tensor([req.slot])
            rows.append(self.model(ids, self.cache, slot, _adapters([req]))[0, -1])
            self._capture_routing([req])
            self.stats.realtime_prefill_tokens += len(req.input_ids)
        batch = self.running + admitted
        if not batch:
            return 0, []
        res = sample(
            torch.stack(rows),
            [r.params for r in batch],
            [r.generator for r in batch],
            self.config.sampling_mask_max_tokens,
            self.config.sampling_backend,
        )
        heads = res.top_logprobs([r.top_logprobs_num if r.return_logprob else 0 for r in batch])
        now = time.monotonic()
        capacity = min(self.cache.capacity, self.config.model.max_position_embeddings)
        still: list[GenRequest] = []
        finished: list[GenRequest] = []
        produced = 0
        for b, req in enumerate(batch):
            status = int(res.statuses[b])
            if req.return_mask and status != MaskStatus.OK:  # SGLang: abort, the token is not committed
                req.finish = mask_abort_reason(status, self.config.sampling_mask_max_tokens)
                self._release(req)
                finished.append(req)
                continue
            self._record(req, res, b, heads[b], version)
            produced += 1
            if req.first_token_at is None:
                req.first_token_at = now
            finish = self._finish_reason(req, capacity)
            if finish is None:
                still.append(req)
                continue
            req.finish = finish
            self._release(req)
            finished.append(req)
        self.running = still
        return produced, finished

    def _capture_routing(self, reqs: list[GenRequest]) -> None:
        """Keep the experts the last forward routed each of `reqs`' new tokens to (batch row b is reqs[b]),
        for the requests that asked (SGLang's routed-experts capturer, which records every forward)."""
        routed = self.model.routed_experts  # [B, S, layers, k], None for a dense model
        if routed is None:
            return
        for b, req in enumerate(reqs):
            if req.return_routed_experts:
                req.routed.append(routed[b].to(torch.int32))

    @staticmethod
    def _finish_reason(req: GenRequest, capacity: int) -> dict[str, Any] | None:
        """Why the request ends after its newest token (SGLang's finish_reason), or None to go on."""
        tok = req.out_ids[-1]
        if tok in req.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if len(req.out_ids) >= req.max_new_tokens:
            return {"type": "length", "length": req.max_new_tokens}
        if len(req.input_ids) + len(req.out_ids) >= capacity:
            return {"type": "length", "length": len(req.out_ids)}
        return None

    @staticmethod
    def _record(req: GenRequest, res: SampleResult, b: int, head: list[list] | None, version: int) -> None:
        tok = int(res.token_ids[b])
        req.out_ids.append(tok)
        req.out_logprobs.append(res.token_logprob(b))
        req.versions.append(version)
        if req.return_mask:
            ids, lps = res.mask(b)
            req.masks.append(ids)
            req.mask_logprobs.append(
                lps if req.logprob_mode == "support" else float(res.selected_logprobs[b])
            )
        if head is not None:
            req.heads.append(head)

    def _release(self, req: GenRequest) -> None:
        if req.slot >= 0:
            self.free_slots.append(req.slot)
            req.slot = -1
        self.stats.record_finish(req, time.monotonic())

    @staticmethod
    def _resolve(req: GenRequest) -> None:
        if req.future is not None and not req.future.done():
            req.future.set_result(req)

    # ------------------------------------------------------------------------------------ output
    def response(self, req: GenRequest) -> dict[str, Any]:
        """The SGLang /generate JSON of a finished request, with meta_info keys in the order
        srt/managers/tokenizer_manager.py `_handle_batch_output` builds them (the fields SGLang adds only
        with --enable-metrics timing, speculative decoding, multimodal or hidden states are absent)."""
        n = len(req.out_ids)
        spans = weight_version_spans(req.versions, self.weight_version)
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish,
            "prompt_tokens": len(req.input_ids),
            "weight_version": spans[-1]["version"],
            "num_retractions": 0,
        }
        if req.return_logprob:
            # logprob_start_len -1 with return_logprob: output logprobs only, no prompt positions
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(req.out_logprobs, req.out_ids, strict=True)
            ]
            meta["output_token_logprobs_length"] = n
            if req.top_logprobs_num > 0:
                meta["input_top_logprobs"] = []
                meta["output_top_logprobs"] = req.heads
        if req.return_mask:
            meta["output_token_sampling_mask"] = req.masks
            meta["output_token_sampling_logprobs"] = req.mask_logprobs
            meta["output_token_sampling_mask_length"] = len(req.masks)
        meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = n
        meta["cached_tokens"] = 0
        if req.return_routed_experts and req.routed:
            # SGLang's encoding (detokenizer_manager.py _b64_encode_per_request): the int32 bytes of
            # [positions start_len .. P + n - 2, layers, top_k]; the last output token is never forwarded
            routed = torch.cat(req.routed)[req.routed_experts_start_len :].contiguous().numpy()
            meta["routed_experts"] = base64.b64encode(routed.astype("<i4").tobytes()).decode("ascii")
        meta["weight_versions"] = spans
        meta["e2e_latency"] = round(time.monotonic() - req.created, 6)
        # No tokenizer in the reference engine: text is "" (token-in/token-out is the contract anyway).
        return {"text": "", "output_ids": list(req.out_ids), "meta_info": meta}


def _adapters(reqs: list[GenRequest]) -> list[LoraAdapter | None] | None:
    """The batch rows' adapters for EngineModel.forward (None: no row has one)."""
    adapters = [r.lora for r in reqs]
    return adapters if any(a is not None for a in adapters) else None


LORA_NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


@dataclass(frozen=True)
class LoadedLora:
    """SGLang's LoRARef (a fresh lora_id per load, so a reloaded name is a new adapter) with its weights."""

    lora_id: str
    name: str
    path: str
    pinned: bool
    adapter: LoraAdapter


def lora_update_output(
    success: bool, error_message: str | None, loaded: dict[str, str] | None
) -> dict[str, Any]:
    """The body of SGLang's /load_lora_adapter and /unload_lora_adapter: msgspec_to_builtins of a
    LoRAUpdateOutput (BaseReq's rid and http_worker_ipc included); 200 on success, else 400."""
    return {
        "rid": None,
        "http_worker_ipc": None,
        "success": success,
        "error_message": error_message,
        "loaded_adapters": loaded,
    }


class LoraRegistry:
    """SGLang 0.5.23's dynamic LoRA, tokenizer and scheduler side in one process (srt/managers/
    tokenizer_control_mixin.py load/unload, tokenizer_manager.py _resolve_lora_path, srt/lora/
    lora_registry.py, lora_manager.py validate_new_adapter), with its messages:

    - `registry`: name -> the adapter requests may name, in least-recently-used order (a load and a
      request's lookup move it to the end); `serving`: lora_id -> what the scheduler holds (an
      unregistered adapter stays there until its requests finished);
    - `ref_cache`: every name ever loaded -> its ref, so a request naming an unloaded (or evicted)
      adapter loads it again from its path (the reload SGLang does implicitly);
    - an unload unregisters at once (new requests cannot take it) and returns when the requests in
      flight on it have finished; with `max_loaded_loras`, a load over the limit unloads the least
      recently used unpinned adapter the same way."""

    def __init__(self, settings: LoraSettings | None, shape: ModelShape) -> None:
        self.settings, self.shape = settings, shape
        self.registry: OrderedDict[str, LoadedLora] = OrderedDict()
        self.serving: dict[str, LoadedLora] = {}
        self.ref_cache: dict[str, tuple[str, bool]] = {}  # name -> (path, pinned) of its last load
        self.pending_unloads: dict[str, str] = {}
        self.in_flight: dict[str, int] = {}  # lora_id -> requests on it
        self._idle: dict[str, asyncio.Event] = {}  # lora_id -> set while no request is on it
        self._update_lock = asyncio.Lock()

    @property
    def enabled(self) -> bool:
        return self.settings is not None

    def loaded_adapters(self) -> dict[str, str]:
        return {ref.name: ref.path for ref in self.serving.values()}

    async def load(self, name: str, path: str, pinned: bool = False) -> dict[str, Any]:
        """/load_lora_adapter: the LoRAUpdateOutput body."""
        try:
            if self.settings is None:
                raise ValueError(LORA_NOT_ENABLED)
            async with self._update_lock:
                if name in self.pending_unloads:
                    raise ValueError(
                        f"LoRA adapter '{name}' has an incomplete unload. Retry the unload before loading it again."
                    )
                error = await asyncio.to_thread(self._load_into_scheduler, name, path, pinned)
                result = lora_update_output(error is None, error or "", self.loaded_adapters())
                if error is None:
                    ref = next(r for r in self.serving.values() if r.name == name)
                    self.registry[name], self.ref_cache[name] = ref, (ref.path, ref.pinned)
                    self.in_flight[ref.lora_id] = 0
                    self._idle[ref.lora_id] = asyncio.Event()
                    self._idle[ref.lora_id].set()
                limit = self.settings.max_loaded_loras
                while limit is not None and len(self.registry) > limit:
                    lru = next((n for n, r in self.registry.items() if not r.pinned), None)
                    if lru is None:
                        raise ValueError(
                            "Didn't find any LoRA adapters when trying to evict LRU LoRA adapter. "
                            f"LoRA registry is: {self.registry}"
                        )
                    log.info("Unloading least recently used LoRA adapter '%s'", lru)
                    await self._unload_locked(lru)
                    result["loaded_adapters"].pop(lru, None)
                return result
        except ValueError as exc:
            return lora_update_output(False, str(exc), None)

    def _load_into_scheduler(self, name: str, path: str, pinned: bool) -> str | None:
        """The scheduler's load (lora_manager._load_lora_adapter): LoRAConfig, validate_new_adapter,
        the weights; the error message, None when loaded."""
        assert self.settings is not None
        try:
            if not os.path.isdir(path):  # SGLang would try the Hugging Face hub
                raise ValueError(
                    f"{path} is not an adapter directory (the reference engine reads local ones)"
                )
            with open(os.path.join(path, ADAPTER_CONFIG_FILE)) as f:
                config = json.load(f)
            targets, rank = config["target_modules"], config["r"]
            config["lora_alpha"]  # LoRAConfig reads it (KeyError when absent)
            if config.get("use_dora", False):
                raise ValueError(
                    f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters"
                )
            for ref in self.serving.values():
                if ref.name == name:
                    raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
            enabled = normalized_lora_modules(self.settings.target_modules)
            if rank > self.settings.max_lora_rank or not normalized_lora_modules(targets) <= enabled:
                raise ValueError(
                    f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool "
                    "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                    "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
                )
            if (
                pinned
                and sum(r.pinned for r in self.serving.values()) >= self.settings.max_loras_per_batch - 1
            ):
                raise ValueError(
                    f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to pin all slots "
                    "in the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please "
                    "increase your `--max-loras-per-batch` or load it as unpinned LoRA adapters."
                )
            adapter = read_lora_adapter(path, self.shape)
        except Exception as exc:  # SGLang answers any failure of the load with its text
            return str(exc)
        lora_id = uuid.uuid4().hex
        self.serving[lora_id] = LoadedLora(lora_id, name, path, pinned, adapter)
        return None

    async def unload(self, name: str) -> dict[str, Any]:
        """/unload_lora_adapter: returns once the requests in flight on the adapter have finished."""
        try:
            if self.settings is None:
                raise ValueError(LORA_NOT_ENABLED)
            async with self._update_lock:
                return await self._unload_locked(name)
        except ValueError as exc:
            return lora_update_output(False, str(exc), None)

    async def _unload_locked(self, name: str) -> dict[str, Any]:
        lora_id = self.pending_unloads.get(name)
        if lora_id is None:
            ref = self.registry.pop(name, None)
            if ref is None:
                raise ValueError(
                    f"LoRA with name {name} does not exist. Loaded LoRAs: {self.registry.keys()}"
                )
            lora_id = self.pending_unloads[name] = ref.lora_id
        await self._idle[lora_id].wait()
        self.in_flight.pop(lora_id)
        self._idle.pop(lora_id)
        self.serving.pop(lora_id, None)
        self.pending_unloads.pop(name)
        return lora_update_output(True, "", self.loaded_adapters())

    async def acquire(self, names: list[str | None]) -> list[LoadedLora | None]:
        """A request's adapters by name (None: the base), counted in flight until `release`: SGLang's
        _validate_and_resolve_lora (called when a request names any: its `lora_path` is not empty), an
        adapter loaded before but not now (unloaded, evicted) loaded again from its path. Raises
        ValueError with SGLang's messages."""
        if self.settings is None:
            first = next((n for n in names if n), None)
            raise ValueError(
                f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the server with "
                "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
            )
        unique, limit = set(names), self.settings.max_loaded_loras
        if limit is not None and len(unique) > limit:
            raise ValueError(
                f"Received request with {len(unique)} unique loras requested but max loaded loras is {limit}"
            )
        for name in unique - {None}:
            assert name is not None
            if name in self.registry:
                self.registry.move_to_end(name)
            else:
                await self._reload(name)
        refs = [self._lookup(name) for name in names]
        for ref in refs:
            if ref is not None:
                self.in_flight[ref.lora_id] += 1
                self._idle[ref.lora_id].clear()
        return refs

    async def _reload(self, name: str) -> None:
        if name not in self.ref_cache:
            raise ValueError(
                f"Got LoRA adapter that has never been loaded: {name}\n"
                f"All loaded adapters: {self.ref_cache.keys()}."
            )
        log.info("Reloading evicted adapter: %s", name)
        result = await self.load(name, *self.ref_cache[name])
        if not result["success"] and "already loaded" not in result["error_message"]:
            raise ValueError(f"Failed to implicitly load LoRA adapter {name}: {result['error_message']}")

    def _lookup(self, name: str | None) -> LoadedLora | None:
        if name is None:
            return None
        ref = self.registry.get(name)
        if ref is None:
            raise ValueError(
                f"The following requested LoRA adapters are not loaded: {name}\n"
                f"Loaded adapters: {self.registry.keys()}."
            )
        self.registry.move_to_end(name)
        return ref

    def release(self, refs: list[LoadedLora | None]) -> None:
        """The requests of `acquire` finished (or went away): an unload waiting on them may go on.
        Synchronous, so that a cancelled handler's `finally` releases too."""
        for ref in refs:
            if ref is not None:
                self.in_flight[ref.lora_id] -= 1
                if self.in_flight[ref.lora_id] == 0:
                    self._idle[ref.lora_id].set()


@dataclass
class EngineStats:
    """What /metrics exports (SGLang's names and labels are applied in server.py). Like SGLang's
    TokenizerMetricsCollector.observe_one_finished_request, requests, prompt and generation tokens are
    counted when a request FINISHES; realtime tokens and the throughput window move every step."""

    requests_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    realtime_prefill_tokens: int = 0
    realtime_decode_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    finished: deque = field(default_factory=lambda: deque(maxlen=4096))  # (ttft, e2e) awaiting export
    window: deque = field(default_factory=lambda: deque(maxlen=256))  # (time, tokens) of recent steps

    def record_step(self, produced: int, running: int, waiting: int) -> None:
        self.realtime_decode_tokens += produced
        self.num_running, self.num_waiting = running, waiting
        self.window.append((time.monotonic(), produced))

    def record_finish(self, req: GenRequest, now: float) -> None:
        if not req.log_metrics:
            return
        self.requests_total += 1
        self.prompt_tokens_total += len(req.input_ids)
        self.generation_tokens_total += len(req.out_ids)
        ttft = (req.first_token_at - req.created) if req.first_token_at is not None else None
        self.finished.append((ttft, now - req.created))

    def gen_throughput(self, horizon_s: float = 5.0) -> float:
        """Tokens per second over the recent window (0 when idle)."""
        now = time.monotonic()
        recent = [(t, n) for t, n in self.window if now - t <= horizon_s]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return 0.0
        # tokens of every step after the first, over the time they took
        return sum(n for _, n in recent[1:]) / (recent[-1][0] - recent[0][0])


def kl_q_p(logits_q: torch.Tensor, logits_p: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(q || p) per position for two logits tensors [..., V] (exact, full vocabulary)."""
    lq = torch.log_softmax(logits_q.float() / temperature, -1)
    lp = torch.log_softmax(logits_p.float() / temperature, -1)
    return (lq.exp() * (lq - lp)).sum(-1)


def measure_kl(
    trainer_model: torch.nn.Module,
    sampler_model: EngineModel,
    kv_cache_dtype: str,
    input_ids: torch.Tensor,
    prompt_len: int,
) -> float:
    """Mean KL(q || p) over the continuation positions, with the sampler running its KV-cached decode
    path (prefill the prompt, then one token at a time, as the engine does) and the trainer its plain
    full-sequence forward (`trainer_model`: transformers' causal LM of the same checkpoint).
    input_ids [B, S]."""
    with torch.no_grad():
        p_logits = trainer_model(input_ids).logits.float()  # [B, S, V]
        cache = sampler_model.new_cache(input_ids.shape[0], kv_dtype=kv_cache_dtype)
        rows = torch.arange(input_ids.shape[0])
        q_parts = [sampler_model(input_ids[:, :prompt_len], cache, rows)]
        for t in range(prompt_len, input_ids.shape[1]):
            q_parts.append(sampler_model(input_ids[:, t : t + 1], cache, rows))
        q_logits = torch.cat(q_parts, 1)
        kl = kl_q_p(q_logits[:, prompt_len - 1 :], p_logits[:, prompt_len - 1 :])
    return float(kl.mean())


__all__ = [
    "ENGINE_KV",
    "EngineConfig",
    "GenRequest",
    "KV_CACHE_DTYPES",
    "LoraRegistry",
    "LoraSettings",
    "ReferenceEngine",
    "WEIGHT_FORMATS",
    "kl_q_p",
    "measure_kl",
]
