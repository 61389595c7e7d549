"""A small real Prometheus-API HTTP server for the rebalancer's `spec.router.prometheusUrl` path (on the test
control plane kwok's sampler pods run no process to scrape): it answers the rebalancer's instant query
with the decode tokens/s `rate(samplergroup)` gives for the SamplerGroup the query's pod regex names, and
records every query."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

RateOf = Callable[[str], float]  # SamplerGroup name -> decode tokens/s


@contextmanager
def fake_prometheus(rate: RateOf) -> Iterator[tuple[str, list[str]]]:
    """(its URL, the queries it received) while it runs."""
    queries: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's API
            query = parse_qs(urlsplit(self.path).query).get("query", [""])[0]
            queries.append(query)
            match = re.search(r'pod=~"([a-z0-9-]+?)-\[a-z0-9\]', query)
            value = rate(match.group(1)) if match else 0.0
            body = json.dumps(
                {
                    "status": "success",
                    "data": {
                        "resultType": "vector",
                        "result": [{"metric": {}, "value": [time.time(), str(value)]}],
                    },
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", queries
    finally:
        server.shutdown()
        server.server_close()
