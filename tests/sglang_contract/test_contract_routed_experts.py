"""Routed experts (a mixture of experts' per-position routing, SGLang 0.5.23 `return_routed_experts`)
held against SGLang's own code: our request is admitted by SGLang's gate asking for them from position
0; the response's `meta_info.routed_experts` is what SGLang's detokenizer encodes
(`DetokenizerManager._b64_encode_per_request`) of the scheduler's host-side routing, through
`TokenizerManager._handle_batch_output` and `orjson_response` (sglang_made.generate_response), and our
client reads it back into `SampledTurn.routed_experts` [P + n - 1, layers, top_k] exactly, agreeing
with SGLang's own decoder (`extract_routed_experts_from_meta_info`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import sglang_made as sm
from aiohttp import web
from support.upstreams import serving

from rlfleet.sampler import protocol as proto
from rlfleet.sampler.client import SamplerClient, TurnFailed

PROMPT = [1, 5, 9, 2]
TOKENS = [
    sm.Token(7, -1.0, [7, 9], [-0.25, math.log(1 - math.exp(-0.25))]),
    sm.Token(9, -2.0, [9], [0.0]),
    sm.Token(4, -0.5, [4, 2], [-0.125, math.log(1 - math.exp(-0.125))]),
]
LAYERS, TOP_K, EXPERTS = 3, 2, 8
MOE = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": len(TOKENS), "routed_experts_top_k": TOP_K}


def routing(positions: int, seed: int = 0) -> np.ndarray:
    """What the scheduler's capturer holds for a request: per position and layer, top_k distinct experts."""
    rng = np.random.default_rng(seed)
    return (
        np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(positions * LAYERS)])
        .reshape(positions, LAYERS, TOP_K)
        .astype(np.int32)
    )


def test_our_request_asks_sglang_for_the_routing_of_every_position() -> None:
    moe = sm.admit(proto.build_generate_request(PROMPT, proto.SamplingConfig(**MOE)))
    assert moe.return_routed_experts is True and moe.routed_experts_start_len == 0
    dense_body = proto.build_generate_request(
        PROMPT, proto.SamplingConfig(**{**MOE, "routed_experts_top_k": 0})
    )
    assert "return_routed_experts" not in dense_body and sm.admit(dense_body).return_routed_experts is False
    with pytest.raises(ValueError, match="routed_experts_top_k must be >= 0"):
        proto.SamplingConfig(routed_experts_top_k=-1)


@pytest.mark.parametrize("chunks", [None, [2, 1]])
def test_sglangs_routed_experts_are_read_exactly(chunks: list[int] | None) -> None:
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    want = routing(len(PROMPT) + len(TOKENS) - 1)  # the last output token is never forwarded
    body, response = sm.generate_response(PROMPT, TOKENS, routed_experts=want, chunk_sizes=chunks)
    assert body["return_routed_experts"] is True and isinstance(response["meta_info"]["routed_experts"], str)
    turn = proto.parse_generate_response(response, PROMPT, routed_experts_top_k=TOP_K)
    assert turn.valid.all() and turn.invalid_reasons == {}
    assert turn.routed_experts is not None and turn.routed_experts.dtype == np.int32
    assert turn.routed_experts.shape == (len(PROMPT) + len(TOKENS) - 1, LAYERS, TOP_K)
    assert np.array_equal(turn.routed_experts, want)
    assert np.array_equal(turn.routed_experts.ravel(), extract_routed_experts_from_meta_info(response))
    # a dense run does not ask, and does not read
    assert proto.parse_generate_response(response, PROMPT).routed_experts is None


def test_routing_of_another_length_makes_the_turn_untrainable() -> None:
    """Routing for one position fewer than prompt + output - 1 (or a top_k that does not divide it) does
    not line up with the tokens: nothing of the turn is trained on."""
    short = routing(len(PROMPT) + len(TOKENS) - 2)
    _, response = sm.generate_response(PROMPT, TOKENS, routed_experts=short)
    turn = proto.parse_generate_response(response, PROMPT, routed_experts_top_k=TOP_K)
    assert turn.routed_experts is None and not turn.valid.any()
    assert turn.invalid_reasons == {proto.R_LENGTH_MISMATCH: len(TOKENS)}
    _, response = sm.generate_response(PROMPT, TOKENS, routed_experts=routing(len(PROMPT) + len(TOKENS) - 1))
    assert not proto.parse_generate_response(
        response, PROMPT, routed_experts_top_k=4
    ).valid.any()  # 3 x 2 slots


async def test_the_client_requests_and_parses_routed_experts_over_http() -> None:
    """A real HTTP server answering what SGLang assembles: routing when the body asks for it and the
    server was launched with --enable-return-routed-experts, none otherwise; the client's turn holds the
    routing, and against the server without the flag the turn fails naming the flag."""
    want = routing(len(PROMPT) + len(TOKENS) - 1, seed=1)
    flagged = {"on": True}

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        sm.admit(body)
        routed = want if flagged["on"] and body.get("return_routed_experts") else None
        _, answer = sm.generate_response(
            body["input_ids"], TOKENS, routed_experts=routed, sampling_params=body["sampling_params"]
        )
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post("/generate", generate)
    async with serving(app) as url, SamplerClient(url) as client:
        turn = await client.generate(PROMPT, MOE)
        flagged["on"] = False
        with pytest.raises(TurnFailed, match="--enable-return-routed-experts") as failed:
            await client.generate(PROMPT, MOE)
    assert turn.valid.all() and np.array_equal(turn.routed_experts, want)
    assert failed.value.reason == "malformed_response"
