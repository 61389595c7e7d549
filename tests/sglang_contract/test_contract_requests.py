"""Request bodies our client builds go through SGLang 0.5.23's own request gate (sglang_made.admit: the
JSON contract gate, GenerateReqInput, TokenizerManager validation, SamplingParams.normalize/.verify,
the scheduler's sampling-mask top_k rule compiled from its source) and come out as we meant them."""

from __future__ import annotations

import pytest
import sglang_made as sm
from sglang.srt.sampling.sampling_params import TOP_K_ALL

from rlfleet import records as rec
from rlfleet.sampler import protocol as proto
from rlfleet.sampler.client import SamplerClient

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


def test_top_k_capped_by_a_smaller_server_is_admitted_by_that_server() -> None:
    """A server launched with --sampling-mask-max-tokens 256: SGLang's rejection names the cap, our
    client learns it from the message and the resent top_k passes the same rule."""
    cfg = proto.SamplingConfig(temperature=1.0, top_p=0.9, top_k=-1, max_new_tokens=4)
    body = proto.build_generate_request([1, 2], cfg)
    with pytest.raises(sm.Rejected) as info:
        sm.admit(body, sampling_mask_max_tokens=256)
    client = SamplerClient("http://unused")
    smaller = client._smaller_top_k(str(info.value), body["sampling_params"]["top_k"])
    assert smaller == 256 and client.mask_cap == 256
    resent = proto.build_generate_request([1, 2], cfg, top_k_override=smaller)
    assert sm.admit(resent, sampling_mask_max_tokens=256).sampling_params.top_k == 256


def test_scheduler_rule_compiled_from_sglang_source_matches_references() -> None:
    """top_k == 1 or 1 < top_k <= cap (scheduler.py); anything else is SGLang's 400."""
    assert sm.scheduler_mask_error(1, 4096) is None
    assert sm.scheduler_mask_error(2, 4096) is None and sm.scheduler_mask_error(4096, 4096) is None
    for bad in (0, 4097, TOP_K_ALL):
        message = sm.scheduler_mask_error(bad, 4096)
        assert message is not None and f"got top_k={bad}" in message
