"""The SGLang answers in tests/sampler/fixtures, each assembled by SGLang 0.5.23's own code
(sglang_made.py) from the token data below. test_contract_fixtures.py rebuilds every one and fails when
a file differs; regenerate with `.venv/bin/python tests/sglang_contract/sglang_fixtures.py`.

The token data (ids, full-vocabulary logprobs, kept sets with renormalised logprobs) stands for what
the GPU sampler produced; everything around it (meta_info keys and shapes, mask rows, weight-version
spans, error bodies) is SGLang's. sglang_support_topp.json is the reference server's fixture
(tests/sampler/test_sampler_server.py) and not built here.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import sglang_made as sm  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "sampler" / "fixtures"
NOT_OURS = frozenset({"sglang_support_topp.json"})  # the reference server's (test_sampler_server.py)
PROMPT = [1, 5, 9, 2]

# support mode, ties at the cutoff: top_k=3 cuts inside a three-way tie (11 and 12 kept, 20 dropped by
# sort order); second token: top_p=0.8 keeps the crossing token of a tie
TIE_TOKENS = [
    sm.Token(
        12, -2.07441782951355, [7, 11, 12], [-0.36898112297058105, -1.868981122970581, -1.868981122970581]
    ),
    sm.Token(
        9, -0.950858473777771, [4, 9, 15], [-0.7586236596107483, -0.7586236596107483, -2.7586236000061035]
    ),
]
TIE_PARAMS = {"temperature": 1.0, "top_p": 0.8, "top_k": 3, "max_new_tokens": 16, "stop_token_ids": [3]}

# three tokens; the weights were updated from version 11 to 12 after the second one
STRADDLE_TOKENS = [
    sm.Token(30, -1.2, [30, 5, 0], [-0.5, -1.3, math.log(1 - math.exp(-0.5) - math.exp(-1.3))]),
    sm.Token(5, -0.9, [5, 30], [-0.31326168751822286, -1.3132616875182228]),
    sm.Token(0, -0.05, [0], [0.0]),
]
STRADDLE_PARAMS = {"temperature": 0.8, "top_p": 0.9, "top_k": 64, "max_new_tokens": 3, "stop_token_ids": [3]}

HEAD_TOKENS = [
    sm.Token(28, -2.4694135189056396, top=[(-2.439232110977173, 27), (-2.4694135189056396, 28),
                                           (-2.5951924324035645, 7), (-2.610086441040039, 6)]),
    sm.Token(10, -2.138887405395508, top=[(-2.138887405395508, 10), (-2.345688581466675, 1),
                                          (-2.480715036392212, 2), (-2.8081870079040527, 30)]),
    sm.Token(9, -2.86063551902771, top=[(-2.084009885787964, 15), (-2.2406229972839355, 4),
                                        (-2.813256025314331, 1), (-2.86063551902771, 9)]),
]  # fmt: skip
HEAD_PARAMS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 3, "stop_token_ids": []}

# defects the client must flag: token 1 sampled outside its mask, token 2's support logprobs sum to
# exp(-0.5), token 3's full-vocabulary logprob NaN (SGLang's serializer writes null); token 0 is fine
INVALID_TOKENS = [
    sm.Token(17, -2.3, [17, 1], [-0.2014132779827524, -1.7014132779827524]),
    sm.Token(7, -1.9, [3, 15], [-0.2014132779827524, -1.7014132779827524]),
    sm.Token(13, -2.2, [13, 29], [-0.7014132779827524, -2.2014132779827524]),
    sm.Token(13, math.nan, [13, 23], [-0.2014132779827524, -1.7014132779827524]),
]
INVALID_PARAMS = {"temperature": 1.0, "top_p": 0.9, "top_k": 64, "max_new_tokens": 4, "stop_token_ids": [3]}


def _ok(description: str, **kwargs: Any) -> dict[str, Any]:
    request, response = sm.generate_response(PROMPT, rid="9f2c0d5e1b7a4c38", **kwargs)
    request.pop("rid")
    return {"description": description, "request": request, "status": 200, "response": response}


def _error(description: str, request: dict[str, Any], finish_reason: dict[str, Any]) -> dict[str, Any]:
    status, body = sm.error_response(finish_reason)
    return {"description": description, "request": request, "status": int(status), "response": body}


def _mask_request(top_k: int) -> dict[str, Any]:
    return {
        "input_ids": [1, 2],
        "sampling_params": {"temperature": 1.0, "top_p": 0.95, "top_k": top_k, "max_new_tokens": 4},
        "return_logprob": True,
        "return_sampling_mask": True,
        "sampling_logprobs_mode": "support",
    }


def _top_k_rejected() -> dict[str, Any]:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    message = sm.scheduler_mask_error(8192, 4096)
    assert message is not None
    abort = FINISH_ABORT(message, 400).to_json()  # prepare_abort(req, error_msg, status_code=BAD_REQUEST)
    return _error(
        "HTTP 400: return_sampling_mask with top_k above --sampling-mask-max-tokens (scheduler)",
        _mask_request(8192),
        abort,
    )


BUILDERS: dict[str, Callable[[], dict[str, Any]]] = {
    "sglang_support_tie_at_cutoff.json": lambda: _ok(
        "support mode with ties at the cutoff; finish by a stop token",
        tokens=TIE_TOKENS,
        sampling_params=TIE_PARAMS,
        current_version="12",
        cached_tokens=2,
        finish_reason={"type": "stop", "matched": 3},
    ),
    "sglang_selected_mode.json": lambda: _ok(
        "sampling_logprobs_mode=selected (SGLang's default with the mask): one float per token, log q_S(y)",
        tokens=TIE_TOKENS,
        mode="selected",
        sampling_params=TIE_PARAMS,
        current_version="3",
        cached_tokens=2,
    ),
    "sglang_support_straddle.json": lambda: _ok(
        "support mode, streamed to the tokenizer manager in two chunks; a weight update (11 -> 12) after "
        "token 2, so weight_versions has two spans",
        tokens=STRADDLE_TOKENS,
        sampling_params=STRADDLE_PARAMS,
        version_events=[("11", 2)],
        current_version="12",
        chunk_sizes=[2, 1],
        cached_tokens=2,
    ),
    "sglang_head_mode.json": lambda: _ok(
        "head mode: top_logprobs_num=4, untruncated sampling; top-4 triples of the full-vocabulary q",
        tokens=HEAD_TOKENS,
        mode="head",
        top_logprobs_num=4,
        sampling_params=HEAD_PARAMS,
        current_version="4",
    ),
    "sglang_invalid_tokens.json": lambda: _ok(
        "defects: token 1 outside its mask, token 2 not normalised, token 3 logprob null; token 0 fine",
        tokens=INVALID_TOKENS,
        sampling_params=INVALID_PARAMS,
        current_version="5",
        cached_tokens=2,
    ),
    "sglang_error_400_mask_cap.json": _top_k_rejected,
    "sglang_error_400_mask_overflow.json": lambda: _error(
        "HTTP 400 mid-request: the realised support exceeded --sampling-mask-max-tokens (ties)",
        _mask_request(4096),
        sm.mask_overflow_abort(),
    ),
    "sglang_error_500_outside_mask.json": lambda: _error(
        "HTTP 500 (ErrorResponse): the sampled token fell outside the captured sampling support",
        _mask_request(64),
        sm.outside_support_abort(),
    ),
}


def render(fixture: dict[str, Any]) -> str:
    return json.dumps(fixture, indent=1, allow_nan=False) + "\n"


if __name__ == "__main__":
    for name, build in BUILDERS.items():
        (FIXTURES / name).write_text(render(build()))
        print("wrote", FIXTURES / name)
