"""What the router's clients may hold of it (docs/router.md, "Bounds"): the bytes of the request bodies
being read or routed at once, and the client connections open at once, in all and from one source.

The other bounds need no code of their own: the largest body is aiohttp's `client_max_size` and a
Content-Length check (router/service.py), the header deadline is aiohttp's keep-alive timeout (it is
armed when a connection opens and again after each response, and only a complete request header
stops it), and the body deadline is a timeout around reading the body.
"""

from __future__ import annotations

import asyncio
import ctypes
import resource
from collections import Counter
from collections.abc import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler


class ByteBudget:
    """A semaphore counted in bytes: a request holds its body's size (its Content-Length, or the
    largest body when it has none) from before its body is read until it is routed."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self._freed = asyncio.Condition()

    async def acquire(self, size: int, wait_seconds: float) -> bool:
        """Hold `size` bytes, waiting up to `wait_seconds` for them; False when they did not free up."""
        async with self._freed:
            try:
                async with asyncio.timeout(wait_seconds):
                    await self._freed.wait_for(lambda: self.in_use + size <= self.capacity)
            except TimeoutError:
                return False
            self.in_use += size
            return True

    async def release(self, size: int) -> None:
        async with self._freed:
            self.in_use -= size
            self._freed.notify_all()


def default_max_connections() -> int:
    """Half the process's file descriptor limit: the other half stays for the replicas' connections, the
    health probes and name lookups, so a flood of clients cannot starve the requests it lets in."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, soft // 2) if soft != resource.RLIM_INFINITY else 65536


def default_max_per_source(max_connections: int) -> int:
    """Half the connection cap: one source (a flood, or a client gone wrong) can hold at most half, the
    other half stays for everyone else. Not less: behind a NAT or kube-proxy's masquerade many clients
    share one address, and a trainer's sampler clients hold up to 100 connections each."""
    return max(1, max_connections // 2)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024


def return_freed_bodies_to_the_os() -> bool:
    """Make glibc give a large buffer's memory back when it is freed. Its mmap threshold starts at 128
    KiB but rises to the size of every mmapped buffer freed (up to 32 MiB), after which request bodies
    come from the heap and a burst's memory stays with the process (1,115 MiB of 1,914 kept in issue
    32's measurement). Fixing the threshold turns that off. False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def _source_of(transport: asyncio.BaseTransport) -> str:
    """The client's address without its port: what one source is for the per-source cap."""
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)


def _awaits_request_headers(handler: RequestHandler) -> bool:
    """Whether the connection is idle, waiting for the header of its next (or first) request: no request
    is queued or being handled, whatever bytes it sent are an incomplete header. It is the state
    aiohttp's own keep-alive timer closes a connection in (`RequestHandler._process_keepalive`: its
    `_waiter` is pending); aiohttp has no public accessor, so tests/router/test_router_bounds.py pins it.
    A connection whose handler has not run yet is not idle: it is the newest, never the one to close."""
    waiter = handler._waiter
    return waiter is not None and not waiter.done()


class _Gate(asyncio.Protocol):
    """One client connection as the site counts it: admitted, its aiohttp handler then gets every
    callback of the transport, or refused (closed at once; the client reads EOF)."""

    def __init__(self, site: BoundedTCPSite) -> None:
        self._site = site
        self.source = ""
        self.handler: RequestHandler | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.source = _source_of(transport)
        self.handler = self._site.admit(self)
        if self.handler is None:
            transport.close()
        else:
            self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.handler is not None:
            self.handler.data_received(data)

    def eof_received(self) -> None:  # aiohttp's handler returns None too: the transport closes on EOF
        if self.handler is not None:
            self.handler.eof_received()

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._site.release(self)
        if self.handler is not None:
            self.handler.connection_lost(exc)


class BoundedTCPSite(web.TCPSite):
    """aiohttp's TCPSite, holding at most `max_connections` client connections in all and
    `max_per_source` from one source (client address). A connection from a source at its cap is
    closed at once. At the total cap the oldest connection still waiting for its request header (an
    idle keep-alive, a slowloris, a flood's) is closed to admit the new one; only when every
    connection is in a request is the new one closed. So a flood from one source holds at most its
    share, and a reconnecting flood from many cannot keep a well-behaved client out: it sends its
    header at once, is never the oldest idle connection, and is served."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        max_connections: int,
        backlog: int,
        max_per_source: int,
        on_refused: Callable[[str], None] = lambda reason: None,
        on_closed_idle: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(runner, host, port, backlog=backlog)
        self.max_connections = max_connections
        self.max_per_source = max_per_source
        self._on_refused = on_refused
        self._on_closed_idle = on_closed_idle
        self._admitted: dict[_Gate, None] = {}  # in the order they were accepted: the oldest first
        self.per_source: Counter[str] = Counter()

    @property
    def admitted(self) -> list[_Gate]:
        """The connections held, the oldest first."""
        return list(self._admitted)

    def admit(self, gate: _Gate) -> RequestHandler | None:
        """The handler for a new connection, or None when it is refused (counted by reason)."""
        if self.per_source[gate.source] >= self.max_per_source:
            self._on_refused("source")
            return None
        if len(self._admitted) >= self.max_connections and not self._close_oldest_idle():
            self._on_refused("total")
            return None
        server = self._runner.server
        assert server is not None
        self._admitted[gate] = None
        self.per_source[gate.source] += 1
        return server()

    def release(self, gate: _Gate) -> None:
        """A connection closed (by either side): its place is free."""
        if gate in self._admitted:
            del self._admitted[gate]
            self.per_source[gate.source] -= 1
            if not self.per_source[gate.source]:
                del self.per_source[gate.source]

    def _close_oldest_idle(self) -> bool:
        """Close the oldest connection waiting for its request header; False when there is none."""
        idle = next(
            (g for g in self._admitted if g.handler is not None and _awaits_request_headers(g.handler)), None
        )
        if idle is None or idle.handler is None:
            return False
        self.release(idle)  # now, not when its transport reports it lost: the new connection takes its place
        idle.handler.force_close()  # what aiohttp does at the header deadline: the client reads EOF
        self._on_closed_idle()
        return True

    async def start(self) -> None:
        self._runner._reg_site(self)  # what BaseSite.start does; TCPSite.start is replaced below
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Gate(self),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]
