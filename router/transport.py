"""Pooled keep-alive HTTP clients to the sampler replicas, behind one small interface (tests pass
their own `Transport`).

aiohttp: measured 12-27x cheaper per request than httpx under 64 concurrent connections
(docs/benchmarks.md, "Router"), so httpx is not offered. Failures are normalised into `UpstreamError(kind, hard)`; `hard` means the replica is certainly
down (connection refused / unresolvable), as opposed to a dropped or timed-out connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

# A body larger than this is sent in pieces of this size, each after the previous one left: the socket's
# write buffer then holds one piece, not a copy of the whole body (docs/router.md, "Bounds").
UPLOAD_PIECE_BYTES = 256 * 1024


def upload(body: bytes, headers: dict[str, str]) -> tuple[object, dict[str, str]]:
    """What to pass aiohttp as `data` and `headers`: the body itself when small, else its pieces (with
    its Content-Length, so the replica still sees a plain, not chunked, request)."""
    if len(body) <= UPLOAD_PIECE_BYTES:
        return body, headers
    return _pieces(body), {**headers, "Content-Length": str(len(body))}


async def _pieces(body: bytes) -> AsyncIterator[memoryview]:
    view = memoryview(body)
    for start in range(0, len(view), UPLOAD_PIECE_BYTES):
        yield view[start : start + UPLOAD_PIECE_BYTES]


class UpstreamError(Exception):
    def __init__(self, kind: str, hard: bool, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.hard = hard


@dataclass
class UpstreamResponse:
    status: int
    content_type: str
    body: bytes


class StreamingResponse(Protocol):
    status: int
    content_type: str

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def release(self) -> None: ...


class Transport(Protocol):
    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse: ...

    async def open_stream(self, url: str, body: bytes, headers: dict[str, str]) -> StreamingResponse: ...

    async def get(
        self, url: str, timeout: float, headers: dict[str, str] | None = None
    ) -> UpstreamResponse: ...

    async def close(self) -> None: ...


# --- aiohttp ----------------------------------------------------------------------------------


class _AiohttpStream:
    def __init__(self, response) -> None:  # aiohttp.ClientResponse
        self._response = response
        self.status = response.status
        self.content_type = response.headers.get("Content-Type", "application/octet-stream")

    async def chunks(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.content.iter_any():
            yield chunk

    async def release(self) -> None:
        self._response.release()


class AiohttpTransport:
    def __init__(self, connect_timeout: float, limit_per_host: int) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        # No read timeout: a long generation is not a failure. A replica that stops generating is found
        # by the router's generation probe (router/core.py, "Hung replicas"), which cancels the post.
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout)
        self._session = aiohttp.ClientSession(
            # Idle connections are dropped after 4 s, before the upstream does (uvicorn, which SGLang
            # runs on, closes them after 5 s): reusing one the server closed fails a POST.
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=limit_per_host, keepalive_timeout=4),
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    def _error(self, exc: BaseException) -> UpstreamError:
        aiohttp = self._aiohttp
        if isinstance(exc, aiohttp.ClientConnectorError):
            return UpstreamError("connect", hard=True, detail=str(exc))
        if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
            return UpstreamError("timeout", hard=False, detail=str(exc))
        return UpstreamError("disconnect", hard=False, detail=f"{type(exc).__name__}: {exc}")

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        try:
            data, sent_headers = upload(body, headers)
            async with self._session.post(url, data=data, headers=sent_headers) as response:
                data = await response.read()
                return UpstreamResponse(response.status, response.headers.get("Content-Type", ""), data)
        except (TimeoutError, self._aiohttp.ClientError, OSError) as exc:
            raise self._error(exc) from exc

    async def open_stream(self, url: str, body: bytes, headers: dict[str, str]) -> StreamingResponse:
        try:
            data, sent_headers = upload(body, headers)
            response = await self._session.post(url, data=data, headers=sent_headers)
        except (TimeoutError, self._aiohttp.ClientError, OSError) as exc:
            raise self._error(exc) from exc
        return _AiohttpStream(response)

    async def get(self, url: str, timeout: float, headers: dict[str, str] | None = None) -> UpstreamResponse:
        try:
            client_timeout = self._aiohttp.ClientTimeout(total=timeout)
            async with self._session.get(url, timeout=client_timeout, headers=headers) as response:
                data = await response.read()
                return UpstreamResponse(response.status, response.headers.get("Content-Type", ""), data)
        except (TimeoutError, self._aiohttp.ClientError, OSError) as exc:
            raise self._error(exc) from exc

    async def close(self) -> None:
        await self._session.close()


def make_transport(connect_timeout: float, limit_per_host: int) -> Transport:
    return AiohttpTransport(connect_timeout, limit_per_host)
