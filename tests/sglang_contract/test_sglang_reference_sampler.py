"""The reference sampler server held against SGLang 0.5.23's own code, over real HTTP.

- SGLang's `SpecSamplingMaskKit.test_sampling_mask` (sglang/test/kits/spec_server_kits.py) runs
  unchanged against our server: a mixed greedy/sampling batch in both logprob modes.
- Every response equals, key for key and in order, what SGLang's TokenizerManager assembles from the
  same sampled tokens (`sglang_made.generate_response`), in support, selected and head mode, also for a
  request that straddles an `/update_weights_from_disk` (weight-version spans).
- Every refused body gets SGLang's status and body shape (and, past the FastAPI parse, its message):
  the oracle is FastAPI's parse of `GenerateReqInput` (pydantic, as FastAPI runs it), then
  `sglang_made.admit` (the contract gate, normalisation, the tokenizer manager's checks and
  SamplingParams.verify, the scheduler's mask rule compiled from its source).
- Mid-request aborts (a realised support over the cap; a sampled token outside the support) are
  answered as SGLang's `_handle_abort_finish_reason` + http_server handlers answer them.
- /metrics has the names, label names and buckets SGLang's collectors register, counts requests and
  tokens when they finish, and shows decode progress in gen_throughput / realtime_tokens_total.

Stubbed, because it cannot exist here: the tokenizer (the kit sends text; the reference server has
none, so the kit's requests get input_ids from the text's bytes modulo the vocabulary); the two mask aborts cannot happen on
the pytorch sampling path (support <= top_k <= cap; the draw comes from the support), so those two
tests make the engine's sampler report the status SGLang's CUDA path can report.
"""

from __future__ import annotations

import ast
import asyncio
import unittest
import unittest.mock
from pathlib import Path
from typing import Any

import httpx
import pytest
import sglang_made as sm
from prometheus_client.parser import text_string_to_metric_families

from rlfleet.sampler import reference_engine as engine_mod
from rlfleet.sampler import request_gate
from rlfleet.sampler import sampling as sampling_mod
from rlfleet.sampler import server as srv_mod
from rlfleet.sampler.reference_engine import EngineConfig, ReferenceEngine, tiny_shape
from rlfleet.sampler.server import start_reference_server
from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model

# sglang_made's SGLang context: vocabulary 64, context length 512, --sampling-mask-max-tokens 4096
# the tiny Qwen3 at the sizes the CLI's tiny-Qwen3 flags build (intermediate 2 x hidden, KV heads = heads)
SIZES = {"vocab_size": sm.VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512}  # fmt: skip
MODEL = tiny_shape(**SIZES)
SAMPLING = {"temperature": 0.9, "top_p": 0.9, "top_k": 12, "max_new_tokens": 6}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def engine(**kw: Any) -> ReferenceEngine:
    return ReferenceEngine(EngineConfig(model=MODEL, seed=3, **kw))


def tokens_of(meta: dict[str, Any], support_meta: dict[str, Any] | None = None) -> list[sm.Token]:
    """Our response's sampled tokens as sglang_made.Token (supports from a support-mode response)."""
    src = support_meta or meta
    masks = src.get("output_token_sampling_mask") or [[] for _ in meta["output_token_logprobs"]]
    slps = src.get("output_token_sampling_logprobs") or [[] for _ in meta["output_token_logprobs"]]
    tops = meta.get("output_top_logprobs") or [[] for _ in meta["output_token_logprobs"]]
    return [
        sm.Token(id=t[1], logprob=t[0], support=m, support_logprobs=s, top=[(x[0], x[1]) for x in h])
        for t, m, s, h in zip(meta["output_token_logprobs"], masks, slps, tops, strict=True)
    ]


def version_events(spans: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """The WeightVersionEvents SGLang records for these spans (one per update: old version, tokens)."""
    return [(s["version"], s["end"]) for s in spans[:-1]]


def strip(response: dict[str, Any]) -> dict[str, Any]:
    response["meta_info"].pop("e2e_latency", None)
    return response


# ------------------------------------------------------------------------------------ the kit
async def test_sglang_sampling_mask_kit_passes_against_the_server(monkeypatch):
    import requests
    from sglang.test.kits.spec_server_kits import SpecSamplingMaskKit

    real_post = requests.post
    sent: list[dict[str, Any]] = []

    def post(url: str, json: dict[str, Any], **kw: Any) -> Any:  # the tokenizer stub (module docstring)
        body = dict(json)
        texts = body.pop("text")
        body["input_ids"] = [[b % sm.VOCAB for b in t.encode()] for t in texts]
        sent.append(body)
        return real_post(url, json=body, **kw)

    monkeypatch.setattr(requests, "post", post)
    async with await start_reference_server(engine(weight_format="fp32")) as server:

        class Kit(SpecSamplingMaskKit, unittest.TestCase):
            base_url = server.url

        await asyncio.to_thread(Kit("test_sampling_mask").test_sampling_mask)
    assert sent and sent[0]["sampling_logprobs_mode"] == ["selected", "selected", "support", "support"]


# ------------------------------------------------------------------------------------ responses
async def test_responses_equal_what_sglang_assembles_in_every_mode():
    async with await start_reference_server(engine()) as server, httpx.AsyncClient() as http:

        async def generate(**extra: Any) -> dict[str, Any]:
            body = {
                "input_ids": [5, 9, 2],
                "sampling_params": {**SAMPLING, "sampling_seed": 11},
                "return_logprob": True,
                "rid": "rlfleet-contract",
                **extra,
            }
            r = await http.post(server.url + "/generate", json=body)
            assert r.status_code == 200, r.text
            return strip(r.json())

        support = await generate(return_sampling_mask=True, sampling_logprobs_mode="support")
        selected = await generate(return_sampling_mask=True)  # SGLang's default mode with the mask
        head = await generate(top_logprobs_num=4)
    assert support["output_ids"] == selected["output_ids"] == head["output_ids"]  # same seed, same draws
    for mode, ours in (("support", support), ("selected", selected), ("head", head)):
        _, expected = await asyncio.to_thread(
            sm.generate_response,
            [5, 9, 2],
            tokens_of(ours["meta_info"], support["meta_info"]),
            mode=mode,
            top_logprobs_num=4,
            current_version="0",
            finish_reason=ours["meta_info"]["finish_reason"],
        )
        assert list(ours) == list(expected) and list(ours["meta_info"]) == list(expected["meta_info"]), mode
        assert ours == expected, mode
    assert isinstance(selected["meta_info"]["output_token_sampling_logprobs"][0], float)
    assert support["meta_info"]["output_token_sampling_mask_length"] == 6


async def test_weight_version_flag_and_spans_across_an_update(tmp_path):
    from rlfleet.numerics import views

    update = tiny_model(TinyQwen3(**SIZES, seed=4))
    update.save_pretrained(tmp_path / "base")
    views.save_view(update.state_dict(), "bf16", tmp_path / "v8", base_checkpoint=tmp_path / "base")
    args = srv_mod._parser().parse_args(
        [
            "--vocab-size",
            str(sm.VOCAB),
            "--hidden-size",
            "32",
            "--num-hidden-layers",
            "1",
            "--num-attention-heads",
            "2",
            "--head-dim",
            "16",
            "--context-length",
            "512",
            "--weight-version",
            "7",
            "--max-tokens-per-second",
            "40",
        ]
    )
    eng, _ = srv_mod._reference_engine(args)
    assert eng.config.model == MODEL
    async with await start_reference_server(eng) as server, httpx.AsyncClient(timeout=30) as http:
        assert (await http.get(server.url + "/model_info")).json()["weight_version"] == "7"
        body = {
            "input_ids": [1, 2],
            "sampling_params": {**SAMPLING, "max_new_tokens": 16},
            "rid": "rlfleet-contract",
            "return_logprob": True,
            "return_sampling_mask": True,
            "sampling_logprobs_mode": "support",
        }
        pending = asyncio.create_task(http.post(server.url + "/generate", json=body))
        while eng.stats.realtime_decode_tokens < 4:
            await asyncio.sleep(0.01)
        r = await http.post(
            server.url + "/update_weights_from_disk",
            json={"model_path": str(tmp_path / "v8"), "weight_version": "8"},
        )
        assert r.json() == {
            "success": True,
            "message": "Succeeded to update model weights. Weight version updated to 8.",
            "num_paused_requests": 0,
        }
        ours = strip((await pending).json())
        assert (await http.get(server.url + "/model_info")).json()["weight_version"] == "8"
    spans = ours["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["7", "8"] and 4 <= spans[0]["end"] < 16
    _, expected = await asyncio.to_thread(
        sm.generate_response,
        [1, 2],
        tokens_of(ours["meta_info"]),
        mode="support",
        version_events=version_events(spans),
        current_version="8",
        finish_reason=ours["meta_info"]["finish_reason"],
    )
    assert ours == expected


# ------------------------------------------------------------------------------------ validation
BODIES: list[dict[str, Any]] = [
    {"input_ids": [1, 2], "return_sampling_mask": True, "sampling_params": {"top_k": 8, "max_new_tokens": 1}},
    {"input_ids": [1, 2], "sampling_logprobs_mode": "support", "sampling_params": {"max_new_tokens": 1}},
    {"input_ids": [1, 2], "return_sampling_mask": True, "sampling_params": {"top_p": 0.9}},
    {"input_ids": [1, 2], "return_sampling_mask": True, "sampling_params": {"top_k": 4097}},
    {
        "input_ids": [1],
        "return_sampling_mask": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 1},
    },
    {"input_ids": [1], "sampling_params": {"top_k": 0}},
    {"input_ids": [1], "sampling_params": {"top_k": -3}},
    {"input_ids": [1], "sampling_params": {"top_p": 0}},
    {"input_ids": [1], "sampling_params": {"top_p": 1.5}},
    {"input_ids": [1], "sampling_params": {"min_p": 2}},
    {"input_ids": [1], "sampling_params": {"temperature": -1}},
    {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
    {"input_ids": [1], "sampling_params": {"sampling_seed": 2**63}},
    {"input_ids": [1], "sampling_params": {"bogus": 1}},
    {"input_ids": [1], "sampling_params": {"top_k": 1.5}},
    {"input_ids": [1], "return_sampling_mask": "yes"},
    {"input_ids": [1], "sampling_logprobs_mode": "both", "return_sampling_mask": True},
    {"input_ids": "x"},
    {"input_ids": []},
    {"sampling_params": {}},
    {"input_ids": list(range(10)), "sampling_params": {"max_new_tokens": 600}},
    {"input_ids": [1] * 512, "sampling_params": {"max_new_tokens": 0}},
    {"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]},
]


def sglang_answer(body: dict[str, Any]) -> tuple[int, str, str | None]:
    """(status, body shape, message) SGLang answers: FastAPI's parse, then sglang_made.admit."""
    import pydantic
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput

    try:
        pydantic.TypeAdapter(GenerateReqInput).validate_python(body)
    except pydantic.ValidationError:
        return 400, "ErrorResponse", None
    contract = generate_contract_error(body)
    if contract is not None:
        return 400, "contract", contract
    batched = (
        isinstance(body.get("input_ids"), list)
        and body["input_ids"]
        and isinstance(body["input_ids"][0], list)
    )
    items = (
        [
            {"input_ids": ids, "sampling_params": sp}
            for ids, sp in zip(body["input_ids"], body["sampling_params"], strict=True)
        ]
        if batched
        else [body]
    )  # sglang_made.admit takes one request: a batch is admitted item by item (normalize splits it so)
    try:
        for item in items:
            sm.admit(item)
    except sm.Rejected as exc:
        return 400, "value_error", str(exc)
    return 200, "ok", None


def shape_of(status: int, body: Any) -> tuple[int, str, str | None]:
    if status == 200:
        return 200, "ok", None
    if isinstance(body, dict) and body.get("object") == "error":
        assert set(body) == {"object", "message", "type", "param", "code"} and body["code"] == status
        return status, "ErrorResponse", None
    if isinstance(body.get("error"), str):
        return status, "contract", body["error"]
    assert set(body) == {"error"} and set(body["error"]) == {"message"}, body
    return status, "value_error", body["error"]["message"]


async def test_refused_bodies_get_sglangs_status_shape_and_message():
    async with await start_reference_server(engine()) as server, httpx.AsyncClient() as http:
        for body in BODIES:
            r = await http.post(server.url + "/generate", json=body)
            assert shape_of(r.status_code, r.json()) == await asyncio.to_thread(sglang_answer, body), body
    assert sum(sglang_answer(b)[0] == 200 for b in BODIES) == 3  # the grid has both outcomes


def test_scheduler_mask_rule_and_constants_are_sglangs():
    from sglang.srt.sampling import sampling_params

    assert (sampling_mod.SAMPLING_EPS, sampling_mod.TOP_K_ALL) == (
        sampling_params._SAMPLING_EPS,
        sampling_params.TOP_K_ALL,
    )
    for cap in (1, 2, 64, 4096):
        for top_k in (1, 2, 63, 64, 65, 4096, 4097, sampling_params.TOP_K_ALL):
            assert request_gate.mask_rule_message(top_k, cap) == sm.scheduler_mask_error(top_k, cap)
    from sglang.srt.layers.logits_processor import SamplingMaskStatus

    assert {s.name: int(s) for s in sampling_mod.MaskStatus} == {
        n: int(getattr(SamplingMaskStatus, n)) for n in ("OK", "OVERFLOW", "INVALID")
    }


# ------------------------------------------------------------------------------------ aborts
@pytest.mark.parametrize("status", [sampling_mod.MaskStatus.OVERFLOW, sampling_mod.MaskStatus.INVALID])
async def test_mid_request_mask_aborts_are_sglangs_errors(monkeypatch, status):
    real_sample = engine_mod.sample
    calls = {"n": 0}

    def sample(*args: Any, **kw: Any) -> sampling_mod.SampleResult:  # the CUDA-only status (docstring)
        res = real_sample(*args, **kw)
        calls["n"] += 1
        if calls["n"] == 3:
            res.statuses[:] = int(status)
        return res

    monkeypatch.setattr(engine_mod, "sample", sample)
    eng = engine()
    async with await start_reference_server(eng) as server, httpx.AsyncClient() as http:
        r = await http.post(
            server.url + "/generate",
            json={"input_ids": [1], "sampling_params": SAMPLING, "return_sampling_mask": True},
        )
        assert not eng.running and len(eng.free_slots) == eng.config.max_running_requests
    finish = (
        sm.mask_overflow_abort() if status == sampling_mod.MaskStatus.OVERFLOW else sm.outside_support_abort()
    )
    assert engine_mod.mask_abort_reason(int(status), 4096) == finish
    assert (r.status_code, r.json()) == await asyncio.to_thread(sm.error_response, finish)
    assert eng.stats.generation_tokens_total == 2  # the aborted token was not committed


# ------------------------------------------------------------------------------------ metrics
def sglang_registered() -> dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None]]:
    """name -> (kind, label names, buckets) as SGLang's two collectors register them, with the label
    sets SGLang builds (the scheduler's from its construction site in metrics_collector.py, the
    tokenizer's from `tokenizer_metric_labels()`)."""
    from sglang.srt.observability import metrics_collector as mc
    from sglang.srt.runtime_context import use_context

    registered: dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None]] = {}

    class Record:
        def __init__(self, kind: str) -> None:
            self.kind = kind

        def __call__(self, name: str, documentation: str = "", labelnames: Any = (), **kw: Any) -> Any:
            buckets = kw.get("buckets")
            registered[name] = (
                self.kind,
                tuple(labelnames),
                tuple(float(b) for b in buckets) if buckets else None,
            )
            return unittest.mock.MagicMock()

    tree = ast.parse(Path(mc.__file__).read_text())
    site = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Dict)
        and {"engine_type", "tp_rank"} <= {k.value for k in n.keys if isinstance(k, ast.Constant)}
    )
    sched_labels = {k.value: "0" for k in site.keys}  # type: ignore[union-attr]

    class Scheduler(mc.SchedulerMetricsCollector):
        _counter_cls, _gauge_cls, _histogram_cls, _summary_cls = (
            Record("counter"),
            Record("gauge"),
            Record("histogram"),
            Record("summary"),
        )

    class Tokenizer(mc.TokenizerMetricsCollector):
        _counter_cls, _gauge_cls, _histogram_cls = Record("counter"), Record("gauge"), Record("histogram")

    ctx = sm.context("scheduler")
    with use_context(ctx):
        Scheduler(labels=sched_labels, server_args=ctx.server_args)
    ctx = sm.context("tokenizer")
    with use_context(ctx):
        Tokenizer(server_args=ctx.server_args, labels=mc.tokenizer_metric_labels())
    return registered


def scrape(text: str) -> dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None, dict]]:
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.endswith("_created"):
            continue
        name = fam.name + ("_total" if fam.type == "counter" else "")
        samples = [s for s in fam.samples if not s.name.endswith("_created")]
        labels = tuple(k for k in samples[0].labels if k != "le") if samples else ()
        buckets = tuple(
            float(s.labels["le"]) for s in samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
        )
        out[name] = (
            fam.type,
            labels,
            buckets or None,
            {tuple(sorted(s.labels.items())): s.value for s in samples},
        )
    return out


async def test_metrics_are_sglangs_names_labels_and_counting():
    eng = engine(max_tokens_per_second=60.0)
    async with await start_reference_server(eng) as server, httpx.AsyncClient(timeout=30) as http:

        async def metrics() -> dict[str, Any]:
            return scrape((await http.get(server.url + "/metrics")).text)

        assert (await http.get(server.url + "/health_generate")).status_code == 200  # never counted
        long = asyncio.create_task(
            http.post(
                server.url + "/generate",
                json={"input_ids": [1, 2, 3], "sampling_params": {**SAMPLING, "max_new_tokens": 40}},
            )
        )
        while eng.stats.realtime_decode_tokens < 10:
            await asyncio.sleep(0.02)
        busy = await metrics()
        await long
        done = await metrics()
    expected = sglang_registered()
    ours_names = set(done)
    assert ours_names == {
        "sglang:gen_throughput",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "sglang:realtime_tokens_total",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:num_requests_total",
        "sglang:time_to_first_token_seconds",
        "sglang:e2e_request_latency_seconds",
    }
    for name in ours_names:
        kind, labels, buckets = expected[name]
        assert done[name][0] == kind and set(done[name][1]) == set(labels), name
        if kind == "histogram":
            assert done[name][2] == buckets, name

    def value(snapshot: dict[str, Any], name: str, **labels: str) -> float:
        return sum(v for k, v in snapshot[name][3].items() if set(labels.items()) <= set(k))

    assert value(busy, "sglang:generation_tokens_total") == 0  # nothing finished yet: counted on finish
    assert value(busy, "sglang:num_requests_total") == 0
    assert value(busy, "sglang:gen_throughput") > 0  # while decoding, the gauge shows the rate
    assert value(busy, "sglang:realtime_tokens_total", mode="decode") >= 10
    assert value(busy, "sglang:num_running_reqs") == 1
    assert value(done, "sglang:generation_tokens_total", is_streaming="false") == 40
    assert value(done, "sglang:prompt_tokens_total") == 3 and value(done, "sglang:num_requests_total") == 1
    assert value(done, "sglang:realtime_tokens_total", mode="decode") == 41  # + the health check's token


# ------------------------------------------------------------------------------------ control endpoints
def http_server_content(function: str) -> dict[str, Any]:
    """The literal `content=` dict a route of SGLang's http_server.py answers (read from its source:
    the module needs the full server stack to import)."""
    tree = ast.parse(sm.sglang_source("srt/entrypoints/http_server.py"))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.name == function)
    keyword = next(
        k for n in ast.walk(fn) if isinstance(n, ast.Call) for k in n.keywords if k.arg == "content"
    )
    return ast.literal_eval(keyword.value)


async def test_pause_and_continue_answer_sglangs_bodies():
    async with await start_reference_server(engine()) as server, httpx.AsyncClient() as http:
        paused = await http.post(server.url + "/pause_generation", json={"mode": "retract"})
        resumed = await http.post(server.url + "/continue_generation", json={})
    assert (paused.status_code, paused.json()) == (200, http_server_content("pause_generation"))
    assert (resumed.status_code, resumed.json()) == (200, http_server_content("continue_generation"))
