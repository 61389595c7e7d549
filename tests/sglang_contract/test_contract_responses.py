"""Responses assembled by SGLang 0.5.23's own code (sglang_made.generate_response: SamplingMaskRows,
weight-version spans, TokenizerManager._handle_batch_output, orjson_response) in both logprob modes,
then parsed by our client: per-token ids, q(y), support ids and q, and weight versions are exact."""

from __future__ import annotations

import numpy as np
import pytest
import sglang_made as sm

from rlfleet import records as rec
from rlfleet.sampler import protocol as proto

PROMPT = [1, 5, 9, 2]
TOKENS = [
    sm.Token(7, -1.25, [7, 9, 3], [-0.5, -1.5, float(np.log(1 - np.exp(-0.5) - np.exp(-1.5)))]),
    sm.Token(9, -2.5, [3, 9], [-0.25, float(np.log(1 - np.exp(-0.25)))]),
    sm.Token(4, -0.75, [4, 2], [-0.125, float(np.log(1 - np.exp(-0.125)))]),
    sm.Token(2, -3.0, [2], [0.0]),
    sm.Token(11, -0.5, [11, 4, 2], [-0.375, -1.75, float(np.log(1 - np.exp(-0.375) - np.exp(-1.75)))]),
]


def f32(values: list[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def parse(response: dict) -> rec.SampledTurn:
    return proto.parse_generate_response(response, PROMPT)


@pytest.mark.parametrize("chunks", [None, [2, 3], [1, 1, 1, 1, 1]])
def test_support_mode_is_parsed_exactly(chunks: list[int] | None) -> None:
    _, response = sm.generate_response(PROMPT, TOKENS, mode="support", chunk_sizes=chunks, cached_tokens=3)
    assert response["meta_info"]["output_token_sampling_mask_length"] == len(TOKENS)  # ONE int
    turn = parse(response)
    assert turn.invalid_reasons == {} and turn.valid.all()
    assert turn.candidate_mode == rec.SUPPORT_MODE and turn.cached_tokens == 3
    assert turn.output_ids.tolist() == [t.id for t in TOKENS]
    assert np.array_equal(turn.logprobs, f32([t.logprob for t in TOKENS]))
    for i, t in enumerate(TOKENS):
        ids, lps = turn.support(i)
        assert ids.tolist() == t.support
        assert np.array_equal(lps, f32(t.support_logprobs))  # SGLang ships float32
    assert np.array_equal(
        turn.sampled_logprobs, f32([t.support_logprobs[t.support.index(t.id)] for t in TOKENS])
    )
    assert turn.weight_versions.tolist() == [5] * len(TOKENS)
    assert turn.finish_reason == "length"


def test_selected_mode_is_parsed_exactly_and_not_trained_on() -> None:
    """SGLang's default mode with the mask: one float per token, log q_S(y). The mask ids are kept, the
    q over the rest of the support is absent, so no token is trainable (support_logprobs_missing)."""
    _, response = sm.generate_response(PROMPT, TOKENS, mode="selected", chunk_sizes=[3, 2])
    assert all(isinstance(x, float) for x in response["meta_info"]["output_token_sampling_logprobs"])
    turn = parse(response)
    assert turn.output_ids.tolist() == [t.id for t in TOKENS]
    assert turn.support_ids.tolist() == [i for t in TOKENS for i in t.support]
    assert np.array_equal(
        turn.sampled_logprobs, f32([t.support_logprobs[t.support.index(t.id)] for t in TOKENS])
    )
    assert np.isnan(turn.support_logprobs).all()
    assert not turn.valid.any() and turn.invalid_reasons[proto.R_SUPPORT_MISSING] == len(TOKENS)


def test_head_mode_is_parsed_exactly() -> None:
    tokens = [
        sm.Token(7, -1.25, top=[(-1.0, 3), (-1.25, 7), (-2.0, 1)]),
        sm.Token(1, -2.5, top=[(-0.25, 9), (-2.0, 4), (-2.5, 1)]),
    ]
    _, response = sm.generate_response(PROMPT, tokens, mode="head", top_logprobs_num=3)
    turn = proto.parse_generate_response(response, PROMPT, untruncated=True)
    assert turn.candidate_mode == rec.HEAD_MODE and turn.valid.all()
    for i, t in enumerate(tokens):
        ids, lps = turn.support(i)
        assert ids.tolist() == [j for _, j in t.top] and np.array_equal(lps, f32([lp for lp, _ in t.top]))
    assert np.array_equal(turn.sampled_logprobs, f32([-1.25, -2.5]))  # untruncated: q_S = q


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_request_straddling_weight_updates_gets_per_token_versions_from_the_spans(mode: str) -> None:
    """Two updates during one request (versions 7 -> 8 after token 2, 8 -> 9 after token 4):
    SGLang reports three spans and `weight_version` "9"; every token keeps the version it was
    sampled under (not the newest)."""
    _, response = sm.generate_response(
        PROMPT,
        TOKENS,
        mode=mode,
        version_events=[("7", 2), ("8", 4)],
        current_version="9",
        chunk_sizes=[2, 2, 1],
    )
    meta = response["meta_info"]
    assert meta["weight_versions"] == [
        {"version": "7", "start": 0, "end": 2},
        {"version": "8", "start": 2, "end": 4},
        {"version": "9", "start": 4, "end": 5},
    ]
    assert meta["weight_version"] == "9"
    turn = parse(response)
    assert turn.weight_versions.tolist() == [7, 7, 8, 8, 9]
    if mode == "support":
        assert turn.valid.all()


def test_server_without_weight_version_stamps_default_and_nothing_is_trainable() -> None:
    """A server launched without --weight-version reports "default": no token may claim a version."""
    _, response = sm.generate_response(PROMPT, TOKENS[:2], current_version="default")
    turn = parse(response)
    assert turn.weight_versions.tolist() == [-1, -1]
    assert not turn.valid.any() and turn.invalid_reasons[rec.R_BAD_VERSION] == 2


def test_spans_that_do_not_tile_the_tokens_invalidate_the_turn() -> None:
    _, response = sm.generate_response(PROMPT, TOKENS, version_events=[("7", 2)], current_version="8")
    broken = {**response, "meta_info": {**response["meta_info"]}}
    broken["meta_info"]["weight_versions"] = [
        {"version": "7", "start": 0, "end": 2},
        {"version": "8", "start": 3, "end": 5},
    ]
    assert parse(broken).invalid_reasons == {proto.R_LENGTH_MISMATCH: len(TOKENS)}
    broken["meta_info"]["weight_versions"] = response["meta_info"]["weight_versions"]
    broken["meta_info"]["weight_version"] = "7"  # must be the last span's
    assert parse(broken).invalid_reasons == {proto.R_LENGTH_MISMATCH: len(TOKENS)}
    assert parse(response).weight_versions.tolist() == [7, 7, 8, 8, 8]


def test_finished_by_a_stop_token_and_aborted_without_status_are_turns() -> None:
    """`abort_all_requests` on a weight reload ends requests with {type: abort} and no status code: SGLang
    answers 200 with the tokens so far, which are real samples."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_MATCHED_TOKEN

    _, stopped = sm.generate_response(PROMPT, TOKENS[:2], finish_reason=FINISH_MATCHED_TOKEN(3).to_json())
    assert parse(stopped).finish_reason == "stop"
    _, aborted = sm.generate_response(PROMPT, TOKENS[:2], finish_reason=FINISH_ABORT().to_json())
    turn = parse(aborted)
    assert turn.finish_reason == "abort" and turn.valid.all()
