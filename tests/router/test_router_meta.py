"""Reading and annotating SGLang responses on the bytes: exact for any valid JSON (property test)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.router import meta

FIELDS = {"rlfleet_group": "h100-fp8", "rlfleet_replica": "http://10.0.0.7:30000"}

text_strategy = st.text(max_size=40)  # includes quotes, backslashes and '"meta_info":{' look-alikes
meta_strategy = st.fixed_dictionaries(
    {"prompt_tokens": st.integers(0, 10_000), "completion_tokens": st.integers(0, 10_000)},
    optional={
        "weight_version": st.integers(0, 10**6).map(str),
        "finish_reason": st.fixed_dictionaries({"type": st.just("length")}),
        "output_token_logprobs": st.lists(
            st.tuples(st.floats(-20, 0), st.integers(0, 50_000), st.none()), max_size=5
        ),
    },
)
item_strategy = st.fixed_dictionaries(
    {"text": text_strategy, "output_ids": st.lists(st.integers(0, 9), max_size=5), "meta_info": meta_strategy}
)


@settings(max_examples=200, deadline=None)
@given(st.one_of(item_strategy, st.lists(item_strategy, min_size=1, max_size=4)), st.booleans())
def test_scan_and_annotate_equal_decoding_and_reencoding(payload: object, compact: bool) -> None:
    body = json.dumps(payload, separators=(",", ":") if compact else None, ensure_ascii=False).encode()
    items = payload if isinstance(payload, list) else [payload]
    result = meta.scan(body)
    assert result.completion_tokens == sum(i["meta_info"]["completion_tokens"] for i in items)
    assert result.prompt_tokens == sum(i["meta_info"]["prompt_tokens"] for i in items)
    versions = [int(i["meta_info"]["weight_version"]) for i in items if "weight_version" in i["meta_info"]]
    assert result.weight_version == (min(versions) if versions else None)
    annotated = json.loads(meta.annotate(body, result.insert_at, meta.annotation(FIELDS)))
    expected = json.loads(body)
    for item in expected if isinstance(expected, list) else [expected]:
        item["meta_info"].update(FIELDS)
    assert annotated == expected


def test_empty_meta_info_gets_no_trailing_comma() -> None:
    body = b'{"text": "a", "meta_info": {}}'
    result = meta.scan(body)
    assert json.loads(meta.annotate(body, result.insert_at, meta.annotation(FIELDS)))["meta_info"] == FIELDS


def test_text_that_looks_like_meta_info_is_not_touched() -> None:
    payload = {"text": '"meta_info": {"completion_tokens": 999}', "meta_info": {"completion_tokens": 3}}
    body = json.dumps(payload).encode()
    result = meta.scan(body)
    assert result.completion_tokens == 3 and len(result.insert_at) == 1
    assert (
        json.loads(meta.annotate(body, result.insert_at, meta.annotation(FIELDS)))["text"] == payload["text"]
    )


def test_openai_usage_is_read_when_there_is_no_meta_info() -> None:
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}).encode()
    result = meta.scan(body)
    assert (result.prompt_tokens, result.completion_tokens, result.insert_at) == (7, 5, ())
