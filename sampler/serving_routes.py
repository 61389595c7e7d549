"""The reference server's serving endpoints (thin handlers: validate, call the engine, shape SGLang's JSON):

  POST /generate                  single or batched input_ids; same response (text is "": no tokenizer);
                                  `lora_path`: the request's adapter(s) by name (docs/sampler.md, "LoRA")
  GET  /v1/models                  the served model and, with --enable-lora, each loaded adapter
  GET  /health, /health_generate   liveness; a one-token generation (not counted in metrics)
  GET  /model_info, /server_info   model path, weight_version, server args (sampling_mask_max_tokens ...)
  GET  /metrics                    Prometheus text: SGLang's metric names, labels and counting

rlfleet extension: 409 when the `X-Min-Weight-Version` header is ahead of the served version (our
router's contract).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from rlfleet.sampler.protocol import dumps_json
from rlfleet.sampler.request_gate import gate_generate
from rlfleet.sampler.server_context import ENGINE, METRICS, SETTINGS, read_json
from rlfleet.sampler.sglang_errors import RequestError, error_json, error_response, value_error

MIN_VERSION_HEADER = "X-Min-Weight-Version"
SERVER_VERSION = "0.5.23-rlfleet-reference"


async def generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    raw = await read_json(request)
    try:
        reqs, batched = gate_generate(raw, engine.config)
    except RequestError as exc:
        return exc.response()
    try:
        lora_names = request_lora_names(raw.get("lora_path"), len(reqs), batched)
    except RequestError as exc:
        return exc.response()
    refused = version_refusal(request.headers.get(MIN_VERSION_HEADER), engine.weight_version)
    if refused is not None:
        return refused
    refs = []
    if lora_names is not None:  # SGLang's _validate_and_resolve_lora; the adapters are in flight from here
        try:
            refs = await engine.loras.acquire(lora_names)
        except ValueError as exc:
            return value_error(str(exc)).response()
    for req, ref in zip(reqs, refs, strict=False):
        req.lora = ref.adapter if ref is not None else None
    try:
        await asyncio.gather(*(engine.submit(req) for req in reqs))
    finally:  # finished, or the client went away: an unload waiting on these adapters may go on
        engine.loras.release(refs)
    for req in reqs:  # an abort with a status is the request's HTTP error (tokenizer_manager)
        status, finish = req.error_status, req.finish or {}
        if status == 400:
            return value_error(finish["message"]).response()
        if status is not None:
            return error_response(status, finish["message"]).response()
    outs = [engine.response(req) for req in reqs]
    return web.Response(body=dumps_json(outs if batched else outs[0]), content_type="application/json")


def version_refusal(min_version: str | None, served: int) -> web.Response | None:
    """rlfleet's router contract: 409 while the served version is behind `X-Min-Weight-Version`."""
    if min_version is None:
        return None
    try:
        wanted = int(min_version)
    except ValueError:
        return error_json(400, f"{MIN_VERSION_HEADER} must be an integer")
    if wanted > served:
        return error_json(409, f"serving weight version {served} < requested {wanted}", {"Retry-After": "1"})
    return None


def request_lora_names(lora_path: Any, n: int, batched: bool) -> list[str | None] | None:
    """The adapter name of each of the body's `n` requests (GenerateReqInput._normalize_lora_paths: one
    name for all, or one per request, null for the base); None when `lora_path` is empty (SGLang
    resolves no adapter then). A list of another length than the batch is refused (SGLang would fail
    on it later)."""
    if not lora_path:
        return None
    if isinstance(lora_path, str):
        return [lora_path] * n
    if not isinstance(lora_path, list) or not all(p is None or isinstance(p, str) for p in lora_path):
        raise value_error("lora_path should be a list or a string.")
    if len(lora_path) != n:
        what = "batch size" if batched else "a single request"
        raise value_error(f"lora_path list length ({len(lora_path)}) must match {what} ({n})")
    return list(lora_path)


async def available_models(request: web.Request) -> web.Response:
    """GET /v1/models as SGLang 0.5.23 answers it (http_server.py available_models): the served model,
    then with LoRA enabled every registered adapter (least recently used first), its root the path it
    was loaded from and its parent the served model."""
    engine = request.app[ENGINE]
    cfg, created = engine.config, int(time.time())

    def card(id_: str, root: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
        return {"id": id_, "object": "model", "created": created, "owned_by": "sglang", "root": root,
                "parent": parent, "max_model_len": max_len}  # fmt: skip

    name = cfg.served_model_name
    cards = [card(name, name, None, cfg.model.max_position_embeddings)]
    if engine.loras.enabled:
        cards += [card(ref.name, ref.path, name, None) for ref in engine.loras.registry.values()]
    return web.json_response({"object": "list", "data": cards})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


def health_check_timeout() -> int:
    """SGLang's limit for its generation probe: SGLANG_HEALTH_CHECK_TIMEOUT seconds (default 20)."""
    return int(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))


async def health_generate(request: web.Request) -> web.Response:
    """A one-token generation, answered as SGLang 0.5.23's /health_generate (http_server.py): 200 once
    it generated, 503 when it did not within SGLANG_HEALTH_CHECK_TIMEOUT, both with an empty body;
    routers and readiness probes read a hung (or paused) engine from that."""
    from rlfleet.sampler.reference_engine import GenRequest
    from rlfleet.sampler.sampling import RowParams

    engine = request.app[ENGINE]
    req = GenRequest(
        input_ids=[0],
        params=RowParams(0.0, 1.0, 1, 0.0),
        max_new_tokens=1,
        stop_token_ids=frozenset(),
        log_metrics=False,
    )
    try:
        await asyncio.wait_for(engine.submit(req), timeout=health_check_timeout())
    except TimeoutError:
        return web.Response(status=503)
    return web.Response(status=200)


async def model_info(request: web.Request) -> web.Response:
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    cfg = engine.config
    return web.json_response(
        {
            "model_path": settings.model_path or cfg.model_path or f"tiny-qwen3-seed{cfg.seed}",
            "served_model_name": cfg.served_model_name,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(engine.weight_version),
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
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    cfg = engine.config
    return web.json_response(
        {
            "model_path": settings.model_path or cfg.model_path,
            "served_model_name": cfg.served_model_name,
            "host": settings.host,
            "port": settings.port,
            "tp_size": 1,
            "dtype": "bfloat16",
            "quantization": None if engine.effective_format in ("bf16", "fp32") else engine.effective_format,
            "kv_cache_dtype": cfg.kv_cache_dtype,
            "sampling_mask_max_tokens": cfg.sampling_mask_max_tokens,
            "sampling_backend": cfg.sampling_backend,
            "max_running_requests": cfg.max_running_requests,
            "context_length": cfg.model.max_position_embeddings,
            "weight_version": str(engine.weight_version),
            "enable_metrics": True,
            "version": SERVER_VERSION,
            "rlfleet_engine": "reference",
            "kernel": {"act_dtype": cfg.kernel.act_dtype, "split_k": cfg.kernel.split_k},
            "max_tokens_per_second": cfg.max_tokens_per_second,
            "internal_states": [{"paused": engine.paused, "num_running_reqs": len(engine.running)}],
        }
    )


async def metrics(request: web.Request) -> web.Response:
    server_metrics = request.app[METRICS]
    server_metrics.refresh(request.app[ENGINE])
    body = generate_latest(server_metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


ROUTES = [
    web.post("/generate", generate),
    web.get("/health", health),
    web.get("/health_generate", health_generate),
    web.get("/model_info", model_info),
    web.get("/get_model_info", model_info),
    web.get("/server_info", server_info),
    web.get("/get_server_info", server_info),
    web.get("/metrics", metrics),
    web.get("/v1/models", available_models),
]
