"""The reference sampler server's aiohttp application around a ReferenceEngine, and an in-process server
bound to a port. With an API key, everything except /health, /health_generate and /metrics needs
`Authorization: Bearer` (401 {"error": "Unauthorized"}, as SGLang's `--api-key`)."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from rlfleet.sampler import admin_routes, serving_routes
from rlfleet.sampler.server_context import ENGINE, METRICS, SETTINGS, ServerSettings
from rlfleet.sampler.server_metrics import ServerMetrics

if TYPE_CHECKING:
    from rlfleet.sampler.reference_engine import ReferenceEngine

OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def bearer_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    api_key = request.app[SETTINGS].api_key
    if api_key and request.path not in OPEN_PATHS:
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.encode(), api_key.encode()):
            return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


async def _engine_running(app: web.Application) -> AsyncIterator[None]:
    """The engine's scheduler loop runs while the application does."""
    engine = app[ENGINE]
    engine.start()
    yield
    await engine.stop()


def build_app(engine: ReferenceEngine, settings: ServerSettings | None = None) -> web.Application:
    app = web.Application(middlewares=[bearer_auth], client_max_size=64 * 1024 * 1024)
    app[ENGINE] = engine
    app[SETTINGS] = settings or ServerSettings()
    app[METRICS] = ServerMetrics(engine.config.served_model_name)
    app.add_routes(serving_routes.ROUTES)
    app.add_routes(admin_routes.ROUTES)
    app.cleanup_ctx.append(_engine_running)
    return app


class RunningServer:
    """An in-process reference server bound to host:port (port 0 = a free port)."""

    def __init__(self, engine: ReferenceEngine, settings: ServerSettings) -> None:
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
        await web.TCPSite(self._runner, self.settings.host, self.settings.port).start()
        self.settings.port = self._runner.addresses[0][1]  # the bound port (port 0: the one the OS chose)
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
    engine: ReferenceEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    model_path: str | None = None,
) -> RunningServer:
    return await RunningServer(
        engine, ServerSettings(api_key=api_key, model_path=model_path, host=host, port=port)
    ).start()
