"""An HTTP proxy in front of moto_server that fails chosen S3 requests (tests/weights is on sys.path under
pytest; not a test file): what an S3 endpoint does under load or in an outage (503 SlowDown, which boto
retries, then gives up), for some keys only, so a publish can be failed in the middle."""

from __future__ import annotations

import http.client
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class S3FaultProxy:
    """Forwards every request to `upstream_port`; a request whose method and path match `fail` (set at any
    time: (method, or methods joined by "|", regex of the path) or None) is answered 503 SlowDown instead
    and counted in `failed`; one that matches `hold` (the same form) is held unanswered (`held` is set)
    until `release` is set, so a client can be stopped at a known point of its work."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.fail: tuple[str, re.Pattern[str]] | None = None
        self.failed: list[str] = []
        self.hold: tuple[str, re.Pattern[str]] | None = None
        self.held = threading.Event()
        self.release = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _relay(self) -> None:
                body = self._body()
                hold = proxy.hold
                if hold is not None and self.command in hold[0].split("|") and hold[1].search(self.path):
                    proxy.held.set()
                    proxy.release.wait(120)
                    self.close_connection = True
                    return  # the client's request is never answered
                rule = proxy.fail
                if rule is not None and self.command in rule[0].split("|") and rule[1].search(self.path):
                    proxy.failed.append(f"{self.command} {self.path}")
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("transfer-encoding", "content-length", "expect")
                }
                headers["Content-Length"] = str(len(body))
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                    self.send_response(response.status, response.reason)
                    for key, value in response.getheaders():
                        if key.lower() not in ("transfer-encoding", "content-length", "connection"):
                            self.send_header(key, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @contextmanager
    def failing(self, method: str, path_pattern: str) -> Iterator[None]:
        self.fail = (method, re.compile(path_pattern))
        try:
            yield
        finally:
            self.fail = None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
