"""SGLang client: request shape, parsing of SGLang 0.5.23's answers (fixtures assembled by SGLang's own
code, tests/sglang_contract), and the client's retry policy against a real HTTP server (aiohttp on
127.0.0.1) that replays those answers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from rlfleet import records as rec
from rlfleet.retries import ClientRetryPolicy
from rlfleet.sampler import protocol as proto
from rlfleet.sampler.client import SamplerClient, TurnFailed

FIXTURES = Path(__file__).parent / "fixtures"


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


# ------------------------------------------------------------------------------------ requests
def test_request_support_mode_sends_finite_top_k_and_mask_fields():
    cfg = proto.SamplingConfig(temperature=0.8, top_p=0.9, top_k=-1, max_new_tokens=7, stop_token_ids=[3])
    body = proto.build_generate_request([1, 2, 3], cfg, sampling_seed=11)
    assert body == {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "temperature": 0.8,
            "top_p": 0.9,
            "top_k": proto.DEFAULT_MASK_TOP_K,
            "max_new_tokens": 7,
            "stop_token_ids": [3],
            "sampling_seed": 11,
        },
        "return_logprob": True,
        "return_sampling_mask": True,
        "sampling_logprobs_mode": "support",
    }


def test_request_head_mode_when_untruncated():
    cfg = proto.SamplingConfig.from_dict(
        {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "head_size": 64, "junk": 1}
    )
    body = proto.build_generate_request([5], cfg)
    assert cfg.mode == rec.HEAD_MODE
    assert body["top_logprobs_num"] == 64 and "return_sampling_mask" not in body
    assert body["sampling_params"]["top_k"] == -1
    with pytest.raises(ValueError, match="top_p"):
        proto.SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        proto.SamplingConfig(top_k=0)


# ------------------------------------------------------------------------------------ fixtures
# Every fixture is SGLang 0.5.23's own assembly (tests/sglang_contract/sglang_fixtures.py rebuilds and
# compares each one).
def _span_versions(meta: dict) -> list[int]:
    return [int(s["version"]) for s in meta["weight_versions"] for _ in range(s["start"], s["end"])]


def _check_support_turn(fx: dict, turn: rec.SampledTurn) -> None:
    meta = fx["response"]["meta_info"]
    assert turn.candidate_mode == rec.SUPPORT_MODE
    assert turn.prompt_ids.tolist() == fx["request"]["input_ids"]
    assert turn.output_ids.tolist() == [t[1] for t in meta["output_token_logprobs"]]
    assert np.array_equal(turn.logprobs, np.float32([t[0] for t in meta["output_token_logprobs"]]))
    assert meta["output_token_sampling_mask_length"] == turn.num_tokens  # ONE int: the number of rows
    for i, (mask, lps) in enumerate(
        zip(meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"], strict=True)
    ):
        ids, lp = turn.support(i)
        assert ids.tolist() == mask and np.array_equal(lp, np.float32(lps))
        assert turn.sampled_logprobs[i] == np.float32(lps[mask.index(int(turn.output_ids[i]))])
    assert turn.weight_versions.tolist() == _span_versions(meta)
    assert turn.finish_reason == meta["finish_reason"]["type"]


def test_fixture_request_straddling_a_weight_update():
    fx = load("sglang_support_straddle.json")
    turn = proto.parse_generate_response(fx["response"], fx["request"]["input_ids"], group="g", replica="r0")
    _check_support_turn(fx, turn)
    assert turn.weight_versions.tolist() == [11, 11, 12]  # per token from the spans, not all "12"
    assert turn.valid.all() and turn.finish_reason == "length" and turn.cached_tokens == 2
    assert (turn.group, turn.replica) == ("g", "r0")


def test_fixture_ties_at_the_cutoff_are_valid_records():
    fx = load("sglang_support_tie_at_cutoff.json")
    turn = proto.parse_generate_response(fx["response"], fx["request"]["input_ids"])
    _check_support_turn(fx, turn)
    assert turn.valid.all() and turn.finish_reason == "stop" and turn.weight_versions.tolist() == [12, 12]
    ids0, lp0 = turn.support(0)
    assert lp0[1] == lp0[2]  # an exact tie inside the kept set is not "unsorted"
    ids1, lp1 = turn.support(1)
    assert ids1.tolist() == [4, 9, 15] and lp1[0] == lp1[1]  # the crossing token 15 is kept, 16 and 17 not


def test_fixture_selected_mode_is_flagged_not_used():
    fx = load("sglang_selected_mode.json")
    turn = proto.parse_generate_response(fx["response"], fx["request"]["input_ids"])
    meta = fx["response"]["meta_info"]
    assert np.array_equal(turn.sampled_logprobs, np.float32(meta["output_token_sampling_logprobs"]))
    # the same tokens in support mode: the selected float is the support's logprob at the sampled token
    twin = proto.parse_generate_response(load("sglang_support_tie_at_cutoff.json")["response"], [1])
    assert np.array_equal(turn.sampled_logprobs, twin.sampled_logprobs)
    assert turn.support_ids.tolist() == sum(meta["output_token_sampling_mask"], [])
    assert not turn.valid.any()
    assert turn.invalid_reasons[proto.R_SUPPORT_MISSING] == 2


def test_fixture_head_mode():
    fx = load("sglang_head_mode.json")
    turn = proto.parse_generate_response(fx["response"], fx["request"]["input_ids"], untruncated=True)
    meta = fx["response"]["meta_info"]
    assert turn.candidate_mode == rec.HEAD_MODE and turn.valid.all()
    for i, head in enumerate(meta["output_top_logprobs"]):
        ids, lp = turn.support(i)
        assert ids.tolist() == [t[1] for t in head] and np.array_equal(lp, np.float32([t[0] for t in head]))
    # untruncated sampling: q_S = q, so the renormalised logprob is the full-vocabulary one
    assert np.array_equal(turn.sampled_logprobs, turn.logprobs)
    # token 2 was the 4th most likely: inside the head; head mode never requires membership anyway
    assert int(turn.output_ids[2]) == meta["output_top_logprobs"][2][3][1]


def test_fixture_invalid_tokens_are_flagged_and_counted():
    fx = load("sglang_invalid_tokens.json")
    turn = proto.parse_generate_response(fx["response"], fx["request"]["input_ids"])
    assert turn.valid.tolist() == [True, False, False, False]
    r = turn.invalid_reasons
    assert r[rec.R_NOT_IN_SUPPORT] == 1
    assert r[rec.R_NOT_NORMALISED] == 1
    assert r[rec.R_BAD_LOGPROB] == 1


def test_length_disagreement_invalidates_turn_and_garbage_raises():
    fx = load("sglang_support_straddle.json")

    def broken(**meta: object) -> rec.SampledTurn:
        resp = json.loads(json.dumps(fx["response"]))
        resp["meta_info"].update(meta)
        return proto.parse_generate_response(resp, [1])

    whole_turn = {proto.R_LENGTH_MISMATCH: 3}
    assert broken(completion_tokens=5).invalid_reasons == whole_turn
    assert broken(output_token_sampling_mask_length=4).invalid_reasons == whole_turn
    assert (
        broken(output_token_sampling_mask_length=[3, 2, 1]).invalid_reasons == whole_turn
    )  # not SGLang's shape
    mask = fx["response"]["meta_info"]["output_token_sampling_mask"]
    assert broken(output_token_sampling_mask=mask[:2]).invalid_reasons == whole_turn
    assert broken(weight_versions=[{"version": "11", "start": 0, "end": 2}]).invalid_reasons == whole_turn
    assert broken(weight_version="11").invalid_reasons == whole_turn  # not the last span's version
    spanless = json.loads(json.dumps(fx["response"]))
    del spanless["meta_info"]["weight_versions"]  # SGLang omits spans only on unfinished stream chunks
    assert proto.parse_generate_response(spanless, [1]).weight_versions.tolist() == [12, 12, 12]
    with pytest.raises(proto.ProtocolError):
        proto.parse_generate_response({"text": "x"}, [1])
    with pytest.raises(proto.ProtocolError):
        proto.parse_generate_response({"meta_info": {"output_token_logprobs": [[0.0]]}}, [1])


def test_error_fixtures_messages():
    cap = load("sglang_error_400_mask_cap.json")
    assert cap["status"] == 400
    assert proto.mask_cap_error(proto.error_message(cap["response"])) == ("top_k_rejected", 4096)
    overflow = load("sglang_error_400_mask_overflow.json")
    assert proto.mask_cap_error(proto.error_message(overflow["response"])) == ("support_overflow", 4096)
    outside = load("sglang_error_500_outside_mask.json")
    assert outside["status"] == 500 and outside["response"]["object"] == "error"
    assert "outside its captured sampling support" in proto.error_message(outside["response"])
    assert proto.finish_reason_of({"type": "abort", "message": "x"}) == "abort"
    assert proto.weight_version_of("12") == 12 and proto.weight_version_of("default") == -1


# ------------------------------------------------------------------------------------ client policy
class ReplayServer:
    """A real aiohttp server on a free 127.0.0.1 port answering /generate from a queue of
    (status, json body, headers) and recording every request body and header."""

    def __init__(self, answers: list[tuple[int, object, dict[str, str]]]):
        self.answers = list(answers)
        self.requests: list[dict] = []
        self.headers: list[dict] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append(await request.json())
        self.headers.append(dict(request.headers))
        status, body, headers = self.answers.pop(0)
        if body is None:  # drop the connection
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=500)
        return web.json_response(body, status=status, headers=headers)

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_post("/generate", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


FAST = ClientRetryPolicy(backoff_initial_s=0.001, backoff_max_s=0.002, version_wait_cap_s=0.01)
SUPPORT_PARAMS = {"temperature": 0.8, "top_p": 0.9, "top_k": 64, "max_new_tokens": 3, "stop_token_ids": [3]}


async def test_client_ok_passes_headers_and_router_annotations():
    fx = load("sglang_support_straddle.json")
    ok = (200, fx["response"], {"X-RLFleet-Group": "h100-fp8", "X-RLFleet-Replica": "http://r7"})
    srv = ReplayServer([ok])
    async with srv as url, SamplerClient(url, group="default", policy=FAST) as client:
        turn = await client.generate(
            fx["request"]["input_ids"], SUPPORT_PARAMS, session_id="p0/1", min_weight_version=5
        )
    _check_support_turn(fx, turn)
    assert (turn.group, turn.replica) == ("h100-fp8", "http://r7")
    sent = srv.requests[0]
    assert sent["return_sampling_mask"] is True and sent["sampling_logprobs_mode"] == "support"
    assert sent["sampling_params"]["top_k"] == 64
    assert srv.headers[0]["X-Session-Id"] == "p0/1" and srv.headers[0]["X-Min-Weight-Version"] == "5"
    assert client.stats.turns == 1 and client.stats.tokens == 3


async def test_client_400_top_k_rejected_resends_at_the_servers_cap():
    fx = load("sglang_support_straddle.json")
    err = load("sglang_error_400_mask_cap.json")  # "... 1 < top_k <= 4096; got top_k=8192 ..."
    srv = ReplayServer([(400, err["response"], {}), (200, fx["response"], {})])
    async with srv as url, SamplerClient(url, policy=FAST) as client:
        turn = await client.generate([1, 5, 9, 2], {**SUPPORT_PARAMS, "top_k": 8192})
        assert client.mask_cap == 4096
    assert turn.valid.all()
    assert [r["sampling_params"]["top_k"] for r in srv.requests] == [8192, 4096]
    assert client.stats.retries["shrink_top_k"] == 1


async def test_client_400_support_overflow_halves_top_k_then_fails_when_it_persists():
    fx = load("sglang_support_straddle.json")
    err = load("sglang_error_400_mask_overflow.json")["response"]  # ties grew the kept set past 4096
    srv = ReplayServer([(400, err, {}), (200, fx["response"], {})])
    async with srv as url, SamplerClient(url, policy=FAST) as client:
        assert (await client.generate([1, 5, 9, 2], {**SUPPORT_PARAMS, "top_k": 4096})).valid.all()
    assert [r["sampling_params"]["top_k"] for r in srv.requests] == [4096, 2048]
    srv = ReplayServer([(400, err, {})] * 3)
    async with srv as url, SamplerClient(url, policy=FAST) as client:
        with pytest.raises(TurnFailed) as info:
            await client.generate([1], {**SUPPORT_PARAMS, "top_k": 4096})
    assert info.value.reason == "bad_request" and info.value.status == 400
    assert [r["sampling_params"]["top_k"] for r in srv.requests] == [4096, 2048, 1024]  # max_shrink_retries


async def test_client_400_other_reason_fails_turn_immediately():
    srv = ReplayServer([(400, {"error": {"message": "input_ids is empty"}}, {})])
    async with srv as url, SamplerClient(url, policy=FAST) as client:
        with pytest.raises(TurnFailed) as info:
            await client.generate([1], SUPPORT_PARAMS)
    assert info.value.reason == "bad_request" and len(srv.requests) == 1


async def test_client_500_retries_once_then_fails():
    err = load("sglang_error_500_outside_mask.json")["response"]
    fx = load("sglang_support_straddle.json")["response"]
    srv = ReplayServer([(500, err, {}), (200, fx, {})])
    async with srv as url, SamplerClient(url, policy=FAST) as client:
        assert (await client.generate([1, 5, 9, 2], SUPPORT_PARAMS)).num_tokens == 3
    srv = ReplayServer([(500, err, {}), (500, err, {})])
    async with srv as url, SamplerClient(url, policy=FAST) as client:
        with pytest.raises(TurnFailed) as info:
            await client.generate([1], SUPPORT_PARAMS)
    assert info.value.reason == "server_error" and info.value.attempts == 2 and len(srv.requests) == 2


async def test_client_409_version_conflict_waits_and_retries():
    fx = load("sglang_support_straddle.json")["response"]
    conflict = (409, {"error": {"message": "no replica at weight version >= 9"}}, {"Retry-After": "0"})
    srv = ReplayServer([conflict, conflict, (200, fx, {})])
    async with srv as url, SamplerClient(url, policy=FAST) as client:
        turn = await client.generate([1, 5, 9, 2], SUPPORT_PARAMS, min_weight_version=9)
    assert turn.num_tokens == 3 and client.stats.retries["version_conflict"] == 2


async def test_client_connection_loss_and_503_are_bounded():
    fx = load("sglang_support_straddle.json")["response"]
    srv = ReplayServer([(0, None, {}), (503, {"error": {"message": "busy"}}, {}), (200, fx, {})])
    async with srv as url, SamplerClient(url, policy=FAST) as client:
        assert (await client.generate([1, 5, 9, 2], SUPPORT_PARAMS)).num_tokens == 3
    srv = ReplayServer([(503, {"error": {"message": "busy"}}, {})] * 4)
    async with srv as url, SamplerClient(url, policy=FAST) as client:
        with pytest.raises(TurnFailed) as info:
            await client.generate([1], SUPPORT_PARAMS)
    assert info.value.reason == "unavailable" and len(srv.requests) == 4
    async with SamplerClient("http://127.0.0.1:9", policy=FAST, timeout_s=1) as client:  # nothing listens
        with pytest.raises(TurnFailed, match="unavailable"):
            await client.generate([1], SUPPORT_PARAMS)


async def test_client_invalid_tokens_counted_not_raised():
    fx = load("sglang_invalid_tokens.json")
    srv = ReplayServer([(200, fx["response"], {})])
    async with srv as url, SamplerClient(url, policy=FAST) as client:
        turn = await client.generate(fx["request"]["input_ids"], SUPPORT_PARAMS)
    assert turn.num_invalid == 3
    assert client.stats.invalid == 3
    assert {rec.R_NOT_IN_SUPPORT, rec.R_NOT_NORMALISED, rec.R_BAD_LOGPROB} <= set(client.stats.invalid_tokens)
