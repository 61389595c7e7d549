"""slime's rollout request as the tests drive it: its POST helper's retry semantics (docs/slime.md)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx


async def slime_post(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    max_retries: int = 60,
    retry_sleep: float = 1.0,
    statuses: list[int] | None = None,
    headers: dict[str, str] | None = None,
) -> Any:
    """slime's `_post` (slime/utils/http_utils.py, THUDM/slime) as read: POST the JSON payload; ANY
    exception (a connection error, or a non-2xx through raise_for_status) counts a retry, sleeps
    `retry_sleep` and tries again, raising once `max_retries` attempts failed; a 2xx body is decoded as JSON
    (its text when it is not). Rewritten here, not imported: slime is not on PyPI and GitHub cannot be
    reached from the machines the tests run on. `headers`: what slime's request hook adds (the router's
    key); `statuses` (the tests' own addition) records every status answered."""
    retry_count = 0
    while retry_count < max_retries:
        response = None
        try:
            response = await client.post(url, json=payload or {}, headers=headers)
            if statuses is not None:
                statuses.append(response.status_code)
            response.raise_for_status()
            content = await response.aread()
            try:
                output = json.loads(content)
            except json.JSONDecodeError:
                output = content.decode() if isinstance(content, bytes) else content
        except Exception:
            retry_count += 1
            if retry_count >= max_retries:
                raise
            await asyncio.sleep(retry_sleep)
            continue
        finally:
            if response is not None:
                await response.aclose()
        break
    return output


def rollout_payload(version: int) -> dict[str, Any]:
    """A rollout request as slime's SGLang rollout sends it: token ids, sampling parameters, the tokens'
    logprobs, and the version its request hook asks for exactly (docs/slime.md)."""
    return {
        "input_ids": [1, 5, 9, 2],
        "sampling_params": {"max_new_tokens": 4, "temperature": 1.0},
        "return_logprob": True,
        "weight_version": {"exact_version": version},  # slime's request hook
    }


def rollout_meta(output: Any) -> dict[str, Any]:
    """The meta_info of a rollout's answer, checked as slime reads it: a logprob per generated token and a
    finish reason slime knows."""
    meta = output["meta_info"]
    assert len(meta["output_token_logprobs"]) == len(output["output_ids"]) > 0, output
    assert meta["finish_reason"]["type"] in ("length", "stop"), meta
    return meta
