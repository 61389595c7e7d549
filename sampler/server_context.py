"""What every reference-server handler reads from its application: the engine, the server's settings
and its metrics (aiohttp `AppKey`s, set once by `http_app.build_app`), and the request body as JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from rlfleet.sampler.server_metrics import ServerMetrics
from rlfleet.sampler.sglang_errors import error_response

if TYPE_CHECKING:
    from rlfleet.sampler.reference_engine import ReferenceEngine


@dataclass
class ServerSettings:
    api_key: str | None = None
    model_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 0


ENGINE: web.AppKey[ReferenceEngine] = web.AppKey("engine")
SETTINGS = web.AppKey("settings", ServerSettings)
METRICS = web.AppKey("metrics", ServerMetrics)


async def read_json(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        # FastAPI answers an undecodable body as a RequestValidationError (json_invalid)
        body = error_response(400, "body is not valid JSON", "Bad Request").body
        raise web.HTTPBadRequest(text=json.dumps(body), content_type="application/json") from None
    except RecursionError:  # nested deeper than the decoder goes: the body's fault, not a server error
        body = error_response(400, "body is JSON nested too deeply to decode", "Bad Request").body
        raise web.HTTPBadRequest(text=json.dumps(body), content_type="application/json") from None
