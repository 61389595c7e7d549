"""SGLang 0.5.23's /health_generate, run from its own source, against the reference sampler's and the
router's reading of it (docs/router.md, "Hung replicas").

http_server.py cannot be imported here (its imports need xgrammar), so its `health_generate` is
compiled from the installed source and run with the names it reads from its module: SGLang's own
GenerateReqInput, ServerStatus, envs, constants and runtime context, and in place of the process's
TokenizerManager an object with the five attributes the function reads, whose `generate_request`
either returns a token (the scheduler answered: `last_receive_tstamp` moves, as
TokenizerManager.handle_loop does) or never returns (the scheduler hangs)."""

from __future__ import annotations

import ast
import asyncio
import logging
import time
import types
import uuid

import aiohttp
import pytest
import sglang_made as sm
from fastapi import Request
from fastapi.responses import Response
from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX
from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST, DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import EmbeddingReqInput, GenerateReqInput
from sglang.srt.managers.tokenizer_manager import ServerStatus
from sglang.srt.runtime_context import get_disagg, use_context
from support.tiny_models import SERVED_MODEL

from rlfleet.router.config import RouterConfig
from rlfleet.sampler.reference_engine import EngineConfig, ReferenceEngine, tiny_shape
from rlfleet.sampler.server import start_reference_server

TIMEOUT_S = 1  # SGLANG_HEALTH_CHECK_TIMEOUT for both servers here
MODEL = tiny_shape(**SERVED_MODEL)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _http_server_module() -> ast.Module:
    return ast.parse(sm.sglang_source("srt/entrypoints/http_server.py"))


def sglang_health_generate(tokenizer_manager: object):
    """http_server.health_generate, compiled from SGLang's source (its route decorators dropped)."""
    node = next(
        n
        for n in _http_server_module().body
        if isinstance(n, ast.AsyncFunctionDef) and n.name == "health_generate"
    )
    node.decorator_list = []
    names = {
        "_global_state": types.SimpleNamespace(tokenizer_manager=tokenizer_manager),
        "HEALTH_CHECK_TIMEOUT": TIMEOUT_S,
        "ServerStatus": ServerStatus,
        "envs": envs,
        "HEALTH_CHECK_RID_PREFIX": HEALTH_CHECK_RID_PREFIX,
        "GenerateReqInput": GenerateReqInput,
        "EmbeddingReqInput": EmbeddingReqInput,
        "get_disagg": get_disagg,
        "DisaggregationMode": DisaggregationMode,
        "FAKE_BOOTSTRAP_HOST": FAKE_BOOTSTRAP_HOST,
        "Request": Request,
        "Response": Response,
        "asyncio": asyncio,
        "time": time,
        "uuid": uuid,
        "logger": logging.getLogger("sglang-contract"),
    }
    exec(compile(ast.Module(body=[node], type_ignores=[]), "http_server.py", "exec"), names)  # noqa: S102
    return names["health_generate"]


def tokenizer_manager(scheduler_answers: bool, status: ServerStatus = ServerStatus.Up, exiting: bool = False):
    tm = types.SimpleNamespace(
        gracefully_exit=exiting,
        server_status=status,
        is_generation=True,
        last_receive_tstamp=0.0,
        rid_to_state={},
    )

    async def generate_request(obj, request):
        assert obj.input_ids == [0] and obj.sampling_params == {"max_new_tokens": 1, "temperature": 0.0}
        if not scheduler_answers:
            await asyncio.Event().wait()
        tm.last_receive_tstamp = time.time()
        yield {"output_ids": [7]}

    tm.generate_request = generate_request
    return tm


async def sglang_answer(tm: object) -> tuple[int, bytes]:
    request = Request(
        {"type": "http", "method": "GET", "path": "/health_generate", "headers": [], "query_string": b""}
    )
    with use_context(sm.context("tokenizer")):
        response = await sglang_health_generate(tm)(request)
    return response.status_code, bytes(response.body)


async def reference_answer(paused: bool) -> tuple[int, bytes]:
    server = await start_reference_server(ReferenceEngine(EngineConfig(model=MODEL, seed=1)))
    try:
        if paused:
            server.engine.pause()
        async with aiohttp.ClientSession() as http, http.get(server.url + "/health_generate") as r:
            return r.status, await r.read()
    finally:
        await server.stop()


async def test_a_generating_engine_answers_200_in_sglang_and_the_reference(monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", str(TIMEOUT_S))
    tm = tokenizer_manager(scheduler_answers=True)
    assert await sglang_answer(tm) == (200, b"") == await reference_answer(paused=False)
    assert tm.rid_to_state == {}


async def test_a_hung_engine_answers_503_after_the_timeout_in_sglang_and_the_reference(monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", str(TIMEOUT_S))
    tm = tokenizer_manager(scheduler_answers=False)
    assert await sglang_answer(tm) == (503, b"") == await reference_answer(paused=True)
    assert tm.server_status == ServerStatus.UnHealthy


@pytest.mark.parametrize(("status", "exiting"), [(ServerStatus.Starting, False), (ServerStatus.Up, True)])
async def test_sglang_starting_or_draining_answers_503_at_once(status: ServerStatus, exiting: bool) -> None:
    """The router reads these as unready (not hung): a draining engine keeps its requests in flight."""
    assert await sglang_answer(tokenizer_manager(scheduler_answers=True, status=status, exiting=exiting)) == (
        503,
        b"",
    )


def test_the_routers_probe_timeout_is_below_sglangs_own() -> None:
    """A hung SGLang answers 503 only after SGLANG_HEALTH_CHECK_TIMEOUT (default 20 s, read from its
    source); the router's probe gives up before, so a hang reads as no answer (hung), never as the 503
    a draining engine gives."""
    assign = next(
        n
        for n in _http_server_module().body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "HEALTH_CHECK_TIMEOUT"
    )
    assert ast.unparse(assign.value) == "int(os.getenv('SGLANG_HEALTH_CHECK_TIMEOUT', 20))"
    assert RouterConfig().health_timeout_seconds < 20
    assert RouterConfig().health_path == "/health_generate"
