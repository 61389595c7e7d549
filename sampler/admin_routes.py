"""The reference server's admin endpoints, as SGLang 0.5.23 answers them:

POST /update_weights_from_disk   {model_path, weight_version, flush_cache, abort_all_requests}
POST /pause_generation, /continue_generation, /flush_cache
POST /update_weight_version      {new_version, abort_all_requests (default true, as SGLang's)}
POST /load_lora_adapter          {lora_name, lora_path, pinned}; /unload_lora_adapter {lora_name}
                                 (docs/sampler.md, "LoRA"; the engine's LoraRegistry has the semantics)
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from rlfleet.sampler.server_context import ENGINE, SETTINGS, read_json
from rlfleet.sampler.sglang_errors import error_json, error_response

log = logging.getLogger("rlfleet.sampler.server")


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


def _failed(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=400)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    from rlfleet.numerics.engine_model import load_checkpoint

    engine = request.app[ENGINE]
    try:
        body = UpdateWeightsIn.model_validate(await read_json(request))
    except ValidationError as exc:
        return error_response(400, str(exc), "Bad Request").response()
    try:  # no weight_version: the version stays (SGLang updates it only when one is given)
        version = engine.weight_version if body.weight_version is None else int(body.weight_version)
        if version < 0:
            raise ValueError
    except ValueError:
        return _failed(f"weight_version must be a non-negative integer, got {body.weight_version!r}")
    try:  # load and check fully before touching the engine: a failure leaves the old weights serving
        view, shape, weights = await asyncio.to_thread(load_checkpoint, body.model_path)
        if shape != engine.config.model:
            raise ValueError(
                f"its architecture {shape} differs from the served model's {engine.config.model}"
            )
    except (OSError, ValueError, KeyError) as exc:
        return _failed(f"failed to load {body.model_path}: {exc}")
    async with engine.lock:  # between two scheduler steps
        if body.abort_all_requests:
            engine.abort_all("Abort all requests before updating weights.")
        try:
            engine.load_weights(weights, view, version)
        except ValueError as exc:
            return _failed(str(exc))
        request.app[SETTINGS].model_path = body.model_path
    log.info("weights %s (view %s) -> version %d", body.model_path, view, version)
    message = "Succeeded to update model weights."
    if body.weight_version is not None:
        message += f" Weight version updated to {body.weight_version}."
    return web.json_response({"success": True, "message": message, "num_paused_requests": 0})


class UpdateWeightVersionIn(BaseModel):
    """UpdateWeightVersionReqInput: SGLang aborts every request unless abort_all_requests is false."""

    model_config = ConfigDict(extra="ignore")
    new_version: str | int
    abort_all_requests: bool = True


async def update_weight_version(request: web.Request) -> web.Response:
    """Relabel the served weights (LoRA: the sidecar's version N once adapter vN is loaded), so
    /model_info and each later token's meta_info weight_version say N; the weights stay."""
    engine = request.app[ENGINE]
    try:
        body = UpdateWeightVersionIn.model_validate(await read_json(request))
    except ValidationError as exc:
        return error_response(400, str(exc), "Bad Request").response()
    try:  # SGLang takes any string; rlfleet versions are integers (as in update_weights_from_disk)
        version = int(body.new_version)
        if version < 0:
            raise ValueError(f"a weight version is >= 0, got {version}")
    except ValueError as exc:
        message = f"Failed to update weight version: {exc}"
        return web.json_response({"success": False, "message": message}, status=400)
    async with engine.lock:  # between two scheduler steps
        if body.abort_all_requests:
            engine.abort_all("Aborted")  # FINISH_ABORT's default message
        engine.weight_version = version
    return web.json_response(
        {
            "success": True,
            "message": f"Weight version updated to {body.new_version}",
            "new_version": str(body.new_version),
        }
    )


class LoadLoraIn(BaseModel):
    """LoadLoRAAdapterReqInput's fields."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoraIn(BaseModel):
    """UnloadLoRAAdapterReqInput's fields."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str


async def load_lora_adapter(request: web.Request) -> web.Response:
    try:
        body = LoadLoraIn.model_validate(await read_json(request))
    except ValidationError as exc:
        return error_response(400, str(exc), "Bad Request").response()
    result = await request.app[ENGINE].loras.load(body.lora_name, body.lora_path, body.pinned)
    log.info("load_lora_adapter %s %s: %s", body.lora_name, body.lora_path, result["error_message"] or "ok")
    return web.json_response(result, status=200 if result["success"] else 400)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """Answers once the requests in flight on the adapter have finished (new ones cannot take it)."""
    try:
        body = UnloadLoraIn.model_validate(await read_json(request))
    except ValidationError as exc:
        return error_response(400, str(exc), "Bad Request").response()
    result = await request.app[ENGINE].loras.unload(body.lora_name)
    return web.json_response(result, status=200 if result["success"] else 400)


async def pause_generation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    raw = await read_json(request) if request.can_read_body else {}
    mode = (raw or {}).get("mode", "abort") if isinstance(raw, dict) else "abort"
    if mode not in ("abort", "retract", "in_place"):
        return error_json(400, f"mode must be abort, retract or in_place, got {mode!r}")
    async with engine.lock:
        engine.pause()
        if mode == "abort":
            engine.abort_all("generation paused (mode=abort)")
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    request.app[ENGINE].resume()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def flush_cache(request: web.Request) -> web.Response:
    return web.Response(  # no prefix cache in the reference engine: nothing to flush
        text="Cache flushed.\nPlease check backend logs for more details. "
        "(When there are running or waiting requests, the operation will not be performed.)\n"
    )


ROUTES = [
    web.post("/update_weights_from_disk", update_weights_from_disk),
    web.post("/pause_generation", pause_generation),
    web.post("/continue_generation", continue_generation),
    web.route("*", "/flush_cache", flush_cache),
    web.post("/update_weight_version", update_weight_version),
    web.post("/load_lora_adapter", load_lora_adapter),
    web.post("/unload_lora_adapter", unload_lora_adapter),
]
