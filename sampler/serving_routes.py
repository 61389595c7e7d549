"""The reference server's serving endpoints (thin handlers: validate, call the engine, shape SGLang's JSON):

  POST /generate                  single or batched input_ids; same response (text is "": no tokenizer)
  GET  /health, /health_generate   liveness; a one-token generation (not counted in metrics)
  GET  /model_info, /server_info   model path, weight_version, server args (sampling_mask_max_tokens ...)
  GET  /metrics                    Prometheus text: SGLang's metric names, labels and counting

rlfleet extension: 409 when the `X-Min-Weight-Version` header is ahead of the served version (our
router's contract).
"""

from __future__ import annotations

import asyncio
import os

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
    min_version = request.headers.get(MIN_VERSION_HEADER)
    if min_version is not None:
        try:
            wanted = int(min_version)
        except ValueError:
            return error_json(400, f"{MIN_VERSION_HEADER} must be an integer")
        if wanted > engine.weight_version:
            return error_json(
                409,
                f"serving weight version {engine.weight_version} < requested {wanted}",
                {"Retry-After": "1"},
            )
    await asyncio.gather(*(engine.submit(req) for req in reqs))
    for req in reqs:  # an abort with a status is the request's HTTP error (tokenizer_manager)
        status, finish = req.error_status, req.finish or {}
        if status == 400:
            return value_error(finish["message"]).response()
        if status is not None:
            return error_response(status, finish["message"]).response()
    outs = [engine.response(req) for req in reqs]
    return web.Response(body=dumps_json(outs if batched else outs[0]), content_type="application/json")


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
]
