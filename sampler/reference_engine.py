"""The reference sampler engine: TinyGPT on CPU with precision emulation and a batching scheduler.

What it emulates (so that q really differs from the trainer's p the way a GPU fleet's does):
- weight precision: `precision_view(weights, fmt)` (bf16; fp8 per-channel / block-128; nvfp4; mxfp4);
  a pre-quantized view loaded from disk is used as is (like SGLang reading a quantized checkpoint);
- KV cache dtype: auto (fp32 here) | bf16 | fp8_e4m3 (K and V rounded through E4M3, scale 1.0);
- kernels: `KernelConfig(act_dtype, split_k)`: bf16 activations and a split-K reduction order make even
  bf16-vs-bf16 differ slightly;
- speed: `max_tokens_per_second` throttles generation, to build deliberately slow / fast groups.

Scheduling: continuous batching. A single loop admits waiting requests into free KV slots (prefill one
by one: ragged prompts), samples the next token of every running request in one batched call, then runs
one batched decode forward for all unfinished rows. Model work runs in a worker thread so the HTTP
side (health, metrics) stays responsive; a lock keeps weight swaps between steps.

Weight versions: each token records the version of the weights that computed its logits (a request
that straddles an update has mixed versions, `output_token_weight_versions`); meta_info.weight_version
(SGLang reports one per request) is the version of the request's LAST token (the server's current
version when it produced no token).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from rlfleet.numerics.tinygpt import KernelConfig, TinyGPT, TinyGPTConfig, precision_view
from rlfleet.sampler.sampling import RowParams, sample

log = logging.getLogger("rlfleet.sampler.engine")

WEIGHT_FORMATS = ("fp32", "bf16", "fp8", "fp8_block", "nvfp4", "mxfp4")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3")
THROTTLE_BURST_S = 0.1  # budget (in seconds of the cap) the throttle may bank


@dataclass
class EngineConfig:
    model: TinyGPTConfig = field(default_factory=TinyGPTConfig)
    weight_format: str = "bf16"
    kv_cache_dtype: str = "auto"
    kernel: KernelConfig = field(default_factory=lambda: KernelConfig(act_dtype="bfloat16"))
    max_running_requests: int = 32
    max_tokens_per_second: float | None = None  # None = as fast as the CPU goes
    sampling_mask_max_tokens: int = 4096
    weight_version: int = 0
    served_model_name: str = "tinygpt"
    model_path: str | None = None
    seed: int = 0

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


@dataclass
class GenRequest:
    """One /generate request inside the engine (already validated by the HTTP layer)."""

    input_ids: list[int]
    params: RowParams
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    return_mask: bool = False
    top_logprobs_num: int = 0
    seed: int | None = None
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    # filled by the engine
    future: asyncio.Future | None = None
    slot: int = -1
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    masks: list[list[int]] = field(default_factory=list)
    mask_logprobs: list[list[float]] = field(default_factory=list)
    heads: list[list[list]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    next_logits: torch.Tensor | None = None  # [V] logits for the next token
    next_version: int = 0  # weight version that computed next_logits
    generator: torch.Generator | None = None
    cancelled: bool = False  # the client went away: free the slot at the next step (SGLang aborts too)


class ReferenceEngine:
    def __init__(
        self, config: EngineConfig, weights: dict[str, torch.Tensor] | None = None, view: str = "fp32"
    ):
        self.config = config
        self.model = TinyGPT(config.model, config.kernel).eval()
        self.view = "init"
        self.effective_format = config.weight_format
        self.weight_version = config.weight_version
        self.load_weights(
            weights if weights is not None else self.model.state_dict(), view, config.weight_version
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
        missing = set(self.model.state_dict()) ^ set(emulated)
        if missing:
            raise ValueError(f"weights do not match the model: {sorted(missing)[:4]}")
        for name, t in emulated.items():
            if t.shape != self.model.state_dict()[name].shape:
                raise ValueError(
                    f"{name}: shape {tuple(t.shape)} != model {tuple(self.model.state_dict()[name].shape)}"
                )
        with torch.no_grad():
            self.model.load_state_dict(emulated, strict=True)
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

    async def submit(self, req: GenRequest) -> GenRequest:
        req.future = asyncio.get_running_loop().create_future()
        seed = req.seed if req.seed is not None else self._rng.getrandbits(63)
        req.generator = torch.Generator().manual_seed(int(seed))
        self.stats.requests_total += 1
        self.stats.prompt_tokens_total += len(req.input_ids)
        if req.max_new_tokens == 0:
            req.finish = {"type": "length", "length": 0}
            return req
        self.waiting.append(req)
        self._wake.set()
        try:
            return await req.future
        except asyncio.CancelledError:
            req.cancelled = True
            raise

    def abort_all(self, message: str) -> int:
        """Finish every waiting and running request now with finish_reason abort (partial output kept).
        Call from the event loop while holding `lock` (never during a step)."""
        victims = list(self.waiting) + list(self.running)
        self.waiting.clear()
        self.running = []
        for req in victims:
            req.finish = {"type": "abort", "message": message}
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
        admitted = []
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            if req.cancelled:
                continue
            req.slot = self.free_slots.pop()
            self.cache.reset([req.slot])
            admitted.append(req)
        return admitted

    @torch.no_grad()
    def _step(self, admitted: list[GenRequest]) -> tuple[int, list[GenRequest]]:
        """One scheduler step (worker thread): prefill the admitted, sample one token for every running
        request, then one batched forward for the unfinished ones. Returns (tokens produced, finished
        requests); their futures are resolved on the event loop by the caller."""
        version = self.weight_version
        for req in admitted:  # ragged prompts: one prefill each
            logits = self.model(torch.tensor([req.input_ids]), self.cache, torch.tensor([req.slot]))
            req.next_logits, req.next_version = logits[0, -1], version
        for req in [r for r in self.running if r.cancelled]:
            req.finish = {"type": "abort", "message": "client disconnected"}
            self._release(req)
        self.running = [r for r in self.running if not r.cancelled]
        self.running.extend(admitted)
        if not self.running:
            return 0, []
        batch = self.running
        logits = torch.stack([r.next_logits for r in batch])  # [B, V]
        uniforms = torch.cat([torch.rand(1, generator=r.generator) for r in batch])
        res = sample(logits, [r.params for r in batch], uniforms)
        now = time.monotonic()
        capacity = min(self.cache.capacity, self.config.model.max_seq_len)
        still: list[GenRequest] = []
        finished: list[GenRequest] = []
        for b, req in enumerate(batch):
            self._record(req, res, b)
            if req.first_token_at is None:
                req.first_token_at = now
            tok = req.out_ids[-1]
            if tok in req.stop_token_ids:
                req.finish = {"type": "stop", "matched": tok}
            elif len(req.out_ids) >= req.max_new_tokens:
                req.finish = {"type": "length", "length": len(req.out_ids)}
            elif len(req.input_ids) + len(req.out_ids) >= capacity:
                req.finish = {"type": "length", "length": len(req.out_ids)}
            else:
                still.append(req)
                continue
            self._release(req)
            finished.append(req)
        if still:
            rows = torch.tensor([r.slot for r in still])
            nxt = torch.tensor([[r.out_ids[-1]] for r in still])
            step_logits = self.model(nxt, self.cache, rows)[:, 0]  # [B', V]
            for i, req in enumerate(still):
                req.next_logits, req.next_version = step_logits[i], version
        self.running = still
        return len(batch), finished

    @staticmethod
    def _record(req: GenRequest, res: Any, b: int) -> None:
        tok = int(res.token_ids[b])
        req.out_ids.append(tok)
        req.out_logprobs.append(float(res.logprobs[b]))
        req.versions.append(req.next_version)
        if req.return_mask:
            m = int(res.kept[b])
            req.masks.append(res.sorted_ids[b, :m].tolist())
            req.mask_logprobs.append(res.kept_logprobs[b, :m].tolist())
        if req.top_logprobs_num:
            k = req.top_logprobs_num
            req.heads.append(
                [
                    [lp, i, None]
                    for lp, i in zip(
                        res.sorted_logprobs[b, :k].tolist(), res.sorted_ids[b, :k].tolist(), strict=True
                    )
                ]
            )

    def _release(self, req: GenRequest) -> None:
        if req.slot >= 0:
            self.free_slots.append(req.slot)
            req.slot = -1
        req.next_logits = None
        self.stats.record_finish(req, time.monotonic())

    @staticmethod
    def _resolve(req: GenRequest) -> None:
        if req.future is not None and not req.future.done():
            req.future.set_result(req)

    # ------------------------------------------------------------------------------------ output
    def response(self, req: GenRequest) -> dict[str, Any]:
        """The SGLang /generate JSON for a finished request."""
        n = len(req.out_ids)
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish,
            "prompt_tokens": len(req.input_ids),
            "weight_version": str(req.versions[-1] if req.versions else self.weight_version),
            "completion_tokens": n,
            "cached_tokens": 0,
            "e2e_latency": round(time.monotonic() - req.created, 6),
            "output_token_logprobs": [
                [lp, t, None] for lp, t in zip(req.out_logprobs, req.out_ids, strict=True)
            ],
            "output_token_weight_versions": list(req.versions),  # rlfleet extension: per-token versions
        }
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = req.heads
        if req.return_mask:
            meta["output_token_sampling_mask"] = req.masks
            meta["output_token_sampling_logprobs"] = req.mask_logprobs
            meta["output_token_sampling_mask_length"] = [len(m) for m in req.masks]
        # No tokenizer in the reference engine: text is "" (token-in/token-out is the contract anyway).
        return {"text": "", "output_ids": list(req.out_ids), "meta_info": meta}


@dataclass
class EngineStats:
    """Counters and windows behind /metrics (SGLang metric names are applied in server.py)."""

    requests_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_running: int = 0
    num_waiting: int = 0
    finished: deque = field(default_factory=lambda: deque(maxlen=4096))  # (ttft, e2e) awaiting export
    window: deque = field(default_factory=lambda: deque(maxlen=256))  # (time, tokens) of recent steps

    def record_step(self, produced: int, running: int, waiting: int) -> None:
        self.generation_tokens_total += produced
        self.num_running, self.num_waiting = running, waiting
        self.window.append((time.monotonic(), produced))

    def record_finish(self, req: GenRequest, now: float) -> None:
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
    trainer_model: TinyGPT,
    sampler_model: TinyGPT,
    kv_cache_dtype: str,
    input_ids: torch.Tensor,
    prompt_len: int,
) -> float:
    """Mean KL(q || p) over the continuation positions, with the sampler running its KV-cached decode
    path (prefill the prompt, then one token at a time, as the engine does) and the trainer its plain
    full-sequence forward. input_ids [B, S]."""
    with torch.no_grad():
        p_logits = trainer_model(input_ids)  # [B, S, V]
        cache = sampler_model.new_cache(input_ids.shape[0], kv_dtype=kv_cache_dtype)
        rows = torch.arange(input_ids.shape[0])
        q_parts = [sampler_model(input_ids[:, :prompt_len], cache, rows)]
        for t in range(prompt_len, input_ids.shape[1]):
            q_parts.append(sampler_model(input_ids[:, t : t + 1], cache, rows))
        q_logits = torch.cat(q_parts, 1)
        kl = kl_q_p(q_logits[:, prompt_len - 1 :], p_logits[:, prompt_len - 1 :])
    return float(kl.mean())


__all__ = [
    "EngineConfig",
    "GenRequest",
    "KV_CACHE_DTYPES",
    "ReferenceEngine",
    "WEIGHT_FORMATS",
    "kl_q_p",
    "measure_kl",
]
