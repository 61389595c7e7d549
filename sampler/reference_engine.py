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
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from rlfleet.numerics.engine_model import EngineModel, KernelConfig, ModelShape, precision_view
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
            rows.extend(self.model(nxt, self.cache, slots)[:, 0])  # [B, V]
            self._capture_routing(self.running)
        for req in admitted:  # ragged prompts: one prefill each
            rows.append(
                self.model(torch.tensor([req.input_ids]), self.cache, torch.tensor([req.slot]))[0, -1]
            )
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
    "ReferenceEngine",
    "WEIGHT_FORMATS",
    "kl_q_p",
    "measure_kl",
]
