"""The router as a library: route one request with retries, keep replica health and versions fresh.

Usage (inside a running event loop):

    router = Router(RouterConfig(groups=[GroupConfig(name="h100-fp8", replicas=["http://..."])]))
    await router.start()  # looks the groups' names up once, then every resolveIntervalSeconds
    result = await router.route("/generate", body_bytes, session_key="episode-17", min_version=None)
    ...
    await router.close()

Failure semantics (why no request is lost): a refused/dropped/timed-out connection, an HTTP
502/503/504 from a replica or a replica found hung (below) is a replica failure; the request is retried on the next replica of the
same group, and when the group has none left, on the session's next group in its rendezvous order
(the session re-sticks there until its group is back), each replica at most once and at most
`maxAttempts` posts per request. Retrying across replicas is the router's alone: the client retries
the router's 503 only after a backoff, and the driver none (rlfleet/retries.py, the one policy of a
turn). /generate is safe to repeat: sampling has no side effects. Other statuses (400, 500, ...) are
the request's own outcome and pass through.

Hung replicas (docs/router.md, "Hung replicas"): readiness is a generation probe (`healthPath`, SGLang's
/health_generate: a one-token generation), not /health, which an engine whose scheduler hangs may still
answer. A probe without an answer in `healthTimeoutSeconds` is a failure like any other (after
`failureThreshold` the replica takes no new request). When its probes have had no answer for
`hungAfterSeconds` (longer than a weight load blocks a scheduler) the replica is hung: every request in
flight on it is cancelled upstream (its connection closed: SGLang aborts it) and retried on the next
replica. An attempt with no answer after `requestTimeoutSeconds` probes its replica at once (one probe
per replica at a time) and moves only if that finds it hung; otherwise it keeps waiting, because a
long generation is not a failure and moving it would run it twice. A client that disconnects cancels
its upstream request the same way.

Minimum weight version (header `X-Min-Weight-Version`): replicas known to serve an older version
are skipped; a response whose meta_info reports an older version is discarded and retried; when no
replica of the session's group can serve the version yet, the answer is HTTP 409 with Retry-After.
The session is NOT moved to another group for that (its group is only lagging by seconds, and a
trajectory should keep one precision); a dead group is different and does move.

Membership (router/membership.py): a group's replicas are its configured URLs, a name among them
standing for every address it resolves to (the operator's headless Service: the group's ready pods),
looked up again every `resolveIntervalSeconds`. A replica that leaves the answer leaves the table; a
request in flight on it holds its own reference and finishes (or fails over) as any other, and only the
sessions whose rendezvous choice it was move, to their next replica; one that joins starts healthy (DNS
lists ready pods only) and takes the sessions whose first choice it is.

LoRA adapters (request header `X-RLFleet-Adapter: newest`; docs/router.md "LoRA adapters"): after the
replica is chosen as above, the body posted to it names that replica's newest adapter, `"lora_path":
"v<N>"` with N its weight version (a retry on another replica names that one's), and the answer says N
in `X-RLFleet-Adapter-Version`. A replica whose version is unknown has its /model_info read first and
is skipped like a lagging one (no post) when that does not say either; an engine's 400 for an adapter it
does not hold (unloaded since the router last looked) has the router read that replica's version again
and post to it once more, within maxAttempts; a second such 400 (or one without room to post again) makes
the replica a lagging one, as under a minimum version (an engine just started from its base says the base's
version before its sidecar loaded an adapter). Without the header the body is forwarded untouched.

slime's weight_version field (`--rollout-http-endpoint-url` with a request hook adding `"weight_version":
{"exact_version": N}` or `{"min_required_version": N}` to a /generate body; docs/router.md "slime's
weight_version field"): decoded only when the raw bytes hold `"weight_version"`; the field is removed
from the body posted (the rest re-encoded, the same JSON). exact_version N: only a replica at exactly N is
posted to, and an answer reporting another version is discarded and retried; min_required_version N:
as `X-Min-Weight-Version` (the stricter of the two when both are given). In both, a replica whose version
is unknown has its /model_info read first and is skipped when that does not say it; when no replica of
the session's group serves it yet, the 409 with Retry-After at once (slime's POST helper retries any
non-2xx after its retry_sleep). A malformed field is a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from rlfleet.lora import ADAPTER_VERSION_HEADER, adapter_name
from rlfleet.retries import REPLICA_FAILURE_STATUSES
from rlfleet.router import hashing, membership, meta
from rlfleet.router.config import RouterConfig
from rlfleet.router.metrics import RouterMetrics
from rlfleet.router.table import Group, Replica, RoutingTable, VersionConflict, serves
from rlfleet.router.transport import StreamingResponse, Transport, UpstreamError, make_transport

try:  # several times faster on big prompts; the router's image (the operator's) may lack it: json then
    import orjson

    def _loads_json(data: bytes) -> object:
        return orjson.loads(data)

    def _dumps_json(value: object) -> bytes:
        return orjson.dumps(value)

except ImportError:  # pragma: no cover - installed wherever the tests run

    def _loads_json(data: bytes) -> object:
        return json.loads(data)

    def _dumps_json(value: object) -> bytes:
        return json.dumps(value, separators=(",", ":")).encode()


log = logging.getLogger("rlfleet.router")

HEADER_GROUP = "X-RLFleet-Group"
HEADER_REPLICA = "X-RLFleet-Replica"
HEADER_VERSION = "X-RLFleet-Weight-Version"
HEADER_ATTEMPTS = "X-RLFleet-Attempts"
FALLBACK_HEALTH_PATH = "/health"  # for an upstream without a generation probe (404 on healthPath)

# SGLang 0.5.23's 400s for a `lora_path` naming an adapter the engine does not hold. srt/managers/
# tokenizer_manager.py _resolve_lora_path: a name never loaded in this engine process, or one unloaded that
# it failed to load again from where it was loaded (it tries: an unloaded adapter stays in its
# lora_ref_cache); srt/lora/lora_registry.py acquire: unloaded between that check and the request's start.
ADAPTER_NOT_LOADED = (
    b"Got LoRA adapter that has never been loaded",
    b"Failed to implicitly load LoRA adapter",
    b"The following requested LoRA adapters are not loaded",
)

# slime's request-level weight constraint in a /generate body (its --custom-rollout-request-hook-path adds
# it): `"weight_version": {"exact_version": N}` or `{"min_required_version": N}`. Only a body whose bytes
# hold the key is decoded (a JSON encoder writes a key plainly); a body where those bytes are a string value
# or a nested key does not carry the field and goes out untouched.
WEIGHT_VERSION_FIELD = "weight_version"
_WEIGHT_VERSION_KEY = b'"weight_version"'
EXACT_VERSION = "exact_version"
MIN_REQUIRED_VERSION = "min_required_version"
MAX_WEIGHT_VERSION = 2**63 - 1  # a version is a signed 64-bit integer

# A generation probe's verdict: it answered 200 (generates); another status (starting, draining); no
# answer in time (silent: hung once that lasts hungAfterSeconds); its connection refused (down) or dropped.
ProbeVerdict = Literal["ok", "unready", "silent", "refused", "dropped"]


@dataclass
class RouteResult:
    status: int
    content_type: str
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    group: str | None = None
    replica: str | None = None
    weight_version: int | None = None
    attempts: int = 0
    stream: StreamingResponse | None = None
    _replica_obj: Replica | None = None
    _started: float = 0.0


@dataclass
class _Request:
    """One request being routed, and what its attempts so far have used up."""

    path: str
    body: bytes
    headers: dict[str, str]
    min_version: int | None
    stream: bool
    key_h: int
    started: float
    tried: set[str] = field(default_factory=set)
    attempts: int = 0
    last_error: str = ""
    # With X-RLFleet-Adapter: the decoded body (each attempt's names its replica's adapter), the bodies
    # built so far by adapter version, and the replicas posted to again after an adapter-not-loaded 400.
    document: dict[str, object] | None = None
    adapter_bodies: dict[int, bytes] = field(default_factory=dict)
    reposted: set[str] = field(default_factory=set)
    # slime's weight_version.exact_version (its min_required_version is folded into min_version), and
    # whether a replica of unknown version has its /model_info read before a post (adapter mode, the field).
    exact_version: int | None = None
    read_versions: bool = False

    @property
    def versioned(self) -> bool:
        """Whether the request asked for a weight version (minimum or exact)."""
        return self.min_version is not None or self.exact_version is not None

    def serves(self, version: int | None) -> bool:
        """Whether a replica or answer at `version` (None: not said) meets the requested version."""
        return serves(version, self.min_version, self.exact_version)

    def wanted(self) -> str:
        """The requested version in words."""
        if self.exact_version is not None:
            return f"weight version {self.exact_version} exactly"
        if self.min_version is not None:
            return f"weight version >= {self.min_version}"
        return "a known weight version (its adapter's)"

    def body_for(self, adapter: int | None) -> bytes:
        """The body to post: the client's own, or (adapter mode) with `lora_path` naming `adapter`'s adapter."""
        if adapter is None or self.document is None:
            return self.body
        body = self.adapter_bodies.get(adapter)
        if body is None:
            body = _dumps_json({**self.document, "lora_path": adapter_name(adapter)})
            self.adapter_bodies[adapter] = body
        return body


class _AdapterNotLoaded:
    """An attempt's answer was the engine's 400 for an adapter it does not hold: post to it again."""


def _adapter_document(body: bytes) -> dict[str, object] | str:
    """The decoded body of an adapter request, or why it cannot be one (the 400's message)."""
    try:
        document = _loads_json(body)
    except ValueError as exc:  # orjson.JSONDecodeError is one
        return f"a request with X-RLFleet-Adapter needs a JSON object body (the router sets its lora_path): {exc}"
    if not isinstance(document, dict):
        return (
            "a request with X-RLFleet-Adapter needs a JSON object body (the router sets its lora_path), "
            f"got a JSON {type(document).__name__}"
        )
    return document


def _field_document(body: bytes) -> dict[str, object] | str:
    """The decoded /generate body whose bytes hold `"weight_version"`, or why it cannot carry the field."""
    try:
        document = _loads_json(body)
    except (ValueError, RecursionError) as exc:  # orjson.JSONDecodeError is a ValueError
        return f'a /generate body with "weight_version" must be a JSON object: {_one_line(str(exc))[:200]}'
    if not isinstance(document, dict):
        return f'a /generate body with "weight_version" must be a JSON object, got a JSON {type(document).__name__}'
    return document


@dataclass(frozen=True)
class _VersionAsked:
    """A /generate body's slime weight_version field, read: the body without it (and decoded), the
    request's minimum (the stricter of the header's and the field's) and its exact version."""

    body: bytes
    document: dict[str, object]
    min_version: int | None
    exact_version: int | None


def _version_field(
    path: str, body: bytes, document: dict[str, object] | None, min_version: int | None
) -> _VersionAsked | str | None:
    """slime's `weight_version` field of a /generate body (`document`: the body already decoded, adapter
    mode), or why it is malformed (the 400's message), or None when the body does not carry it. Decodes
    only a body whose bytes hold `"weight_version"`."""
    if path != "/generate" or _WEIGHT_VERSION_KEY not in body:
        return None
    found = _field_document(body) if document is None else document
    if isinstance(found, str):
        return found
    if WEIGHT_VERSION_FIELD not in found:  # the bytes were a string value or a nested key: not the field
        return None
    spec = _weight_version_spec(found[WEIGHT_VERSION_FIELD])
    if isinstance(spec, str):
        return spec
    exact_version, required = spec
    if required is not None:
        min_version = required if min_version is None else max(min_version, required)
    if exact_version is not None and min_version is not None and exact_version < min_version:
        return (
            f'"weight_version".{EXACT_VERSION} {exact_version} is below the minimum weight version '
            f"{min_version} (X-Min-Weight-Version): no replica can serve both"
        )
    stripped = {key: value for key, value in found.items() if key != WEIGHT_VERSION_FIELD}
    return _VersionAsked(_dumps_json(stripped), stripped, min_version, exact_version)


def _weight_version_spec(value: object) -> tuple[int | None, int | None] | str:
    """slime's `weight_version` field: (exact_version, min_required_version), one of them None, or why
    the field is malformed (the 400's message, one line)."""
    shape = f'"weight_version" must be {{"{EXACT_VERSION}": N}} or {{"{MIN_REQUIRED_VERSION}": N}}'
    if not isinstance(value, dict):
        return f"{shape}, got {_describe(value)}"
    if len(value) != 1 or next(iter(value)) not in (EXACT_VERSION, MIN_REQUIRED_VERSION):
        keys = ", ".join(_one_line(json.dumps(key))[:40] for key in list(value)[:4])
        more = ", ..." if len(value) > 4 else ""
        return f"{shape} (exactly one key), got an object with key(s) [{keys}{more}]"
    ((key, number),) = value.items()
    if type(number) is not int or not 0 <= number <= MAX_WEIGHT_VERSION:  # not bool (an int subclass)
        return f'"weight_version".{key} must be an integer in [0, 2**63 - 1], got {_describe(number)}'
    return (number, None) if key == EXACT_VERSION else (None, number)


def _describe(value: object) -> str:
    """A short one-line account of a JSON value a client sent (for a 400's message)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int | float):
        text = repr(value)
        return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} characters)"
    if isinstance(value, str):
        return f"the string {_one_line(json.dumps(value[:40]))}"
    return "a JSON object" if isinstance(value, dict) else f"a JSON {type(value).__name__}"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _json_error(status: int, message: str, **extra: object) -> RouteResult:
    body = json.dumps({"error": {"message": message, "code": status, **extra}}).encode()
    return RouteResult(status=status, content_type="application/json", body=body)


class Router:
    def __init__(
        self,
        config: RouterConfig,
        transport: Transport | None = None,
        resolve: membership.Resolve | None = None,
    ) -> None:
        self.config = config
        self.table = RoutingTable()
        self._resolve = resolve or membership.system_resolve
        # Each group's configured URLs, and the replica URLs each name's last answered lookup gave.
        self._configured = {group.name: list(group.replicas) for group in config.groups}
        self._looked_up: dict[str, list[str]] = {}
        # Why a name's last lookup failed (the DNS not answering, e.g. while a cluster starts): the 503 says it.
        self._lookup_errors: dict[str, str] = {}
        for group in config.groups:
            self.table.set_group(group.name, self._members(group.name), group.share, group.quarantined)
        self.metrics = RouterMetrics(self.table)
        self._transport = transport
        self._health_task: asyncio.Task[None] | None = None
        self._resolve_task: asyncio.Task[None] | None = None
        self._random = random.Random()
        # Per replica URL: set when the replica is found hung (its in-flight requests move), the
        # generation probe in progress (shared by everyone who asks), and those without a probe.
        self._hung: dict[str, asyncio.Event] = {}
        self._probes: dict[str, asyncio.Future[ProbeVerdict]] = {}
        self._no_generation_probe: set[str] = set()
        self._generated_at: dict[str, float] = {}  # when the replica last answered a generation (200)
        self._silent_since: dict[str, float] = {}  # since when its probes get no answer
        # Returns the data-plane key the replicas want (or None); set by the service.
        self.upstream_key: Callable[[], str | None] = lambda: None

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            raise RuntimeError("Router.start() must be awaited first")
        return self._transport

    async def start(self, health_checks: bool = True) -> None:
        if self._transport is None:
            self._transport = make_transport(
                self.config.connect_timeout_seconds, self.config.max_connections_per_replica
            )
        await self.resolve_replicas()  # before serving: the first requests find the groups' replicas
        if self._names() and self._resolve_task is None:
            self._resolve_task = asyncio.create_task(self._resolve_loop(), name="rlfleet-router-resolve")
        if health_checks and self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop(), name="rlfleet-router-health")

    async def close(self) -> None:
        for task in (self._resolve_task, self._health_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._resolve_task = self._health_task = None
        if self._transport is not None:
            await self._transport.close()
            self._transport = None

    # --- routing ----------------------------------------------------------------------------

    async def route(
        self,
        path: str,
        body: bytes,
        session_key: str | None,
        min_version: int | None = None,
        headers: dict[str, str] | None = None,
        stream: bool = False,
        adapter: bool = False,
    ) -> RouteResult:
        """Forward one request. With `stream=True` a successful result holds an open `stream`
        that the caller must drain and then pass to `finish_stream`. `adapter=True` (the client's
        `X-RLFleet-Adapter: newest`): the body must be a JSON object (else a 400), posted to each replica
        tried with `lora_path` naming that replica's newest adapter. A /generate body with slime's
        `weight_version` field asks for a version itself (module docstring); the field is not posted."""
        document: dict[str, object] | None = None
        if adapter:
            decoded = _adapter_document(body)
            if isinstance(decoded, str):
                self.metrics.refuse("adapter_body")
                return _json_error(400, decoded)
            document = decoded
        asked = _version_field(path, body, document, min_version)
        if isinstance(asked, str):
            self.metrics.refuse("weight_version_field")
            return _json_error(400, asked)
        if asked is not None:
            body, document, min_version = asked.body, asked.document, asked.min_version
        req = _Request(
            path=path,
            body=body,
            headers=headers if headers is not None else {"Content-Type": "application/json"},
            min_version=min_version,
            stream=stream,
            key_h=hashing.key_hash(session_key) if session_key else self._random.getrandbits(64),
            started=time.perf_counter(),
            document=document if adapter else None,
            exact_version=asked.exact_version if asked is not None else None,
            read_versions=adapter or asked is not None,
        )
        order = self.table.group_order(req.key_h)
        if not order:
            return self._unroutable(self._why_no_group())
        for position, group_name in enumerate(order):
            group = self.table.groups.get(group_name)
            if group is None:
                continue
            allow_unhealthy = position == len(order) - 1 or not group.routable()
            result = await self._try_group(req, group, allow_unhealthy)
            if result is not None:
                return result
            if req.attempts >= self.config.max_attempts:
                break
        return self._unroutable(
            f"no replica could serve the request after {req.attempts} attempt(s); "
            f"last error: {req.last_error or 'none'}",
            attempts=req.attempts,
        )

    async def _try_group(self, req: _Request, group: Group, allow_unhealthy: bool) -> RouteResult | None:
        """Try the group's replicas in turn; the answer, a 409 when the group only lags the requested
        version, or None to move on to the session's next group."""
        conflict: VersionConflict | None = None
        while req.attempts < self.config.max_attempts:
            choice = self.table.choose_replica(
                group,
                req.key_h,
                req.tried,
                req.min_version,
                self.config.load_slack,
                allow_unhealthy,
                req.exact_version,
            )
            if choice is None:
                break
            if isinstance(choice, VersionConflict):
                conflict = choice
                break
            adapter: int | None = None
            if req.read_versions:
                found = await self._known_version(req, group, choice)
                if isinstance(found, VersionConflict):
                    conflict = found
                    continue
                adapter = found if req.document is not None else None
            outcome = await self._try_replica(req, group, choice, adapter)
            if isinstance(outcome, _AdapterNotLoaded):
                outcome = await self._post_again(req, group, choice)
            if isinstance(outcome, RouteResult):
                return outcome
            if outcome is not None:
                conflict = outcome
        if conflict is not None:
            return self._version_conflict(req, conflict)
        return None

    async def _known_version(self, req: _Request, group: Group, replica: Replica) -> int | VersionConflict:
        """Adapter mode or slime's weight_version field: the replica's weight version (read from its
        /model_info first when unknown; in adapter mode the version whose adapter to post). A
        VersionConflict, the replica skipped without a post, when that stays unknown or does not meet the
        requested version (minimum or exact)."""
        if replica.weight_version is None:
            await self._refresh_version(replica, self.config.health_timeout_seconds, self._probe_headers())
        version = replica.weight_version
        if version is not None and req.serves(version):
            return version
        req.tried.add(replica.url)
        self.metrics.error(group.name, "version_conflict")
        req.last_error = f"{replica.url}: weight version {version}, not {req.wanted()}"
        return VersionConflict(group.name, req.min_version or 0, (version,))

    async def _post_again(
        self, req: _Request, group: Group, replica: Replica
    ) -> RouteResult | VersionConflict | None:
        """After the replica's 400 for an adapter it does not hold (unloaded since the router last read its
        version): read its version again and post to it once more; that answer stands, but a second such
        400 makes the replica a lagging one (VersionConflict). (The first post checked that maxAttempts
        leaves room for this one.)"""
        req.reposted.add(replica.url)
        await self._refresh_version(replica, self.config.health_timeout_seconds, self._probe_headers())
        found = await self._known_version(req, group, replica)
        if isinstance(found, VersionConflict):
            return found
        outcome = await self._try_replica(req, group, replica, found)
        assert not isinstance(outcome, _AdapterNotLoaded)  # the replica is in req.reposted: its 400 stands
        return outcome

    async def _try_replica(
        self, req: _Request, group: Group, replica: Replica, adapter: int | None = None
    ) -> RouteResult | VersionConflict | _AdapterNotLoaded | None:
        """One attempt on one replica (adapter mode: naming version `adapter`'s adapter): its answer, a
        VersionConflict when it lags the requested version, _AdapterNotLoaded for the engine's 400 for
        that adapter when it may be posted again, or None when it failed (and was marked so)."""
        req.tried.add(replica.url)
        if req.attempts:
            self.metrics.retry(group.name)
        req.attempts += 1
        replica.requests += 1
        replica.inflight += 1
        try:
            status, content_type, data, opened = await self._send_watched(req, replica, req.body_for(adapter))
        except asyncio.CancelledError:  # the client went away (or shutdown): keep counts right
            replica.inflight -= 1
            raise
        except UpstreamError as exc:
            replica.inflight -= 1
            replica.failures += 1
            self.table.mark_result(replica, False, self.config.failure_threshold, hard=exc.hard)
            self.metrics.error(group.name, exc.kind)
            req.last_error = f"{replica.url}: {exc}"
            log.info("attempt %d on %s failed: %s", req.attempts, replica.url, exc)
            return None
        # 409 is a version conflict only when the request asked for a version; otherwise
        # it is the request's own answer and passes through.
        if status in REPLICA_FAILURE_STATUSES or (status == 409 and req.versioned):
            return await self._refused(req, group, replica, status, opened)
        if opened is not None:
            result = RouteResult(status=status, content_type=content_type, stream=opened)
            result.weight_version = replica.weight_version
            self._finish(result, group.name, replica, req.attempts, req.started, keep_inflight=True)
            return _with_adapter(result, adapter)
        if adapter is not None and status == 400 and any(message in data for message in ADAPTER_NOT_LOADED):
            replica.inflight -= 1
            self.metrics.error(group.name, "adapter_not_loaded")
            req.last_error = f"{replica.url}: HTTP 400, adapter {adapter_name(adapter)} not loaded"
            if replica.url not in req.reposted and req.attempts < self.config.max_attempts:
                log.info(
                    "%s does not hold adapter %s: reading its version again",
                    replica.url,
                    adapter_name(adapter),
                )
                return _AdapterNotLoaded()
            # It does not hold the adapter of the version it says it serves (an engine just started from its
            # base, whose sidecar has not loaded an adapter yet): it lags, as under a minimum version.
            return VersionConflict(group.name, req.min_version or 0, (replica.weight_version,))
        return self._answered(req, group, replica, status, content_type, data, adapter)

    async def _send_watched(
        self, req: _Request, replica: Replica, body: bytes
    ) -> tuple[int, str, bytes, StreamingResponse | None]:
        """`_send` to the replica, given up (the upstream request cancelled) when the replica is found
        hung: by the periodic probe, or by the probe this attempt asks for after every
        `requestTimeoutSeconds` without an answer. Raises UpstreamError("hung") then."""
        send = asyncio.ensure_future(self._send(req, replica.url + req.path, body))
        hung = asyncio.ensure_future(self._hung_event(replica).wait())
        try:
            while True:
                done, _ = await asyncio.wait(
                    (send, hung),
                    timeout=self.config.request_timeout_seconds,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if send in done:
                    return send.result()
                if hung in done or (await self._probe(replica) == "silent" and self._is_hung(replica)):
                    if send.done():
                        continue  # it answered while the probe ran: that answer stands
                    self._eject_hung(replica)
                    raise UpstreamError("hung", hard=True, detail="its generation probes got no answer")
        finally:
            hung.cancel()
            if not send.done():
                send.cancel()  # closes the upstream connection: the engine aborts the request
                await asyncio.wait((send,))
            if not send.cancelled():
                send.exception()  # retrieved: an error after the replica was given up is not news

    async def _send(
        self, req: _Request, url: str, body: bytes
    ) -> tuple[int, str, bytes, StreamingResponse | None]:
        """Post `body`, or open it as a stream: (status, content type, body, open stream)."""
        if req.stream:
            opened = await self.transport.open_stream(url, body, req.headers)
            return opened.status, opened.content_type, b"", opened
        response = await self.transport.post(url, body, req.headers)
        return response.status, response.content_type, response.body, None

    async def _refused(
        self, req: _Request, group: Group, replica: Replica, status: int, opened: StreamingResponse | None
    ) -> VersionConflict | None:
        """A failure status, or a 409 to a versioned request: release the attempt and say which."""
        if opened is not None:
            await opened.release()
        replica.inflight -= 1
        if status == 409 and req.versioned:
            # The replica itself says it lags the requested version: try a sibling.
            self.metrics.error(group.name, "version_conflict")
            return VersionConflict(group.name, req.min_version or 0, (replica.weight_version,))
        replica.failures += 1
        self.table.mark_result(replica, False, self.config.failure_threshold)
        self.metrics.error(group.name, "http_5xx")
        req.last_error = f"{replica.url}: HTTP {status}"
        return None

    def _answered(
        self,
        req: _Request,
        group: Group,
        replica: Replica,
        status: int,
        content_type: str,
        data: bytes,
        adapter: int | None = None,
    ) -> RouteResult | VersionConflict:
        """A whole (non-streamed) answer: discarded as a VersionConflict when its meta_info reports an
        older version than requested (or, exact_version, any other version: the replica moved on while it
        generated), else annotated, accounted and returned (adapter mode: saying
        `adapter`, the version whose adapter the post named)."""
        replica.inflight -= 1
        if status == 200:
            self._generated_at[replica.url] = time.monotonic()
        scan = meta.scan(data) if status == 200 else None
        version = scan.weight_version if scan is not None else None
        newest = scan.newest_version if scan is not None else None
        if not (req.serves(version) and req.serves(newest)):
            replica.observe_version(newest)
            self.metrics.error(group.name, "version_conflict")
            req.last_error = f"{replica.url}: answered at weight version {newest}, not {req.wanted()}"
            log.info(
                "discarded %s's answer at weight version %s: %s asked", replica.url, newest, req.wanted()
            )
            return VersionConflict(group.name, req.min_version or 0, (version, newest))
        self.table.mark_result(replica, True, self.config.failure_threshold)
        replica.observe_version(version)
        if scan is not None and scan.insert_at and self.config.annotate_body:
            fields = meta.annotation({"rlfleet_group": group.name, "rlfleet_replica": replica.url})
            data = meta.annotate(data, scan.insert_at, fields)
        result = RouteResult(status=status, content_type=content_type or "application/json", body=data)
        result.weight_version = version if version is not None else replica.weight_version
        self._finish(result, group.name, replica, req.attempts, req.started, keep_inflight=False)
        _with_adapter(result, adapter)
        self.metrics.answered(
            group.name,
            status,
            time.perf_counter() - req.started,
            scan.completion_tokens if scan else 0,
            scan.prompt_tokens if scan else 0,
        )
        return result

    def _version_conflict(self, req: _Request, conflict: VersionConflict) -> RouteResult:
        """The 409 (with Retry-After) for a group none of whose replicas serves the version yet."""
        group = self.table.groups.get(conflict.group)
        known = [r.weight_version for r in group.replicas.values()] if group is not None else []
        served = sorted({v for v in [*conflict.served_versions, *known] if v is not None})
        message = f"no replica of group {conflict.group!r} serves {req.wanted()} yet; retry"
        extra: dict[str, object] = {}
        if req.exact_version is not None:
            extra["exactWeightVersion"] = req.exact_version
            if served and None not in known and all(v > req.exact_version for v in served):
                message = (
                    f"every replica of group {conflict.group!r} serves a weight version past "
                    f"{req.exact_version} (asked for exactly): it will not be served again"
                )
        result = _json_error(
            409,
            message,
            group=conflict.group,
            minWeightVersion=req.min_version,
            servedVersions=served,
            **extra,
        )
        result.headers = {"Retry-After": str(self.config.retry_after_seconds), HEADER_GROUP: conflict.group}
        result.group = conflict.group
        result.attempts = req.attempts
        self.metrics.answered(conflict.group, 409, time.perf_counter() - req.started, 0, 0)
        return result

    def _why_no_group(self) -> str:
        """The 503's message when no group can take traffic; the names that cannot be looked up named (a
        fleet that is starting: not available yet, which the client retries and the driver waits out)."""
        message = "no sampler group can take traffic (all down, quarantined or share 0)"
        failed = [self._lookup_errors[url] for url in self._names() if url in self._lookup_errors]
        return f"{message}; {'; '.join(failed)}" if failed else message

    def _unroutable(self, message: str, attempts: int = 0) -> RouteResult:
        result = _json_error(503, message)
        result.headers = {"Retry-After": str(self.config.retry_after_seconds)}
        result.attempts = attempts
        self.metrics.answered("none", 503, 0.0, 0, 0)
        return result

    def _finish(
        self,
        result: RouteResult,
        group: str,
        replica: Replica,
        attempts: int,
        started: float,
        keep_inflight: bool,
    ) -> RouteResult:
        result.group = group
        result.replica = replica.url
        result.attempts = attempts
        result.headers = {HEADER_GROUP: group, HEADER_REPLICA: replica.url, HEADER_ATTEMPTS: str(attempts)}
        if result.weight_version is not None:
            result.headers[HEADER_VERSION] = str(result.weight_version)
        if keep_inflight:
            result._replica_obj = replica
            result._started = started
        return result

    async def wait_hung(self, result: RouteResult) -> None:
        """Return when the replica a streamed result comes from is found hung (its stream then ends:
        what went out cannot be retried)."""
        replica = result._replica_obj
        if replica is None:
            await asyncio.Future()  # not a stream: never
        else:
            await self._hung_event(replica).wait()

    async def finish_stream(self, result: RouteResult, ok: bool) -> None:
        """Release a streamed upstream response and account for it."""
        if result.stream is not None:
            await result.stream.release()
        replica = result._replica_obj
        if replica is not None:
            replica.inflight -= 1
            if ok and result.status == 200:
                self._generated_at[replica.url] = time.monotonic()
            self.table.mark_result(replica, ok, self.config.failure_threshold)
            result._replica_obj = None
        if result.group is not None:
            self.metrics.answered(result.group, result.status, time.perf_counter() - result._started, 0, 0)
            if not ok:
                self.metrics.error(result.group, "disconnect")

    # --- membership -------------------------------------------------------------------------

    def _names(self) -> list[str]:
        """The configured URLs that name several replicas (looked up), each once."""
        urls = {url for group_urls in self._configured.values() for url in group_urls}
        return sorted(url for url in urls if membership.name_of(url) is not None)

    def _members(self, group: str) -> list[str]:
        """The group's replica URLs now: its literal URLs, and for each name the last answer's."""
        urls: list[str] = []
        for url in self._configured[group]:
            urls += self._looked_up.get(url, []) if membership.name_of(url) is not None else [url]
        return list(dict.fromkeys(urls))

    async def resolve_replicas(self) -> None:
        """Look every name up once more and set each group's replicas from the answers (what the router
        knows about a replica that stays is kept: RoutingTable.set_group)."""
        names = self._names()
        answers = await asyncio.gather(*(self._look_up(url) for url in names))
        for url, answer in zip(names, answers, strict=True):
            if answer is not None:
                self._looked_up[url] = answer
        for name in self._configured:
            group = self.table.groups[name]
            members = self._members(name)
            if list(group.replicas) != members:
                log.info("group %s: replicas %s -> %s", name, list(group.replicas), members)
                self.table.set_group(name, members)

    async def _look_up(self, url: str) -> list[str] | None:
        """The replica URLs a name URL stands for now; None when the lookup failed (the last answer stays)."""
        host = membership.name_of(url) or ""
        try:
            answer = membership.replica_urls(url, await self._resolve(host))
        except (OSError, UnicodeError) as exc:
            if isinstance(exc, OSError) and membership.is_no_address(exc):
                self._lookup_errors.pop(url, None)
                return []  # the name exists without an address (a Service with no ready pod), or not at all
            kept = len(self._looked_up.get(url, []))
            self._lookup_errors[url] = f"cannot look up {host} ({exc}): its group keeps {kept} replica(s)"
            log.warning("cannot look up %s (%s): keeping its %d replica(s)", host, exc, kept)
            return None
        self._lookup_errors.pop(url, None)
        return answer

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.resolve_interval_seconds)
            try:
                await self.resolve_replicas()
            except Exception:  # a bug in one round must not stop following the groups' pods
                log.exception("replica lookup round failed")

    # --- health -----------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_health_once()
            except Exception:  # a bug in one round must not stop health checking
                log.exception("health check round failed")
            await asyncio.sleep(self.config.health_interval_seconds)

    async def check_health_once(self) -> None:
        replicas = [r for g in list(self.table.groups.values()) for r in list(g.replicas.values())]
        if replicas:
            await asyncio.gather(*(self._check_replica(r) for r in replicas))

    async def _check_replica(self, replica: Replica) -> None:
        threshold = self.config.failure_threshold
        verdict = await self._probe(replica)
        if verdict != "ok":
            hung = verdict == "silent" and self._is_hung(replica)
            if hung:
                self._eject_hung(replica)
            self.table.mark_result(replica, False, threshold, hard=hung or verdict == "refused")
            return
        self.table.mark_result(replica, True, threshold)
        if self._hung_event(replica).is_set():
            self._hung[replica.url] = asyncio.Event()  # generating again: later requests stay on it
        await self._refresh_version(replica, self.config.health_timeout_seconds, self._probe_headers())

    def _probe_headers(self) -> dict[str, str] | None:
        key = self.upstream_key()
        return {"Authorization": f"Bearer {key}"} if key else None

    def _hung_event(self, replica: Replica) -> asyncio.Event:
        return self._hung.setdefault(replica.url, asyncio.Event())

    def _is_hung(self, replica: Replica) -> bool:
        """Whether the replica's probes have had no answer for hungAfterSeconds."""
        since = self._silent_since.get(replica.url)
        return since is not None and time.monotonic() - since >= self.config.hung_after_seconds

    def _eject_hung(self, replica: Replica) -> None:
        """Give up every request in flight on a hung replica (they move); the caller marks it down."""
        if not self._hung_event(replica).is_set():
            log.warning(
                "replica %s is hung (its generation probes got no answer for %.0f s): ejected, its requests move",
                replica.url,
                self.config.hung_after_seconds,
            )
            self._hung_event(replica).set()

    async def _probe(self, replica: Replica) -> ProbeVerdict:
        """The replica's generation probe: one at a time per replica, its verdict shared by all who ask."""
        probe = self._probes.get(replica.url)
        if probe is None:
            probe = asyncio.ensure_future(self._run_probe(replica))
            self._probes[replica.url] = probe
            probe.add_done_callback(lambda _: self._probes.pop(replica.url, None))
        return await asyncio.shield(probe)

    async def _run_probe(self, replica: Replica) -> ProbeVerdict:
        started = time.monotonic()
        verdict = await self._ask_probe(replica, started)
        if verdict == "silent":
            self._silent_since.setdefault(replica.url, started)
        else:  # it answered (or is down: its requests fail by themselves)
            self._silent_since.pop(replica.url, None)
        return verdict

    async def _ask_probe(self, replica: Replica, started: float) -> ProbeVerdict:
        no_probe = replica.url in self._no_generation_probe
        path = FALLBACK_HEALTH_PATH if no_probe else self.config.health_path
        try:
            response = await self.transport.get(
                replica.url + path, self.config.health_timeout_seconds, self._probe_headers()
            )
        except UpstreamError as exc:
            if exc.kind == "timeout":
                # As SGLang's own probe: any generation answered since it started counts (only slow).
                return "ok" if self._generated_at.get(replica.url, -1.0) >= started else "silent"
            return "refused" if exc.hard else "dropped"
        if response.status == 404 and not no_probe:
            log.warning(
                "%s has no %s: its readiness is %s (a hang goes unseen)",
                replica.url,
                path,
                FALLBACK_HEALTH_PATH,
            )
            self._no_generation_probe.add(replica.url)
            return await self._ask_probe(replica, started)
        return "ok" if response.status == 200 else "unready"

    async def _refresh_version(
        self, replica: Replica, timeout: float, headers: dict[str, str] | None
    ) -> None:
        # SGLang serves /model_info (newer) and /get_model_info (older); both carry weight_version.
        while replica.model_info_path is not None:
            try:
                response = await self.transport.get(replica.url + replica.model_info_path, timeout, headers)
            except UpstreamError:
                return
            if response.status == 404:
                replica.model_info_path = (
                    "/get_model_info" if replica.model_info_path == "/model_info" else None
                )
                continue
            if response.status == 200:
                replica.observe_version(_parse_version(response.body))
            return


def _with_adapter(result: RouteResult, adapter: int | None) -> RouteResult:
    """Say, in X-RLFleet-Adapter-Version, which version's adapter the post named (adapter mode)."""
    if adapter is not None:
        result.headers[ADAPTER_VERSION_HEADER] = str(adapter)
    return result


def _parse_version(body: bytes) -> int | None:
    try:
        value = json.loads(body).get("weight_version")
    except (ValueError, AttributeError):
        return None
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None
