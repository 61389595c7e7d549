"""`rlfleet sampler serve`: the reference sampler server (an SGLang 0.5.23 emulator) or the real SGLang launcher.

`--engine reference` serves the reference engine (reference_engine.py: a Qwen3 checkpoint on CPU) over a real aiohttp
HTTP server speaking the part of SGLang 0.5.23's API rlfleet uses, with SGLang's keys, shapes,
defaults, validation order, error bodies, status codes and metrics (each checked against SGLang's own
code in tests/sglang_contract/test_sglang_reference_sampler.py; docs/sampler.md lists what):

  POST /generate                  single or batched input_ids; same response (text is "": no tokenizer)
  GET  /health, /health_generate   liveness; a one-token generation (not counted in metrics)
  GET  /model_info, /server_info   model path, weight_version, server args (sampling_mask_max_tokens ...)
  GET  /metrics                    Prometheus text: SGLang's metric names, labels and counting
  POST /update_weights_from_disk   {model_path, weight_version, flush_cache, abort_all_requests}
  POST /pause_generation, /continue_generation, /flush_cache

Errors are SGLang's, stage by stage (srt/entrypoints/http_server.py): a body FastAPI cannot parse into
GenerateReqInput -> 400 ErrorResponse {object: "error", message, type: "Bad Request", param, code};
a body the JSON contract gate refuses -> 400 {"error": "<text>"}; a ValueError of normalisation,
SamplingParams.verify, the tokenizer manager or a 400 scheduler abort (sampling-mask rule, a realised
support over --sampling-mask-max-tokens) -> 400 {"error": {"message"}}; a 500 abort (a sampled token
outside the captured support) -> 500 ErrorResponse with type "500". rlfleet extensions: 409 when the
`X-Min-Weight-Version` header is ahead of the served version (our router's contract), and input_ids
outside the vocabulary are a 400 (SGLang does not check them). With `--api-key`, everything except
/health, /health_generate and /metrics needs `Authorization: Bearer` (401 {"error": "Unauthorized"}).

`--engine sglang` builds the production command line with `rlfleet.catalog.sglang_launch` and execs
`python -m sglang.launch_server ...` (SGLang is only in the sampler image; here only the argv is tested).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, ValidationError

log = logging.getLogger("rlfleet.sampler.server")

MIN_VERSION_HEADER = "X-Min-Weight-Version"
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
SERVER_VERSION = "0.5.23-rlfleet-reference"

# The sampling_params fields SGLang 0.5.23's JSON contract gate admits (sglang.api.v1.api_types, whose
# unknown-field error lists them in this order; the contract test compares the text).
CONTRACT_SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)  # fmt: skip
# Fields the reference engine honours; the rest are accepted only at SGLang's defaults (it applies them).
_NEUTRAL_SAMPLING = {
    "stop": None, "stop_regex": None, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None, "logit_bias": None, "custom_params": None, "beam_width": None,
    "watermark": None, "choice": None,
}  # fmt: skip
_INT_SAMPLING = (
    "max_new_tokens",
    "top_k",
    "min_new_tokens",
    "n",
    "sampling_seed",
    "stream_interval",
    "beam_width",
)
_FLOAT_SAMPLING = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_BOOL_SAMPLING = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_BOOL_FIELDS = ("return_logprob", "return_sampling_mask", "stream", "return_text_in_logprobs", "log_metrics")
_INT_FIELDS = ("top_logprobs_num", "logprob_start_len")


# ------------------------------------------------------------------------------------ errors
class RequestError(Exception):
    """A refused request: `body` and `status` exactly as SGLang answers it."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(str(body))
        self.status, self.body = status, body

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return web.json_response(self.body, status=self.status, headers=headers)


def value_error(message: str, status: int = 400) -> RequestError:
    """A ValueError (or a 400 abort) caught by /generate: `_create_error_response`."""
    return RequestError(status, {"error": {"message": message}})


def error_response(status: int, message: str, type_: str | None = None) -> RequestError:
    """SGLang's ErrorResponse (protocol.py), as its HTTPException / RequestValidationError handlers
    send it: type is str(status) for an HTTPException, the status phrase for a validation error."""
    return RequestError(
        status,
        {"object": "error", "message": message, "type": type_ or str(status), "param": None, "code": status},
    )


def contract_error(message: str) -> RequestError:
    return RequestError(400, {"error": message})


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return value_error(message, status).response(headers)


# ------------------------------------------------------------------------------------ request gate
SamplingLogprobsMode = Literal["selected", "support"]


class GenerateBody(BaseModel):
    """The GenerateReqInput fields the reference server reads, with GenerateReqInput's (lax) types:
    what FastAPI's parse refuses is refused here with the same status and body shape."""

    model_config = ConfigDict(extra="allow")
    text: list[str] | str | None = None
    input_ids: list[list[int]] | list[int] | None = None
    sampling_params: list[dict[str, Any]] | dict[str, Any] | None = None
    return_logprob: list[bool] | bool | None = None
    logprob_start_len: list[int] | int | None = None
    top_logprobs_num: list[int] | int | None = None
    return_sampling_mask: list[bool] | bool | None = None
    sampling_logprobs_mode: list[SamplingLogprobsMode | None] | SamplingLogprobsMode | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    rid: list[str] | str | None = None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _unexpected(value: object) -> str:
    """How the contract gate's (serde) decoder names an unexpected JSON value."""
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f"string {json.dumps(value)}"
    return "sequence" if isinstance(value, list) else "map" if isinstance(value, dict) else "null"


def _check_contract(raw: dict[str, Any]) -> None:
    """The JSON contract gate's strict types (no "yes" for a bool, no 1.5 or 2.0 for an int) and its
    closed set of sampling_params fields."""

    def check(value: object, ok: bool, expected: str) -> None:
        if not ok:
            raise contract_error(f"invalid type: {_unexpected(value)}, expected {expected}")

    for name in _BOOL_FIELDS:
        v = raw.get(name)
        if v is not None:
            check(v, isinstance(v, bool) or (isinstance(v, list) and all(isinstance(x, bool) for x in v)),
                  "a value or an array of values for BoolOrList")  # fmt: skip
    for name in _INT_FIELDS:
        v = raw.get(name)
        if v is not None:
            check(v, _is_int(v) or (isinstance(v, list) and all(_is_int(x) for x in v)), "i64")
    sps = raw.get("sampling_params")
    for sp in sps if isinstance(sps, list) else [sps] if sps is not None else []:
        for key, v in sp.items():
            if key not in CONTRACT_SAMPLING_FIELDS:
                expected = ", ".join(f"`{f}`" for f in CONTRACT_SAMPLING_FIELDS)
                raise contract_error(f"unknown field `{key}`, expected one of {expected}")
            if v is None:
                continue
            if key in _INT_SAMPLING:
                check(v, _is_int(v), "i64")
            elif key in _FLOAT_SAMPLING:
                check(v, isinstance(v, int | float) and not isinstance(v, bool), "f64")
            elif key in _BOOL_SAMPLING:
                check(v, isinstance(v, bool), "a boolean")
            elif key == "stop_token_ids":
                check(v, isinstance(v, list) and all(_is_int(x) for x in v), "a sequence of i64")


@dataclass
class ItemRequest:
    """One normalised request of a (possibly batched) /generate body."""

    input_ids: list[int]
    sampling: dict[str, Any]
    return_logprob: bool
    top_logprobs_num: int
    return_sampling_mask: bool
    sampling_logprobs_mode: str | None
    rid: str | None
    log_metrics: bool


def _per_item(value: Any, i: int, default: Any) -> Any:
    if isinstance(value, list):
        return value[i] if i < len(value) else default
    return default if value is None else value


def normalise_generate(body: GenerateBody) -> tuple[list[ItemRequest], bool]:
    """GenerateReqInput.normalize_batch_and_arguments, for input_ids (single or batched)."""
    if body.input_ids is None:
        if body.text is not None:
            raise value_error("the reference server has no tokenizer: send input_ids, not text")
        raise value_error("Either text, input_ids or input_embeds should be provided.")
    batched = bool(body.input_ids) and isinstance(body.input_ids[0], list)
    rows: list[list[int]] = body.input_ids if batched else [body.input_ids]  # type: ignore[assignment]
    if not batched and not rows[0]:
        raise value_error("input_ids cannot be empty.")
    items = []
    for i, ids in enumerate(rows):
        sp = body.sampling_params
        sampling = (sp[i] if i < len(sp) else {}) if isinstance(sp, list) else dict(sp or {})
        items.append(
            ItemRequest(
                input_ids=list(ids),
                sampling=dict(sampling),
                return_logprob=bool(_per_item(body.return_logprob, i, False)),
                top_logprobs_num=int(_per_item(body.top_logprobs_num, i, 0)),
                return_sampling_mask=bool(_per_item(body.return_sampling_mask, i, False)),
                sampling_logprobs_mode=_per_item(body.sampling_logprobs_mode, i, None),
                rid=_per_item(body.rid, i, None),
                log_metrics=body.log_metrics,
            )
        )
    return items, batched


@dataclass
class CheckedSampling:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_new_tokens: int | None
    stop_token_ids: frozenset[int]
    sampling_seed: int | None


def verify_sampling(sp: dict[str, Any]) -> CheckedSampling:
    """SamplingParams.__post_init__ (None = default, temperature < 1e-6 = greedy, top_k -1 = all) and
    SamplingParams.verify, with SGLang's messages."""
    from rlfleet.sampler.sampling import SAMPLING_EPS, TOP_K_ALL

    def get(key: str, default: Any) -> Any:
        v = sp.get(key)
        return default if v is None else v

    # raw JSON numbers, not floats: SGLang's messages print the value as sent ("got 0.", "got 1.5.")
    temperature, top_p = get("temperature", 1.0), get("top_p", 1.0)
    top_k, min_p = get("top_k", -1), get("min_p", 0.0)
    if 0 <= temperature < SAMPLING_EPS:
        temperature, top_k = 1.0, 1
    if top_k == -1:
        top_k = TOP_K_ALL
    max_new_tokens = sp.get("max_new_tokens", 128)
    min_new_tokens = get("min_new_tokens", 0)
    if not math.isfinite(temperature) or temperature < 0.0:
        raise value_error(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise value_error(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise value_error(f"min_p must be in [0, 1], got {min_p}.")
    if top_k < 1 or top_k == -1:
        raise value_error(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if not 0 <= min_new_tokens:
        raise value_error(f"min_new_tokens must be in [0, max_new_tokens], got {min_new_tokens}.")
    if max_new_tokens is not None:
        if max_new_tokens < 0:
            raise value_error(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
        if not min_new_tokens <= max_new_tokens:
            raise value_error(
                f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], got {min_new_tokens}."
            )
    seed = sp.get("sampling_seed")
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
        raise value_error(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    for key, neutral in _NEUTRAL_SAMPLING.items():
        if sp.get(key) not in (None, neutral):
            raise value_error(f"sampling_params.{key} is not supported by the reference server")
    return CheckedSampling(
        float(temperature), float(top_p), int(top_k), float(min_p), max_new_tokens,
        frozenset(int(t) for t in sp.get("stop_token_ids") or ()), seed,
    )  # fmt: skip


def mask_rule_message(top_k: int, cap: int) -> str | None:
    """The scheduler's sampling-mask gate (srt/managers/scheduler.py), message verbatim."""
    if top_k != 1 and not (1 < top_k <= cap):
        return (
            "return_sampling_mask requires top_k=1 for greedy sampling "
            f"or finite 1 < top_k <= {cap}; got top_k={top_k}. Lower top_k or increase "
            "--sampling-mask-max-tokens."
        )
    return None


class UpdateWeightsIn(BaseModel):
    """UpdateWeightFromDiskReqInput's fields (weight_version: a string in SGLang; rlfleet versions are
    integers, so it must parse as one)."""

    model_config = ConfigDict(extra="ignore")
    model_path: str
    weight_version: str | int | None = None
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    keep_pause: bool = False


# ------------------------------------------------------------------------------------ metrics
class ServerMetrics:
    """SGLang's metric names, label names and counting on a private registry (several servers may share
    a process in tests). Gauges and realtime_tokens_total are the scheduler's (labels model_name,
    engine_type, tp_rank, pp_rank, moe_ep_rank); the request counters and latency histograms are the
    tokenizer manager's (model_name, engine_type, is_streaming), counted when a request finishes."""

    TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
    E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
                   1200, 1800, 2400)  # fmt: skip

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.sched = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0",
                      "moe_ep_rank": "0"}  # fmt: skip
        self.tok = {"model_name": model_name, "engine_type": "unified"}
        self.streamed = {**self.tok, "is_streaming": "false"}
        s, t = list(self.sched), [*self.tok, "is_streaming"]
        self.gen_throughput = Gauge(
            "sglang:gen_throughput", "The generation throughput (token/s).", s, registry=r
        )
        self.num_running = Gauge("sglang:num_running_reqs", "The number of running requests.", s, registry=r)
        self.num_queue = Gauge(
            "sglang:num_queue_reqs", "The number of requests in the waiting queue.", s, registry=r
        )
        self.token_usage = Gauge("sglang:token_usage", "The token usage.", s, registry=r)
        self.cache_hit_rate = Gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", s, registry=r)
        self.realtime_tokens = Counter(
            "sglang:realtime_tokens",
            "Total number of tokens processed (updated on each log interval). "
            "mode: prefill_compute, prefill_cache, decode.",
            [*s, "mode"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", t, registry=r
        )
        self.gen_tokens = Counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", t, registry=r
        )
        self.num_requests = Counter("sglang:num_requests", "Number of requests processed.", t, registry=r)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", t,
            registry=r, buckets=self.TTFT_BUCKETS,
        )  # fmt: skip
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", t,
            registry=r, buckets=self.E2E_BUCKETS,
        )  # fmt: skip
        self._exported = {"gen": 0, "prompt": 0, "req": 0, "rt_prefill": 0, "rt_decode": 0}

    def refresh(self, engine: Any) -> None:
        st = engine.stats
        sched, streamed = self.sched, self.streamed
        self.gen_throughput.labels(**sched).set(st.gen_throughput())
        self.num_running.labels(**sched).set(len(engine.running))
        self.num_queue.labels(**sched).set(len(engine.waiting))
        slots = engine.config.max_running_requests
        self.token_usage.labels(**sched).set((slots - len(engine.free_slots)) / slots)
        self.cache_hit_rate.labels(**sched).set(0.0)
        for key, total, counter in (
            ("gen", st.generation_tokens_total, self.gen_tokens.labels(**streamed)),
            ("prompt", st.prompt_tokens_total, self.prompt_tokens.labels(**streamed)),
            ("req", st.requests_total, self.num_requests.labels(**streamed)),
            ("rt_prefill", st.realtime_prefill_tokens, self.realtime_tokens.labels(**sched, mode="prefill_compute")),
            ("rt_decode", st.realtime_decode_tokens, self.realtime_tokens.labels(**sched, mode="decode")),
        ):  # fmt: skip
            counter.inc(total - self._exported[key])
            self._exported[key] = total
        while st.finished:
            ttft, e2e = st.finished.popleft()
            if ttft is not None:
                self.ttft.labels(**streamed).observe(ttft)
            self.e2e.labels(**streamed).observe(e2e)


# ------------------------------------------------------------------------------------ the app
@dataclass
class ServerSettings:
    api_key: str | None = None
    model_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 0


def build_app(engine: Any, settings: ServerSettings | None = None) -> web.Application:
    """The aiohttp application around a ReferenceEngine (thin handlers: validate, call, shape JSON)."""
    from rlfleet.sampler.protocol import dumps_json
    from rlfleet.sampler.reference_engine import GenRequest
    from rlfleet.sampler.sampling import RowParams

    settings = settings or ServerSettings()
    metrics = ServerMetrics(engine.config.served_model_name)
    cfg = engine.config

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if settings.api_key and request.path not in OPEN_PATHS:
            scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                presented.encode(), settings.api_key.encode()
            ):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def read_json(request: web.Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            # FastAPI answers an undecodable body as a RequestValidationError (json_invalid)
            body = error_response(400, "body is not valid JSON", "Bad Request").body
            raise web.HTTPBadRequest(text=json.dumps(body), content_type="application/json") from None

    def gate(raw: Any) -> tuple[list[GenRequest], bool]:
        """SGLang's /generate gate in its order; raises RequestError."""
        if not isinstance(raw, dict):
            raise error_response(400, f"body must be a JSON object, got {type(raw).__name__}", "Bad Request")
        try:
            body = GenerateBody.model_validate(raw)
        except ValidationError as exc:
            raise error_response(400, str(exc), "Bad Request") from None
        _check_contract(raw)
        items, batched = normalise_generate(body)
        if body.stream:
            raise value_error("stream=true is not supported by the reference server")
        for name, neutral in (("logprob_start_len", -1), ("return_text_in_logprobs", False),
                              ("token_ids_logprob", None), ("return_hidden_states", False)):  # fmt: skip
            value = raw.get(name)
            if value not in (None, neutral, []) and not (
                isinstance(value, list) and all(v in (None, neutral) for v in value)
            ):
                raise value_error(f"{name} is not supported by the reference server")
        vocab, context_len = cfg.model.vocab_size, cfg.model.max_position_embeddings
        reqs = []
        for item in items:
            if any(i < 0 or i >= vocab for i in item.input_ids):
                raise value_error(f"input_ids must be token ids in [0, {vocab})")
            n_in = len(item.input_ids)
            if n_in >= context_len:  # tokenizer_manager._validate_one_request
                raise value_error(
                    f"The input ({n_in} tokens) is longer than the model's context length ({context_len} tokens)."
                )
            max_new = item.sampling.get("max_new_tokens")
            if max_new is not None and max_new + n_in > context_len:
                raise value_error(
                    f"Requested token count exceeds the model's maximum context length "
                    f"of {context_len} tokens. You requested a total of {max_new + n_in} "
                    f"tokens: {n_in} tokens from the input messages and "
                    f"{max_new} tokens for the completion. Please reduce the number "
                    f"of tokens in the input messages or the completion to fit within the limit."
                )
            sp = verify_sampling(item.sampling)
            if item.sampling_logprobs_mode is not None and not item.return_sampling_mask:
                raise value_error("sampling_logprobs_mode can only be set when return_sampling_mask=true.")
            if item.return_sampling_mask:
                message = mask_rule_message(sp.top_k, cfg.sampling_mask_max_tokens)
                if message:
                    raise value_error(message)
            req = GenRequest(
                input_ids=item.input_ids,
                params=RowParams(sp.temperature, sp.top_p, sp.top_k, sp.min_p),
                max_new_tokens=sp.max_new_tokens if sp.max_new_tokens is not None else context_len - n_in,
                stop_token_ids=sp.stop_token_ids,
                return_logprob=item.return_logprob,
                return_mask=item.return_sampling_mask,
                logprob_mode=item.sampling_logprobs_mode or "selected",
                top_logprobs_num=min(max(item.top_logprobs_num, 0), vocab) if item.return_logprob else 0,
                seed=sp.sampling_seed,
                log_metrics=item.log_metrics,
            )
            if item.rid:
                req.rid = item.rid
            reqs.append(req)
        return reqs, batched

    async def generate(request: web.Request) -> web.Response:
        raw = await read_json(request)
        try:
            reqs, batched = gate(raw)
        except RequestError as exc:
            return exc.response()
        min_version = request.headers.get(MIN_VERSION_HEADER)
        if min_version is not None:
            try:
                wanted = int(min_version)
            except ValueError:
                return _error(400, f"{MIN_VERSION_HEADER} must be an integer")
            if wanted > engine.weight_version:
                return _error(
                    409,
                    f"serving weight version {engine.weight_version} < requested {wanted}",
                    {"Retry-After": "1"},
                )
        await asyncio.gather(*(engine.submit(req) for req in reqs))
        for req in reqs:  # an abort with a status is the request's HTTP error (tokenizer_manager)
            status = req.error_status
            if status == 400:
                return value_error(req.finish["message"]).response()
            if status is not None:
                return error_response(status, req.finish["message"]).response()
        outs = [engine.response(req) for req in reqs]
        return web.Response(body=dumps_json(outs if batched else outs[0]), content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(request: web.Request) -> web.Response:
        req = GenRequest(
            input_ids=[0],
            params=RowParams(0.0, 1.0, 1, 0.0),
            max_new_tokens=1,
            stop_token_ids=frozenset(),
            log_metrics=False,
        )
        try:
            await asyncio.wait_for(engine.submit(req), timeout=20)
        except TimeoutError:
            return web.Response(status=503, text="generation timed out")
        return web.Response(status=200)

    def _weight_version() -> str:
        return str(engine.weight_version)

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": settings.model_path or cfg.model_path or f"tiny-qwen3-seed{cfg.seed}",
                "served_model_name": cfg.served_model_name,
                "tokenizer_path": None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": _weight_version(),
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "qwen3",
                "architectures": ["Qwen3ForCausalLM"],
                "vocab_size": cfg.model.vocab_size,
                "weight_format": engine.effective_format,
                "kv_cache_dtype": cfg.kv_cache_dtype,
            }
        )

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": settings.model_path or cfg.model_path,
                "served_model_name": cfg.served_model_name,
                "host": settings.host,
                "port": settings.port,
                "tp_size": 1,
                "dtype": "bfloat16",
                "quantization": None
                if engine.effective_format in ("bf16", "fp32")
                else engine.effective_format,
                "kv_cache_dtype": cfg.kv_cache_dtype,
                "sampling_mask_max_tokens": cfg.sampling_mask_max_tokens,
                "sampling_backend": cfg.sampling_backend,
                "max_running_requests": cfg.max_running_requests,
                "context_length": cfg.model.max_position_embeddings,
                "weight_version": _weight_version(),
                "enable_metrics": True,
                "version": SERVER_VERSION,
                "rlfleet_engine": "reference",
                "kernel": {"act_dtype": cfg.kernel.act_dtype, "split_k": cfg.kernel.split_k},
                "max_tokens_per_second": cfg.max_tokens_per_second,
                "internal_states": [{"paused": engine.paused, "num_running_reqs": len(engine.running)}],
            }
        )

    async def metrics_handler(request: web.Request) -> web.Response:
        metrics.refresh(engine)
        return web.Response(
            body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def update_weights_from_disk(request: web.Request) -> web.Response:
        try:
            body = UpdateWeightsIn.model_validate(await read_json(request))
        except ValidationError as exc:
            return error_response(400, str(exc), "Bad Request").response()
        try:  # no weight_version: the version stays (SGLang updates it only when one is given)
            version = engine.weight_version if body.weight_version is None else int(body.weight_version)
            if version < 0:
                raise ValueError
        except ValueError:
            return web.json_response(
                {
                    "success": False,
                    "message": f"weight_version must be a non-negative integer, got {body.weight_version!r}",
                },
                status=400,
            )
        from rlfleet.numerics.engine_model import load_checkpoint

        try:  # load and check fully before touching the engine: a failure leaves the old weights serving
            view, shape, weights = await asyncio.to_thread(load_checkpoint, body.model_path)
            if shape != cfg.model:
                raise ValueError(f"its architecture {shape} differs from the served model's {cfg.model}")
        except (OSError, ValueError, KeyError) as exc:
            return web.json_response(
                {"success": False, "message": f"failed to load {body.model_path}: {exc}"}, status=400
            )
        async with engine.lock:  # between two scheduler steps
            if body.abort_all_requests:
                engine.abort_all("Abort all requests before updating weights.")
            try:
                engine.load_weights(weights, view, version)
            except ValueError as exc:
                return web.json_response({"success": False, "message": str(exc)}, status=400)
            settings.model_path = body.model_path
        log.info("weights %s (view %s) -> version %d", body.model_path, view, version)
        message = "Succeeded to update model weights."
        if body.weight_version is not None:
            message += f" Weight version updated to {body.weight_version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def pause_generation(request: web.Request) -> web.Response:
        raw = await read_json(request) if request.can_read_body else {}
        mode = (raw or {}).get("mode", "abort") if isinstance(raw, dict) else "abort"
        if mode not in ("abort", "retract", "in_place"):
            return _error(400, f"mode must be abort, retract or in_place, got {mode!r}")
        async with engine.lock:
            engine.pause()
            if mode == "abort":
                engine.abort_all("generation paused (mode=abort)")
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(request: web.Request) -> web.Response:
        engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(request: web.Request) -> web.Response:
        return web.Response(  # no prefix cache in the reference engine: nothing to flush
            text="Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )

    app = web.Application(middlewares=[auth], client_max_size=64 * 1024 * 1024)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/model_info", model_info)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_route("*", "/flush_cache", flush_cache)

    async def on_startup(app: web.Application) -> None:
        engine.start()

    async def on_cleanup(app: web.Application) -> None:
        await engine.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app["engine"] = engine
    return app


class RunningServer:
    """An in-process reference server bound to host:port (port 0 = a free port)."""

    def __init__(self, engine: Any, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> RunningServer:
        app = build_app(self.engine, self.settings)
        # handler_cancellation: a client that disconnects cancels its handler, and the engine frees the
        # request's slot at the next step (aiohttp >= 3.9 does not cancel by default)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.settings.port = sock.getsockname()[1]
        self.url = f"http://{self.settings.host}:{self.settings.port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> RunningServer:
        return self if self._runner is not None else await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def start_reference_server(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    model_path: str | None = None,
) -> RunningServer:
    return await RunningServer(
        engine, ServerSettings(api_key=api_key, model_path=model_path, host=host, port=port)
    ).start()


# ------------------------------------------------------------------------------------ CLI
class CliError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlfleet sampler serve", description="Serve a sampler: reference engine or real SGLang."
    )
    p.add_argument("--engine", choices=("reference", "sglang"), default="reference")
    p.add_argument("--host", default=None, help="default 127.0.0.1 (reference) / 0.0.0.0 (sglang, in a pod)")
    p.add_argument(
        "--port", type=int, default=30000, help="0 = any free port (printed, and written to --port-file)"
    )
    p.add_argument("--port-file", help="write the bound port here once listening")
    p.add_argument(
        "--model-path",
        help="Hugging Face checkpoint or weight view directory (Qwen3); reference default: the tiny Qwen3 "
        "(rlfleet/tiny_qwen3.py) initialised from --seed",
    )
    p.add_argument("--served-model-name", default="tiny-qwen3")
    p.add_argument(
        "--weight-format",
        default="bf16",
        help="reference: fp32|bf16|fp8|fp8_block|nvfp4|mxfp4; sglang: bf16|fp8|nvfp4|mxfp4",
    )
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--weight-version", type=int, default=0)
    p.add_argument("--sampling-mask-max-tokens", type=int, default=4096)
    p.add_argument(
        "--sampling-backend",
        choices=("pytorch", "flashinfer"),
        default="pytorch",
        help="reference: whose kept sets to emulate (SGLang's CPU pytorch path, or its CUDA flashinfer path)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("RLFLEET_SAMPLER_API_KEY"),
        help="bearer token (env RLFLEET_SAMPLER_API_KEY)",
    )
    ref = p.add_argument_group("reference engine")
    ref.add_argument("--seed", type=int, default=0)
    ref.add_argument("--vocab-size", type=int, default=64, help="tiny Qwen3 without --model-path")
    ref.add_argument("--hidden-size", type=int, default=128, help="tiny Qwen3 without --model-path")
    ref.add_argument("--num-hidden-layers", type=int, default=2, help="tiny Qwen3 without --model-path")
    ref.add_argument("--num-attention-heads", type=int, default=2, help="tiny Qwen3 without --model-path")
    ref.add_argument("--head-dim", type=int, default=64, help="tiny Qwen3 without --model-path")
    ref.add_argument("--context-length", type=int, default=256, help="tiny Qwen3 without --model-path")
    ref.add_argument("--kernel-act-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ref.add_argument("--kernel-split-k", type=int, default=1)
    ref.add_argument("--max-running-requests", type=int, default=32)
    ref.add_argument(
        "--max-tokens-per-second", type=float, default=None, help="throttle (emulates a slower GPU)"
    )
    ref.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    sg = p.add_argument_group("sglang engine")
    sg.add_argument("--accelerator", help="catalog class (a100, h100, h200, b200, b300, rtx-pro-6000)")
    sg.add_argument("--tensor-parallel", type=int, default=None)
    sg.add_argument("--python", default=sys.executable)
    sg.add_argument(
        "--print-argv", action="store_true", help="print the SGLang command line instead of exec'ing it"
    )
    sg.add_argument("extra", nargs=argparse.REMAINDER, help="after --: extra SGLang arguments")
    return p


def sglang_argv(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The SGLang launch command line and env for these CLI args (via rlfleet.catalog)."""
    if not args.accelerator:
        raise CliError("--engine sglang needs --accelerator (a catalog class, e.g. h100)")
    if not args.model_path:
        raise CliError("--engine sglang needs --model-path")
    try:
        from rlfleet import catalog
    except ImportError as exc:
        raise CliError(f"rlfleet.catalog unavailable: {exc}") from None
    extra = [a for a in (args.extra or []) if a != "--"]
    try:
        accel = catalog.get_catalog().get(args.accelerator)
        launch = catalog.sglang_launch(
            accelerator=accel,
            weight_format=args.weight_format,
            kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel=args.tensor_parallel,
            extra_args=tuple(extra),
            model_path=args.model_path,
            served_model_name=args.served_model_name,
            host=args.host,
            port=args.port,
            sampling_mask_max_tokens=args.sampling_mask_max_tokens,
            weight_version=args.weight_version,
            python=args.python,
        )
    except (KeyError, ValueError) as exc:
        raise CliError(str(exc).strip("'\"")) from None
    argv = list(launch.argv)
    if args.api_key and "--api-key" not in argv:
        argv += ["--api-key", args.api_key]
    return argv, dict(launch.env)


def _reference_engine(args: argparse.Namespace) -> tuple[Any, str]:
    import torch

    from rlfleet.numerics.engine_model import KernelConfig, load_checkpoint
    from rlfleet.sampler.reference_engine import EngineConfig, ReferenceEngine, tiny_shape

    torch.set_num_threads(max(1, args.threads))
    weights, view = None, "fp32"
    if args.model_path:
        try:
            view, model_cfg, weights = load_checkpoint(args.model_path)
        except (OSError, ValueError, KeyError) as exc:
            raise CliError(f"cannot load --model-path {args.model_path}: {exc}") from None
    else:
        try:
            model_cfg = tiny_shape(
                vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                num_hidden_layers=args.num_hidden_layers, num_attention_heads=args.num_attention_heads,
                num_key_value_heads=args.num_attention_heads, head_dim=args.head_dim,
                max_position_embeddings=args.context_length,
            )
        except ValueError as exc:
            raise CliError(str(exc)) from None
    cfg = EngineConfig(
        model=model_cfg,
        weight_format=args.weight_format,
        kv_cache_dtype=args.kv_cache_dtype,
        kernel=KernelConfig(act_dtype=args.kernel_act_dtype, split_k=args.kernel_split_k),
        max_running_requests=args.max_running_requests,
        max_tokens_per_second=args.max_tokens_per_second,
        sampling_mask_max_tokens=args.sampling_mask_max_tokens,
        sampling_backend=args.sampling_backend,
        weight_version=args.weight_version,
        served_model_name=args.served_model_name,
        model_path=args.model_path,
        seed=args.seed,
    )
    return ReferenceEngine(cfg, weights, view), view


async def _serve(engine: Any, args: argparse.Namespace) -> None:
    server = await start_reference_server(engine, args.host, args.port, args.api_key, args.model_path)
    print(f"rlfleet reference sampler listening on {server.url}", flush=True)
    if args.port_file:
        Path(args.port_file).write_text(str(server.settings.port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def cli(argv: Sequence[str]) -> int:
    parser = _parser()
    args = parser.parse_args(list(argv))
    if args.host is None:
        args.host = "0.0.0.0" if args.engine == "sglang" else "127.0.0.1"
    try:
        if args.engine == "sglang":
            argv_out, env = sglang_argv(args)
            if args.print_argv:
                print(" ".join(argv_out))
                return 0
            os.execvpe(argv_out[0], argv_out, {**os.environ, **env})
        try:
            engine, _ = _reference_engine(args)
        except ValueError as exc:  # bad model / engine settings
            raise CliError(str(exc)) from None
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        asyncio.run(_serve(engine, args))
    except CliError as exc:
        print(f"rlfleet sampler serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. port in use
        print(f"rlfleet sampler serve: {exc}", file=sys.stderr)
        return 1
    return 0
