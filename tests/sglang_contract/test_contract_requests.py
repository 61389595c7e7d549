"""Request bodies our client builds go through SGLang 0.5.23's own request gate (sglang_made.admit: the
JSON contract gate, GenerateReqInput, TokenizerManager validation, SamplingParams.normalize/.verify,
the scheduler's sampling-mask top_k rule compiled from its source) and come out as we meant them."""

from __future__ import annotations

import math

import pytest
import sglang_made as sm
from aiohttp import web
from sglang.srt.sampling.sampling_params import TOP_K_ALL
from support.upstreams import serving

from rlfleet import records as rec
from rlfleet.sampler import protocol as proto
from rlfleet.sampler.client import SamplerClient

TOKENS = [sm.Token(7, -1.0, [7, 9], [-0.25, math.log(1 - math.exp(-0.25))]), sm.Token(9, -2.0, [9], [0.0])]
CONFIGS = [
    # (SamplingConfig kwargs, top_k SGLang ends up with)
    ({"temperature": 0.8, "top_p": 0.9, "top_k": -1, "max_new_tokens": 7, "stop_token_ids": [3]}, 1024),
    ({"temperature": 1.0, "top_p": 1.0, "top_k": 64, "max_new_tokens": 5}, 64),
    ({"temperature": 1.0, "top_p": 0.95, "top_k": -1, "min_p": 0.05, "max_new_tokens": 5}, 1024),
    ({"temperature": 0.0, "max_new_tokens": 4}, 1),  # greedy: SGLang normalises to top_k 1, mask allowed
    ({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "head_size": 16, "max_new_tokens": 4}, TOP_K_ALL),
    ({"temperature": 0.7, "top_p": 0.9, "top_k": 4096, "max_new_tokens": 4}, 4096),  # exactly the cap
]


@pytest.mark.parametrize(("kwargs", "top_k"), CONFIGS)
def test_our_request_is_admitted_by_sglang_as_meant(kwargs: dict, top_k: int) -> None:
    cfg = proto.SamplingConfig(**kwargs)
    body = proto.build_generate_request([1, 5, 9], cfg, sampling_seed=11, rid="r")
    tokenized = sm.admit(body)
    sp = tokenized.sampling_params
    assert list(tokenized.input_ids) == [1, 5, 9]
    assert tokenized.return_logprob is True
    assert sp.top_k == top_k
    assert sp.top_p == cfg.top_p and sp.min_p == cfg.min_p and sp.max_new_tokens == cfg.max_new_tokens
    assert sp.temperature == (1.0 if cfg.temperature == 0 else cfg.temperature)  # SGLang's greedy form
    assert sorted(sp.stop_token_ids or []) == sorted(cfg.stop_token_ids) and sp.sampling_seed == 11
    if cfg.mode == rec.SUPPORT_MODE:
        # the default with the mask would be "selected": we must ask for the support's q explicitly
        assert tokenized.return_sampling_mask is True and tokenized.sampling_logprobs_mode == "support"
        assert tokenized.top_logprobs_num == 0
    else:
        assert tokenized.return_sampling_mask is False and tokenized.top_logprobs_num == cfg.head_size


def test_sglang_rejects_what_our_config_never_sends() -> None:
    """The rules our SamplingConfig works around, as SGLang states them (so a change shows up here)."""
    cfg = proto.SamplingConfig(temperature=1.0, top_p=0.9, top_k=-1, max_new_tokens=4)
    body = proto.build_generate_request([1, 2], cfg)
    with pytest.raises(sm.Rejected, match=r"requires top_k=1 .* 1 < top_k <= 4096; got top_k=1073741824"):
        sm.admit({**body, "sampling_params": {**body["sampling_params"], "top_k": -1}})  # -1 is 2^30
    with pytest.raises(sm.Rejected, match="got top_k=8192"):
        sm.admit({**body, "sampling_params": {**body["sampling_params"], "top_k": 8192}})
    with pytest.raises(sm.Rejected, match="sampling_logprobs_mode can only be set when return_sampling_mask"):
        sm.admit({k: v for k, v in body.items() if k != "return_sampling_mask"})
    with pytest.raises(sm.Rejected, match="top_p"):
        sm.admit({**body, "sampling_params": {**body["sampling_params"], "top_p": 0.0}})
    # the JSON contract gate: a string where an integer belongs
    with pytest.raises(sm.Rejected, match="expected i64"):
        sm.admit({**body, "sampling_params": {**body["sampling_params"], "top_k": "64"}})


async def test_client_learns_a_smaller_servers_cap_from_sglangs_400_and_is_then_admitted() -> None:
    """A real HTTP server whose /generate is SGLang's gate (launched with --sampling-mask-max-tokens 256)
    and answers what SGLang assembles: our client's first body (top_k 1024) gets SGLang's 400, the
    client learns the cap from SGLang's message, and the resent body passes the same gate."""
    seen: list[int] = []

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body["sampling_params"]["top_k"])
        try:
            sm.admit(body, sampling_mask_max_tokens=256)
        except sm.Rejected as exc:
            return web.json_response(exc.body, status=400)
        _, answer = sm.generate_response(body["input_ids"], TOKENS, sampling_params=body["sampling_params"])
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post("/generate", generate)
    async with serving(app) as url, SamplerClient(url) as client:
        turn = await client.generate([1, 2], {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 2})
        again = await client.generate([1, 2], {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 2})
    assert seen == [1024, 256, 256]  # the learnt cap is kept for later requests
    assert client.mask_cap == 256 and client.stats.retries["shrink_top_k"] == 1
    assert turn.valid.all() and again.valid.all() and turn.output_ids.tolist() == [t.id for t in TOKENS]


def test_scheduler_rule_compiled_from_sglang_source_matches_references() -> None:
    """top_k == 1 or 1 < top_k <= cap (scheduler.py); anything else is SGLang's 400."""
    assert sm.scheduler_mask_error(1, 4096) is None
    assert sm.scheduler_mask_error(2, 4096) is None and sm.scheduler_mask_error(4096, 4096) is None
    for bad in (0, 4097, TOP_K_ALL):
        message = sm.scheduler_mask_error(bad, 4096)
        assert message is not None and f"got top_k={bad}" in message
