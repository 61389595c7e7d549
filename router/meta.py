"""Read and annotate SGLang JSON responses without decoding them. Pure.

A /generate response with logprobs and sampling masks is easily megabytes of JSON; decoding and
re-encoding it would cost the router more than everything else together (benchmarks/router.py
measures it). So the router works on the bytes: it finds each `"meta_info"` object, reads
`completion_tokens`, `prompt_tokens` and `weight_version` from it and inserts its own fields right
after the opening brace. This is exact for valid JSON: a double quote inside a JSON string is always
escaped (`\\"`), so the byte sequence `"meta_info"` followed by `:` can only be an object key.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_META_KEY = b'"meta_info"'
_OPEN_OBJECT = re.compile(rb"\s*:\s*\{")
_INT_VALUE = re.compile(rb'\s*:\s*"?(-?\d+)')
_COMPLETION = b'"completion_tokens"'
_PROMPT = b'"prompt_tokens"'
_VERSION = b'"weight_version"'


@dataclass(frozen=True)
class MetaScan:
    insert_at: tuple[int, ...]  # byte offsets just after each meta_info's "{"
    completion_tokens: int
    prompt_tokens: int
    weight_version: int | None  # the smallest version any item reports (None when none does)
    newest_version: int | None = None  # the largest (a batch's items may differ)


def _int_after(body: bytes, key: bytes, start: int, end: int) -> int | None:
    pos = body.find(key, start, end)
    if pos < 0:
        return None
    match = _INT_VALUE.match(body, pos + len(key))
    return int(match.group(1)) if match else None


def scan(body: bytes) -> MetaScan:
    """Find meta_info objects; without any, read OpenAI-style `usage` token counts instead."""
    starts: list[int] = []
    pos = body.find(_META_KEY)
    while pos >= 0:
        match = _OPEN_OBJECT.match(body, pos + len(_META_KEY))
        if match:
            starts.append(match.end())
        pos = body.find(_META_KEY, pos + len(_META_KEY))
    if not starts:
        return MetaScan(
            insert_at=(),
            completion_tokens=_int_after(body, _COMPLETION, 0, len(body)) or 0,
            prompt_tokens=_int_after(body, _PROMPT, 0, len(body)) or 0,
            weight_version=None,
        )
    completion = prompt = 0
    version: int | None = None
    newest: int | None = None
    bounds = [*starts[1:], len(body)]
    for start, end in zip(starts, bounds, strict=True):
        completion += _int_after(body, _COMPLETION, start, end) or 0
        prompt += _int_after(body, _PROMPT, start, end) or 0
        item_version = _int_after(body, _VERSION, start, end)
        if item_version is not None and (version is None or item_version < version):
            version = item_version
        if item_version is not None and (newest is None or item_version > newest):
            newest = item_version
    return MetaScan(tuple(starts), completion, prompt, version, newest)


def annotation(fields: dict[str, object]) -> bytes:
    """The bytes inserted at the start of a meta_info object: `"k":v,` for each field."""
    return b"".join(json.dumps(k).encode() + b":" + json.dumps(v).encode() + b"," for k, v in fields.items())


def annotate(body: bytes, insert_at: tuple[int, ...], fields_bytes: bytes) -> bytes:
    """Insert `fields_bytes` at each offset. An empty meta_info `{}` must not get a trailing comma."""
    if not insert_at or not fields_bytes:
        return body
    pieces: list[bytes] = []
    previous = 0
    for offset in insert_at:
        pieces.append(body[previous:offset])
        rest = body[offset : offset + 64].lstrip()
        pieces.append(fields_bytes[:-1] if rest.startswith(b"}") else fields_bytes)
        previous = offset
    pieces.append(body[previous:])
    return b"".join(pieces)
