"""`rlfleet router serve`: the router as an HTTP service (aiohttp).

Data plane (SGLang-compatible; with `apiKeyFile`/`apiKeyEnv` it needs `Authorization: Bearer <key>`
and the router presents the same key to the replicas, like SGLang's --api-key; without, it is open):
  POST /generate, /v1/chat/completions, /v1/completions   routed by `X-Session-Id` (or
       `X-SMG-Routing-Key`, SGLang router's header); optional `X-Min-Weight-Version: N`; optional
       `X-RLFleet-Adapter: newest` (LoRA: the router sets the body's `lora_path` to the chosen replica's
       newest adapter and answers X-RLFleet-Adapter-Version; router/core.py).
       Responses carry X-RLFleet-Group / -Replica / -Weight-Version / -Attempts headers, and JSON
       bodies get `rlfleet_group` / `rlfleet_replica` inside each `meta_info`.
  GET /health, GET /metrics (Prometheus).
Bounds against clients (docs/router.md, "Bounds"; router/bounds.py): a body over maxBodyBytes is a
413, a request whose body does not fit the byte budget within bodyWaitSeconds a 503 with Retry-After,
a body not sent within bodyTimeoutSeconds a 408, a connection without a complete request header within
headerTimeoutSeconds is closed, and so is one over maxClientConnections. A client that disconnects
cancels its request (and so its upstream request).
Admin API (bearer token from a mounted Secret file or an env variable; disabled without one):
  GET /admin/state; PUT /admin/shares {"shares": {group: weight}}; PUT /admin/groups/{name}
  {"quarantined": b}. The groups and their replicas are the config's (router/membership.py).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from rlfleet.lora import ADAPTER_NEWEST, ADAPTER_REQUEST_HEADER
from rlfleet.router import membership
from rlfleet.router.bounds import (
    BoundedTCPSite,
    ByteBudget,
    default_max_connections,
    default_max_per_source,
    return_freed_bodies_to_the_os,
)
from rlfleet.router.config import (
    GroupConfig,
    GroupUpdate,
    RouterConfig,
    SharesUpdate,
    format_validation_error,
    load_config,
)
from rlfleet.router.core import Router, RouteResult
from rlfleet.router.transport import StreamingResponse

log = logging.getLogger("rlfleet.router")
BodyModel = TypeVar("BodyModel", bound=BaseModel)  # an admin request body (_admin_body)

SESSION_HEADERS = ("X-Session-Id", "X-SMG-Routing-Key")
MIN_VERSION_HEADER = "X-Min-Weight-Version"
PROXIED_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions")
# A body with more brackets than this is decoded before it is routed, so that one nested too deep to
# decode is a 400 here (JSON of a legitimate request nests a few levels: a batch of prompts, chat
# messages; the cheap count keeps ordinary bodies from being decoded).
BRACKETS_BEFORE_DECODE = 1000


class TokenSource:
    """The admin bearer token: a file (re-read when it changes: Secrets rotate) or an env variable."""

    def __init__(self, path: str | None, env_name: str | None) -> None:
        self._path = Path(path) if path else None
        self._env_name = env_name
        self._cached: tuple[float, str | None] | None = None

    def token(self) -> str | None:
        if self._path is not None:
            try:
                mtime = self._path.stat().st_mtime
            except OSError:
                return None
            if self._cached is None or self._cached[0] != mtime:
                self._cached = (mtime, self._path.read_text().strip() or None)
            return self._cached[1]
        if self._env_name:
            return os.environ.get(self._env_name) or None
        return None


ROUTER_KEY: web.AppKey[Router] = web.AppKey("router", Router)
TOKEN_KEY: web.AppKey[TokenSource] = web.AppKey("token", TokenSource)
API_KEY: web.AppKey[TokenSource] = web.AppKey("api_key", TokenSource)
BUDGET_KEY: web.AppKey[ByteBudget] = web.AppKey("body_budget", ByteBudget)


def _json(status: int, payload: object, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status, body=json.dumps(payload).encode(), content_type="application/json", headers=headers
    )


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return _json(status, {"error": {"message": message, "code": status}}, headers)


def _wants_stream(body: bytes) -> bool:
    """Whether the body asks for a stream. Raises RecursionError for JSON nested too deep to decode."""
    deep = body.count(b"[") + body.count(b"{") > BRACKETS_BEFORE_DECODE
    if b'"stream"' not in body and not deep:  # cheap check first: decoding a big prompt costs real time
        return False
    try:
        decoded = json.loads(body)
    except ValueError:
        return False  # not JSON: the replica says what is wrong with it
    return isinstance(decoded, dict) and decoded.get("stream") is True


def _min_version_of(raw_version: str | None) -> int | None:
    """The X-Min-Weight-Version header's value; None when absent or not a non-negative integer."""
    if raw_version is None:
        return None
    try:
        min_version = int(raw_version)
    except ValueError:
        return None
    return min_version if min_version >= 0 else None


def _upstream_headers(
    headers: Mapping[str, str], api_key: str | None, raw_version: str | None, session_key: str | None
) -> dict[str, str] | None:
    """The headers forwarded to a replica; None when the router has a key and the caller's bearer
    token does not match it."""
    upstream_headers = {"Content-Type": headers.get("Content-Type", "application/json")}
    if api_key is not None:
        if not _bearer_matches(headers, api_key):
            return None
        upstream_headers["Authorization"] = f"Bearer {api_key}"
    elif "Authorization" in headers:
        upstream_headers["Authorization"] = headers["Authorization"]
    # Forwarded so a replica can check the version itself at serving time (exact, no race with the
    # router's view) and answer 409, which the router retries on a sibling.
    if raw_version is not None:
        upstream_headers[MIN_VERSION_HEADER] = raw_version
    if session_key:
        upstream_headers[SESSION_HEADERS[0]] = session_key
    return upstream_headers


async def _proxy(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    config = router.config
    if request.content_length is not None and request.content_length > config.max_body_bytes:
        router.metrics.refuse("body_too_large")
        return _closing(_too_large(config.max_body_bytes))
    # Held from before the body is read until it is routed (a body without a length: the largest).
    held = request.content_length if request.content_length is not None else config.max_body_bytes
    budget = request.app[BUDGET_KEY]
    if not await budget.acquire(held, config.body_wait_seconds):
        router.metrics.refuse("body_budget")
        message = f"the router holds {budget.in_use} bytes of request bodies (bodyBudgetBytes {budget.capacity}); retry"
        return _closing(_error(503, message, {"Retry-After": str(config.retry_after_seconds)}))
    try:
        routed = await _read_and_route(request, router)
    finally:
        await budget.release(held)
    if isinstance(routed, web.StreamResponse):
        return routed
    upstream = routed.stream
    if upstream is None:
        return web.Response(
            status=routed.status,
            body=routed.body,
            headers={**routed.headers, "Content-Type": routed.content_type},
        )
    return await _relay_stream(request, router, routed, upstream)


def _closing(response: web.Response) -> web.Response:
    """An answer given before the body was read: the connection closes after it (the body is not drained)."""
    response.force_close()
    return response


def _too_large(limit: int) -> web.Response:
    return _error(
        413,
        f"request body is larger than maxBodyBytes ({limit} bytes), the largest request of the job's context",
    )


async def _read_body(request: web.Request, limit: int) -> bytearray | None:
    """The request's body, None once it grows past `limit`. Read into one buffer (aiohttp's
    request.read() copies its buffer into bytes at the end: twice the body at that moment)."""
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > limit:
            return None
    return body


async def _read_and_route(request: web.Request, router: Router) -> RouteResult | web.Response:
    """Read the body (within bodyTimeoutSeconds) and route it: the route's result, or the error answer."""
    config = router.config
    try:
        async with asyncio.timeout(config.body_timeout_seconds):
            body = await _read_body(request, config.max_body_bytes)
    except TimeoutError:
        router.metrics.refuse("body_timeout")
        return _closing(
            _error(
                408, f"request body not received within bodyTimeoutSeconds ({config.body_timeout_seconds} s)"
            )
        )
    if body is None:  # a body without Content-Length that grew past the limit
        router.metrics.refuse("body_too_large")
        return _closing(_too_large(config.max_body_bytes))
    headers = request.headers
    session_key = headers.get(SESSION_HEADERS[0]) or headers.get(SESSION_HEADERS[1])
    raw_version = headers.get(MIN_VERSION_HEADER)
    min_version = _min_version_of(raw_version)
    if raw_version is not None and min_version is None:
        return _error(400, f"{MIN_VERSION_HEADER} must be a non-negative integer, got {raw_version!r}")
    raw_adapter = headers.get(ADAPTER_REQUEST_HEADER)
    if raw_adapter is not None and raw_adapter != ADAPTER_NEWEST:
        return _error(400, f"{ADAPTER_REQUEST_HEADER} must be {ADAPTER_NEWEST!r}, got {raw_adapter!r}")
    upstream_headers = _upstream_headers(headers, request.app[API_KEY].token(), raw_version, session_key)
    if upstream_headers is None:
        return _error(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
    try:
        stream = _wants_stream(body)
    except RecursionError:
        router.metrics.refuse("deep_json")
        return _error(
            400, "request body is JSON nested too deeply to decode (a generation request nests a few levels)"
        )
    return await router.route(
        request.path,
        body,
        session_key,
        min_version,
        upstream_headers,
        stream,
        adapter=raw_adapter is not None,
    )


async def _relay_stream(
    request: web.Request, router: Router, result: RouteResult, upstream: StreamingResponse
) -> web.StreamResponse:
    """Copy a streamed upstream answer to the caller, then release it (ok only if it all went out)."""
    response = web.StreamResponse(
        status=result.status, headers={**result.headers, "Content-Type": result.content_type}
    )
    ok = False
    hung = asyncio.ensure_future(_release_when_hung(router, result, upstream))
    try:
        await response.prepare(request)
        async for chunk in upstream.chunks():
            await response.write(chunk)
        await response.write_eof()
        ok = True
    except Exception as exc:  # upstream died (or hung) mid-stream: nothing to retry once bytes went out
        log.info("stream from %s ended early: %s", result.replica, exc)
    finally:
        hung.cancel()
        await router.finish_stream(result, ok)
    return response


async def _release_when_hung(router: Router, result: RouteResult, upstream: StreamingResponse) -> None:
    """End a stream whose replica is found hung: its connection is closed (the engine aborts the
    request), and the relay's next read fails."""
    await router.wait_hung(result)
    await upstream.release()


async def _health(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    shares = router.table.effective_shares()
    routable = sorted(name for name, share in shares.items() if share > 0.0)
    return _json(200, {"status": "ok", "routableGroups": routable})


async def _metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    return web.Response(
        body=generate_latest(router.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


# --- admin ------------------------------------------------------------------------------------


def _bearer_matches(headers, expected: str) -> bool:
    scheme, _, presented = headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), expected.encode())


def _authorised(request: web.Request) -> web.Response | None:
    expected = request.app[TOKEN_KEY].token()
    if expected is None:
        return _error(
            403, "admin API disabled: no token configured (adminTokenFile or the token env variable)"
        )
    if not _bearer_matches(request.headers, expected):
        return _error(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
    return None


async def _admin_body(request: web.Request, model: type[BodyModel]) -> BodyModel | web.Response:
    """An admin request's JSON body validated as `model`; the 403 / 401 answer when the request is not
    authorised (`_authorised`), the 400 saying why the body is not valid."""
    if (denied := _authorised(request)) is not None:
        return denied
    try:
        data = await request.json()
    except ValueError:
        return _error(400, "request body must be JSON")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        return _error(400, format_validation_error(exc))


async def _admin_state(request: web.Request) -> web.Response:
    if (denied := _authorised(request)) is not None:
        return denied
    return _json(200, request.app[ROUTER_KEY].table.snapshot())


async def _admin_shares(request: web.Request) -> web.Response:
    update = await _admin_body(request, SharesUpdate)
    if isinstance(update, web.Response):
        return update
    router = request.app[ROUTER_KEY]
    try:
        router.table.set_shares(update.shares)
    except KeyError as exc:
        return _error(404, str(exc.args[0]))
    log.info("shares set to %s (%s)", update.shares, update.reason or "no reason given")
    return _json(200, router.table.snapshot())


async def _admin_put_group(request: web.Request) -> web.Response:
    update = await _admin_body(request, GroupUpdate)
    if isinstance(update, web.Response):
        return update
    name = request.match_info["name"]
    router = request.app[ROUTER_KEY]
    if name not in router.table.groups:
        return _error(404, f"unknown group: {name} (the groups are the router config's)")
    router.table.set_group(name, quarantined=update.quarantined)
    log.info("group %s %s", name, "quarantined" if update.quarantined else "no longer quarantined")
    return _json(200, router.table.snapshot())


def build_app(router: Router, token: TokenSource, api_key: TokenSource | None = None) -> web.Application:
    """The aiohttp application. The caller starts/closes the router (see `serve`)."""
    app = web.Application(client_max_size=router.config.max_body_bytes)
    app[ROUTER_KEY] = router
    app[TOKEN_KEY] = token
    app[API_KEY] = api_key or TokenSource(None, None)
    app[BUDGET_KEY] = ByteBudget(router.config.body_budget_bytes)
    router.upstream_key = app[API_KEY].token
    for path in PROXIED_PATHS:
        app.router.add_post(path, _proxy)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/admin/state", _admin_state)
    app.router.add_put("/admin/shares", _admin_shares)
    app.router.add_put("/admin/groups/{name}", _admin_put_group)
    return app


async def start_service(
    config: RouterConfig, health_checks: bool = True, resolve: membership.Resolve | None = None
) -> tuple[Router, web.AppRunner, int]:
    """Start router + HTTP server; returns the bound port (config.port 0 = any free port). `resolve`: the
    name lookup of the groups' service names (default: the event loop's resolver, router/membership.py)."""
    router = Router(config, resolve=resolve)
    token = TokenSource(config.admin_token_file, config.admin_token_env)
    api_key = TokenSource(config.api_key_file, config.api_key_env)
    app = build_app(router, token, api_key)  # before start(): health checks need the upstream key
    await router.start(health_checks=health_checks)
    # handler_cancellation: a client that disconnects cancels its handler, and so its upstream request
    # (aiohttp >= 3.9 does not cancel by default). keepalive_timeout: the header deadline (router/bounds.py).
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        handler_cancellation=True,
        keepalive_timeout=config.header_timeout_seconds,
    )
    await runner.setup()
    max_connections = config.max_client_connections or default_max_connections()
    max_per_source = config.max_client_connections_per_source or default_max_per_source(max_connections)
    site = BoundedTCPSite(
        runner,
        config.host,
        config.port,
        max_connections,
        backlog=1024,
        max_per_source=max_per_source,
        on_refused=router.metrics.refuse_connection,
        on_closed_idle=router.metrics.closed_idle_connections.inc,
    )
    await site.start()
    port = runner.addresses[0][1]
    return router, runner, port


async def serve(config: RouterConfig) -> None:
    return_freed_bodies_to_the_os()  # the process is the router's alone (router/bounds.py)
    router, runner, port = await start_service(config)
    print(f"rlfleet router listening on http://{config.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await router.close()


def _parse_group_flag(value: str) -> GroupConfig:
    """`NAME=URL[,URL...][@SHARE]` -> GroupConfig (for quick local use without a config file)."""
    name, sep, rest = value.partition("=")
    if not sep or not name:
        raise ValueError(f"--group expects NAME=URL[,URL...][@SHARE], got {value!r}")
    urls, _, share = rest.partition("@")
    try:
        return GroupConfig(
            name=name, replicas=[u for u in urls.split(",") if u], share=float(share) if share else 1.0
        )
    except ValidationError as exc:
        raise ValueError(f"--group {value!r}: {format_validation_error(exc)}") from None
    except ValueError:
        raise ValueError(f"--group {value!r}: share must be a number") from None


def _loop_factory(kind: str):
    """uvloop: ~1.5x less router CPU per request at moderate load (docs/benchmarks.md); asyncio works."""
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise
        return None
    return uvloop.new_event_loop


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet router serve", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="router config file (YAML or JSON)")
    parser.add_argument("--host", help="bind address (overrides the config)")
    parser.add_argument("--port", type=int, help="port (overrides the config; 0 = any free port)")
    parser.add_argument("--group", action="append", default=[], help="NAME=URL[,URL...][@SHARE] (repeatable)")
    parser.add_argument("--admin-token-file", help="file holding the admin bearer token")
    parser.add_argument(
        "--loop",
        choices=["auto", "uvloop", "asyncio"],
        default="auto",
        help="event loop (auto: uvloop if installed)",
    )
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config) if args.config else RouterConfig()
        updates: dict[str, object] = {}
        if args.host is not None:
            updates["host"] = args.host
        if args.port is not None:
            updates["port"] = args.port
        if args.admin_token_file is not None:
            updates["admin_token_file"] = args.admin_token_file
        if args.group:
            updates["groups"] = [*config.groups, *(_parse_group_flag(g) for g in args.group)]
        config = RouterConfig.model_validate({**config.model_dump(), **updates})
    except ValidationError as exc:
        print(f"rlfleet router serve: {format_validation_error(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"rlfleet router serve: {exc}", file=sys.stderr)
        return 2
    if args.log_level.upper() not in logging.getLevelNamesMapping():
        print(f"rlfleet router serve: unknown --log-level {args.log_level!r}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        loop_factory = _loop_factory(args.loop)
    except ImportError:
        print("rlfleet router serve: --loop uvloop needs the uvloop package", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(config))
    except OSError as exc:
        print(
            f"rlfleet router serve: cannot listen on {config.host}:{config.port}: {exc.strerror}",
            file=sys.stderr,
        )
        return 1
    return 0
