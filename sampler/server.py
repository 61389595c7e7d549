"""`rlfleet sampler serve`: the reference sampler server (SGLang API subset) or the real SGLang launcher.

`--engine reference` serves the TinyGPT reference engine (reference_engine.py) over a real aiohttp
HTTP server speaking the subset of SGLang 0.5.23's API rlfleet uses:

  POST /generate                  same request fields, same response shape (text is "": no tokenizer)
  GET  /health, /health_generate   liveness; a one-token generation
  GET  /model_info, /server_info   model path, weight_version, server args (sampling_mask_max_tokens ...)
  GET  /get_weight_version         {"weight_version": "<int>"}
  GET  /metrics                    Prometheus text, SGLang metric names, labels model_name + tp_rank
  POST /update_weights_from_disk   {model_path, weight_version, flush_cache, abort_all_requests}
  POST /pause_generation, /continue_generation, /flush_cache

Errors use SGLang's body `{"error": {"message": ...}}`: 400 for invalid requests (including the
sampling-mask rule: top_k == 1 or 1 < top_k <= --sampling-mask-max-tokens), 409 when the request's
`X-Min-Weight-Version` header is ahead of the served version (our router's contract). With
`--api-key`, everything except /health, /health_generate and /metrics needs `Authorization: Bearer`.

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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

log = logging.getLogger("rlfleet.sampler.server")

MIN_VERSION_HEADER = "X-Min-Weight-Version"
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
SERVER_VERSION = "0.5.23-rlfleet-reference"


# ------------------------------------------------------------------------------------ request models
class SamplingParamsIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_new_tokens: int = Field(128, ge=0)
    stop_token_ids: list[int] | None = None
    sampling_seed: int | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v


class GenerateIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingParamsIn = Field(default_factory=SamplingParamsIn)
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0)
    return_sampling_mask: bool = False
    sampling_logprobs_mode: Literal["support", "selected"] = "support"
    stream: bool = False
    rid: str | None = None


class UpdateWeightsIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model_path: str
    weight_version: str | int | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    keep_pause: bool = False


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status, headers=headers)


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


# ------------------------------------------------------------------------------------ metrics
class ServerMetrics:
    """SGLang's metric names on a private registry (several servers may share a process in tests)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "tp_rank"]
        self.labels = {"model_name": model_name, "tp_rank": "0"}
        r = self.registry
        self.gen_throughput = Gauge(
            "sglang:gen_throughput", "Generation throughput (tokens/s)", labels, registry=r
        )
        self.num_running = Gauge("sglang:num_running_reqs", "Running requests", labels, registry=r)
        self.num_queue = Gauge("sglang:num_queue_reqs", "Queued requests", labels, registry=r)
        self.token_usage = Gauge("sglang:token_usage", "KV cache slot usage (0..1)", labels, registry=r)
        self.cache_hit_rate = Gauge("sglang:cache_hit_rate", "Prefix cache hit rate", labels, registry=r)
        self.gen_tokens = Counter("sglang:generation_tokens", "Generated tokens", labels, registry=r)
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens", labels, registry=r)
        self.num_requests = Counter("sglang:num_requests", "Requests", labels, registry=r)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Time to first token",
            labels,
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "End-to-end request latency",
            labels,
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.weight_version = Gauge(
            "rlfleet_sampler_weight_version", "Served weight version", labels, registry=r
        )
        self._exported = {"gen": 0, "prompt": 0, "req": 0}

    def refresh(self, engine: Any) -> None:
        s = engine.stats
        lab = self.labels
        self.gen_throughput.labels(**lab).set(s.gen_throughput())
        self.num_running.labels(**lab).set(len(engine.running))
        self.num_queue.labels(**lab).set(len(engine.waiting))
        slots = engine.config.max_running_requests
        self.token_usage.labels(**lab).set((slots - len(engine.free_slots)) / slots)
        self.cache_hit_rate.labels(**lab).set(0.0)
        for key, total, counter in (
            ("gen", s.generation_tokens_total, self.gen_tokens),
            ("prompt", s.prompt_tokens_total, self.prompt_tokens),
            ("req", s.requests_total, self.num_requests),
        ):
            counter.labels(**lab).inc(total - self._exported[key])
            self._exported[key] = total
        while s.finished:
            ttft, e2e = s.finished.popleft()
            if ttft is not None:
                self.ttft.labels(**lab).observe(ttft)
            self.e2e.labels(**lab).observe(e2e)
        self.weight_version.labels(**lab).set(engine.weight_version)


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
                return _error(401, "missing or wrong API key")
        return await handler(request)

    async def read_json(request: web.Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise web.HTTPBadRequest(
                text=json.dumps({"error": {"message": "body is not JSON"}}), content_type="application/json"
            ) from None

    async def generate(request: web.Request) -> web.Response:
        raw = await read_json(request)
        if isinstance(raw, dict) and raw.get("input_ids") and isinstance(raw["input_ids"][0], list):
            return _error(
                400, "batched input_ids are not supported by the reference server; send one request each"
            )
        try:
            body = GenerateIn.model_validate(raw)
        except ValidationError as exc:
            return _error(400, _validation_message(exc))
        sp = body.sampling_params
        vocab = cfg.model.vocab_size
        if body.stream:
            return _error(400, "stream=true is not supported by the reference server")
        if any(i < 0 or i >= vocab for i in body.input_ids):
            return _error(400, f"input_ids must be token ids in [0, {vocab})")
        if len(body.input_ids) >= cfg.model.max_seq_len:
            return _error(
                400,
                f"prompt of {len(body.input_ids)} tokens leaves no room (max_seq_len {cfg.model.max_seq_len})",
            )
        if body.return_sampling_mask:
            cap = cfg.sampling_mask_max_tokens
            if not (sp.top_k == 1 or 1 < sp.top_k <= cap):
                return _error(
                    400,
                    f"return_sampling_mask requires top_k == 1 or 1 < top_k <= sampling_mask_max_tokens ({cap}), "
                    f"got top_k={sp.top_k}",
                )
        if body.sampling_logprobs_mode == "selected" and body.return_sampling_mask:
            return _error(
                400,
                "sampling_logprobs_mode 'selected' is not implemented by the reference server; use 'support'",
            )
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
        req = GenRequest(
            input_ids=list(body.input_ids),
            params=RowParams(sp.temperature, sp.top_p, sp.top_k, sp.min_p),
            max_new_tokens=min(sp.max_new_tokens, cfg.model.max_seq_len - len(body.input_ids)),
            stop_token_ids=frozenset(sp.stop_token_ids or ()),
            return_mask=body.return_sampling_mask,
            top_logprobs_num=min(body.top_logprobs_num, vocab) if body.return_logprob else 0,
            seed=sp.sampling_seed,
        )
        if body.rid:
            req.rid = body.rid
        await engine.submit(req)
        out = engine.response(req)
        if not body.return_logprob:  # SGLang only returns logprob fields when asked
            for key in ("output_token_logprobs", "output_top_logprobs"):
                out["meta_info"].pop(key, None)
        return web.Response(body=dumps_json(out), content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(request: web.Request) -> web.Response:
        req = GenRequest(
            input_ids=[0], params=RowParams(0.0, 1.0, 1, 0.0), max_new_tokens=1, stop_token_ids=frozenset()
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
                "model_path": settings.model_path or cfg.model_path or f"tinygpt-seed{cfg.model.seed}",
                "tokenizer_path": None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": _weight_version(),
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "tinygpt",
                "architectures": ["TinyGPT"],
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
                "max_running_requests": cfg.max_running_requests,
                "weight_version": _weight_version(),
                "enable_metrics": True,
                "version": SERVER_VERSION,
                "rlfleet_engine": "reference",
                "kernel": {"act_dtype": cfg.kernel.act_dtype, "split_k": cfg.kernel.split_k},
                "max_tokens_per_second": cfg.max_tokens_per_second,
                "internal_states": [{"paused": engine.paused, "num_running_reqs": len(engine.running)}],
            }
        )

    async def get_weight_version(request: web.Request) -> web.Response:
        return web.json_response({"weight_version": _weight_version()})

    async def metrics_handler(request: web.Request) -> web.Response:
        metrics.refresh(engine)
        return web.Response(
            body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def update_weights_from_disk(request: web.Request) -> web.Response:
        try:
            body = UpdateWeightsIn.model_validate(await read_json(request))
        except ValidationError as exc:
            return web.json_response({"success": False, "message": _validation_message(exc)}, status=400)
        try:
            version = engine.weight_version + 1 if body.weight_version is None else int(body.weight_version)
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
        try:
            from rlfleet.numerics.views import load_view
        except ImportError as exc:
            return web.json_response(
                {"success": False, "message": f"weight views unavailable (rlfleet.numerics.views): {exc}"},
                status=400,
            )
        try:  # load and check fully before touching the engine: a failure leaves the old weights serving
            view, weights = await asyncio.to_thread(load_view, body.model_path)
        except (OSError, ValueError, KeyError) as exc:
            return web.json_response(
                {"success": False, "message": f"failed to load {body.model_path}: {exc}"}, status=400
            )
        async with engine.lock:  # between two scheduler steps
            aborted = (
                engine.abort_all("weights updated (abort_all_requests)") if body.abort_all_requests else 0
            )
            try:
                engine.load_weights(weights, view, version)
            except ValueError as exc:
                return web.json_response({"success": False, "message": str(exc)}, status=400)
            settings.model_path = body.model_path
        log.info("weights %s (view %s) -> version %d", body.model_path, view, version)
        return web.json_response(
            {
                "success": True,
                "message": "Succeeded to update model weights.",
                "num_paused_requests": 0,
                "num_aborted_requests": aborted,
            }
        )

    async def pause_generation(request: web.Request) -> web.Response:
        raw = await read_json(request) if request.can_read_body else {}
        mode = (raw or {}).get("mode", "abort") if isinstance(raw, dict) else "abort"
        if mode not in ("abort", "retract", "in_place"):
            return _error(400, f"mode must be abort, retract or in_place, got {mode!r}")
        async with engine.lock:
            engine.pause()
            if mode == "abort":
                engine.abort_all("generation paused (mode=abort)")
        return web.json_response({"success": True, "message": f"Generation paused ({mode})."})

    async def continue_generation(request: web.Request) -> web.Response:
        engine.resume()
        return web.json_response({"success": True, "message": "Generation continued."})

    async def flush_cache(request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.\n")  # no prefix cache in the reference engine

    app = web.Application(middlewares=[auth], client_max_size=64 * 1024 * 1024)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/model_info", model_info)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/get_weight_version", get_weight_version)
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
        "--model-path", help="weight view directory (rlfleet.numerics.views); default: seeded TinyGPT init"
    )
    p.add_argument("--served-model-name", default="tinygpt")
    p.add_argument(
        "--weight-format",
        default="bf16",
        help="reference: fp32|bf16|fp8|fp8_block|nvfp4|mxfp4; sglang: bf16|fp8|nvfp4|mxfp4",
    )
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--weight-version", type=int, default=0)
    p.add_argument("--sampling-mask-max-tokens", type=int, default=4096)
    p.add_argument(
        "--api-key",
        default=os.environ.get("RLFLEET_SAMPLER_API_KEY"),
        help="bearer token (env RLFLEET_SAMPLER_API_KEY)",
    )
    ref = p.add_argument_group("reference engine")
    ref.add_argument("--seed", type=int, default=0)
    ref.add_argument("--vocab-size", type=int, default=256)
    ref.add_argument("--n-layer", type=int, default=2)
    ref.add_argument("--n-head", type=int, default=4)
    ref.add_argument("--d-model", type=int, default=64)
    ref.add_argument("--max-seq-len", type=int, default=256)
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

    from rlfleet.numerics.tinygpt import KernelConfig, TinyGPTConfig, config_from_state_dict
    from rlfleet.sampler.reference_engine import EngineConfig, ReferenceEngine

    torch.set_num_threads(max(1, args.threads))
    weights, view = None, "fp32"
    if args.model_path:
        try:
            from rlfleet.numerics.views import load_view
        except ImportError as exc:
            raise CliError(f"--model-path needs rlfleet.numerics.views: {exc}") from None
        try:
            view, weights = load_view(args.model_path)
            model_cfg = config_from_state_dict(weights, args.n_head, args.max_seq_len, args.seed)
        except (OSError, ValueError, KeyError) as exc:
            raise CliError(f"cannot load --model-path {args.model_path}: {exc}") from None
    else:
        model_cfg = TinyGPTConfig(
            vocab_size=args.vocab_size,
            n_layer=args.n_layer,
            n_head=args.n_head,
            d_model=args.d_model,
            max_seq_len=args.max_seq_len,
            seed=args.seed,
        )
    cfg = EngineConfig(
        model=model_cfg,
        weight_format=args.weight_format,
        kv_cache_dtype=args.kv_cache_dtype,
        kernel=KernelConfig(act_dtype=args.kernel_act_dtype, split_k=args.kernel_split_k),
        max_running_requests=args.max_running_requests,
        max_tokens_per_second=args.max_tokens_per_second,
        sampling_mask_max_tokens=args.sampling_mask_max_tokens,
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
