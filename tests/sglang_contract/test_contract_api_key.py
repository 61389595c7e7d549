"""SGLang 0.5.23's `--api-key`, decided by its own code, against the reference server's (the job's key,
docs/sampler.md "The engine API").

http_server.py cannot be imported here (its imports need xgrammar): each route's path and auth level
(`@auth_level(AuthLevel.ADMIN_OPTIONAL)`, else NORMAL) are read from its source, and SGLang's own
`decide_request_auth` (sglang/srt/utils/auth.py) decides with `--api-key` set and no `--admin-api-key`,
as the operator launches it. For every path rlfleet calls or serves, the reference server with
`--api-key` over real HTTP allows and refuses exactly what SGLang does: the weight-update, pause and
generation paths need the key; probes and /metrics stay open."""

from __future__ import annotations

import ast

import httpx
import pytest
import sglang_made as sm
from sglang.srt.utils.auth import AuthLevel, decide_request_auth
from support.tiny_models import SERVED_MODEL

from rlfleet.sampler.http_app import start_reference_server
from rlfleet.sampler.reference_engine import EngineConfig, ReferenceEngine, tiny_shape

KEY = "job-key"
MODEL = tiny_shape(**SERVED_MODEL)
# (method, path) rlfleet's parts call on an engine (the sidecar, the router, the trainer's client, probes, scrapes)
CALLED = [("POST", "/update_weights_from_disk"), ("POST", "/pause_generation"), ("POST", "/continue_generation"),
          ("POST", "/generate"), ("GET", "/model_info"), ("GET", "/server_info"), ("GET", "/health"),
          ("GET", "/health_generate"), ("GET", "/metrics")]  # fmt: skip
BODIES = {"/update_weights_from_disk": {"model_path": "/nonexistent"}, "/generate": {"input_ids": [1, 2],
          "sampling_params": {"max_new_tokens": 1}}, "/pause_generation": {}, "/continue_generation": {}}  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def sglang_auth_levels() -> dict[tuple[str, str], AuthLevel]:
    """(method, path) -> auth level of each route in SGLang's http_server.py."""
    levels: dict[tuple[str, str], AuthLevel] = {}
    for node in ast.walk(ast.parse(sm.sglang_source("srt/entrypoints/http_server.py"))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        level, routes = AuthLevel.NORMAL, []
        for d in node.decorator_list:
            if not isinstance(d, ast.Call) or not isinstance(d.func, ast.Attribute | ast.Name):
                continue
            name = d.func.attr if isinstance(d.func, ast.Attribute) else d.func.id
            if name == "auth_level":
                level = AuthLevel[ast.unparse(d.args[0]).split(".")[-1]]
            elif (
                name in ("get", "post", "put", "delete", "api_route")
                and d.args
                and isinstance(d.args[0], ast.Constant)
            ):
                path = d.args[0].value  # a literal path (a few routes are registered from a variable)
                methods = (
                    [name.upper()]
                    if name != "api_route"
                    else next(ast.literal_eval(k.value) for k in d.keywords if k.arg == "methods")
                )
                routes += [(m, path) for m in methods]
        for route in routes:
            levels[route] = level
    return levels


def sglang_allows(method: str, path: str, level: AuthLevel, header: str | None) -> bool:
    return decide_request_auth(
        method=method,
        path=path,
        authorization_header=header,
        api_key=KEY,
        admin_api_key=None,
        auth_level=level,
    ).allowed


async def test_the_reference_servers_api_key_is_sglangs_for_every_path_rlfleet_uses() -> None:
    levels = sglang_auth_levels()
    # the weight-update API is an admin-optional route: with only --api-key, the api key opens it
    assert levels[("POST", "/update_weights_from_disk")] == AuthLevel.ADMIN_OPTIONAL
    engine = ReferenceEngine(EngineConfig(model=MODEL, seed=3))
    async with (
        await start_reference_server(engine, api_key=KEY) as server,
        httpx.AsyncClient(timeout=60) as http,
    ):
        for method, path in CALLED:
            level = levels.get((method, path), AuthLevel.NORMAL)  # /metrics is mounted apart (open by prefix)
            for header in (None, "Bearer wrong", f"Bearer {KEY}"):
                headers = {"Authorization": header} if header else {}
                response = await http.request(
                    method, server.url + path, json=BODIES.get(path), headers=headers
                )
                expected = sglang_allows(method, path, level, header)
                assert (response.status_code != 401) == expected, (method, path, header, response.status_code)
        # the keyed calls above paused generation: continue, so the engine stops cleanly
        await http.post(
            server.url + "/continue_generation", json={}, headers={"Authorization": f"Bearer {KEY}"}
        )
    refused = [p for m, p in CALLED if not sglang_allows(m, p, levels.get((m, p), AuthLevel.NORMAL), None)]
    assert refused == [
        "/update_weights_from_disk",
        "/pause_generation",
        "/continue_generation",
        "/generate",
        "/model_info",
        "/server_info",
    ]
