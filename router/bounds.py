"""What the router's clients may hold of it (docs/router.md, "Bounds"): the bytes of the request bodies
being read or routed at once, and the client connections open at once.

The other bounds need no code of their own: the largest body is aiohttp's `client_max_size` and a
Content-Length check (router/service.py), the header deadline is aiohttp's keep-alive timeout (it is
armed when a connection opens and again after each response, and only a complete request header
stops it), and the body deadline is a timeout around reading the body.
"""

from __future__ import annotations

import asyncio
import ctypes
import resource
from collections.abc import Callable

from aiohttp import web


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


class _Refuse:
    """A connection over the limit: closed as soon as it is accepted (the client reads EOF)."""

    def connection_made(self, transport) -> None:  # asyncio.BaseTransport
        transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> None:
        pass


class BoundedTCPSite(web.TCPSite):
    """aiohttp's TCPSite, closing the connections accepted beyond `max_connections` at once."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        max_connections: int,
        backlog: int,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(runner, host, port, backlog=backlog)
        self.max_connections = max_connections
        self._on_refused = on_refused

    async def start(self) -> None:
        self._runner._reg_site(self)  # what BaseSite.start does; TCPSite.start is replaced below
        server = self._runner.server
        assert server is not None

        def connection():  # -> asyncio.Protocol
            if len(server.connections) >= self.max_connections:
                self._on_refused()
                return _Refuse()
            return server()

        self._server = await asyncio.get_running_loop().create_server(
            connection, self._host, self._port, backlog=self._backlog, reuse_address=self._reuse_address
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]
