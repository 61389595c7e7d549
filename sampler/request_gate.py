"""SGLang 0.5.23's `/generate` request gate, in its order: FastAPI's parse into GenerateReqInput, the JSON
contract gate's strict types and closed set of sampling_params fields, normalisation of a single or
batched body, SamplingParams.verify, the tokenizer manager's length checks and the scheduler's
sampling-mask rule (each message checked against SGLang's own code in
tests/sglang_contract/test_sglang_reference_sampler.py). `gate_generate` turns an accepted body into
the engine's `GenRequest`s; every refusal raises a `RequestError` (sglang_errors.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, ValidationError

from rlfleet.sampler.sglang_errors import contract_error, error_response, value_error

if TYPE_CHECKING:
    from rlfleet.sampler.reference_engine import EngineConfig, GenRequest

# The sampling_params fields SGLang 0.5.23's JSON contract gate admits (sglang.api.v1.api_types, whose
# unknown-field error lists them in this order; the contract test compares the text).
CONTRACT_SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)  # fmt: skip
# Fields the reference engine honours; the rest are accepted only at SGLang's defaults (it applies them).
_NEUTRAL_SAMPLING = {
    "stop": None, "stop_regex": None, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None, "logit_bias": None, "custom_params": None, "beam_width": None,
    "watermark": None, "choice": None,
}  # fmt: skip
_INT_SAMPLING = (
    "max_new_tokens",
    "top_k",
    "min_new_tokens",
    "n",
    "sampling_seed",
    "stream_interval",
    "beam_width",
)
_FLOAT_SAMPLING = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_BOOL_SAMPLING = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_BOOL_FIELDS = ("return_logprob", "return_sampling_mask", "stream", "return_text_in_logprobs", "log_metrics")
_INT_FIELDS = ("top_logprobs_num", "logprob_start_len")


SamplingLogprobsMode = Literal["selected", "support"]


class GenerateBody(BaseModel):
    """The GenerateReqInput fields the reference server reads, with GenerateReqInput's (lax) types:
    what FastAPI's parse refuses is refused here with the same status and body shape."""

    model_config = ConfigDict(extra="allow")
    text: list[str] | str | None = None
    input_ids: list[list[int]] | list[int] | None = None
    sampling_params: list[dict[str, Any]] | dict[str, Any] | None = None
    return_logprob: list[bool] | bool | None = None
    logprob_start_len: list[int] | int | None = None
    top_logprobs_num: list[int] | int | None = None
    return_sampling_mask: list[bool] | bool | None = None
    sampling_logprobs_mode: list[SamplingLogprobsMode | None] | SamplingLogprobsMode | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    rid: list[str] | str | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _unexpected(value: object) -> str:
    """How the contract gate's (serde) decoder names an unexpected JSON value."""
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f"string {json.dumps(value)}"
    return "sequence" if isinstance(value, list) else "map" if isinstance(value, dict) else "null"


def _require_type(value: object, ok: bool, expected: str) -> None:
    if not ok:
        raise contract_error(f"invalid type: {_unexpected(value)}, expected {expected}")


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_int_list(v: object) -> bool:
    return isinstance(v, list) and all(_is_int(x) for x in v)


# sampling_params field -> (its type test, the name the gate's error gives the type)
_SAMPLING_TYPES: dict[str, tuple[Callable[[object], bool], str]] = {
    **dict.fromkeys(_INT_SAMPLING, (_is_int, "i64")),
    **dict.fromkeys(_FLOAT_SAMPLING, (_is_number, "f64")),
    **dict.fromkeys(_BOOL_SAMPLING, (lambda v: isinstance(v, bool), "a boolean")),
    "stop_token_ids": (_is_int_list, "a sequence of i64"),
}


def _check_contract(raw: dict[str, Any]) -> None:
    """The JSON contract gate's strict types (no "yes" for a bool, no 1.5 or 2.0 for an int) and its
    closed set of sampling_params fields."""
    for name in _BOOL_FIELDS:
        v = raw.get(name)
        if v is not None:
            ok = isinstance(v, bool) or (isinstance(v, list) and all(isinstance(x, bool) for x in v))
            _require_type(v, ok, "a value or an array of values for BoolOrList")
    for name in _INT_FIELDS:
        v = raw.get(name)
        if v is not None:
            _require_type(v, _is_int(v) or _is_int_list(v), "i64")
    sps = raw.get("sampling_params")
    for sp in sps if isinstance(sps, list) else [sps] if sps is not None else []:
        _check_sampling_fields(sp)


def _check_sampling_fields(sp: dict[str, Any]) -> None:
    for key, v in sp.items():
        if key not in CONTRACT_SAMPLING_FIELDS:
            expected = ", ".join(f"`{f}`" for f in CONTRACT_SAMPLING_FIELDS)
            raise contract_error(f"unknown field `{key}`, expected one of {expected}")
        rule = _SAMPLING_TYPES.get(key)
        if v is not None and rule is not None:
            is_type, expected = rule
            _require_type(v, is_type(v), expected)


@dataclass
class ItemRequest:
    """One normalised request of a (possibly batched) /generate body."""

    input_ids: list[int]
    sampling: dict[str, Any]
    return_logprob: bool
    top_logprobs_num: int
    return_sampling_mask: bool
    sampling_logprobs_mode: str | None
    rid: str | None
    log_metrics: bool
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0


def _per_item(value: Any, i: int, default: Any) -> Any:
    if isinstance(value, list):
        return value[i] if i < len(value) else default
    return default if value is None else value


def normalise_generate(body: GenerateBody) -> tuple[list[ItemRequest], bool]:
    """GenerateReqInput.normalize_batch_and_arguments, for input_ids (single or batched)."""
    if body.input_ids is None:
        if body.text is not None:
            raise value_error("the reference server has no tokenizer: send input_ids, not text")
        raise value_error("Either text, input_ids or input_embeds should be provided.")
    ids = body.input_ids
    batched = bool(ids) and isinstance(ids[0], list)
    # pydantic parsed one of the two shapes, whole: a list of lists, or a list of ints
    rows = cast(list[list[int]], ids) if batched else [cast(list[int], ids)]
    if not batched and not rows[0]:
        raise value_error("input_ids cannot be empty.")
    items = []
    for i, ids in enumerate(rows):
        sp = body.sampling_params
        sampling = (sp[i] if i < len(sp) else {}) if isinstance(sp, list) else dict(sp or {})
        items.append(
            ItemRequest(
                input_ids=list(ids),
                sampling=dict(sampling),
                return_logprob=bool(_per_item(body.return_logprob, i, False)),
                top_logprobs_num=int(_per_item(body.top_logprobs_num, i, 0)),
                return_sampling_mask=bool(_per_item(body.return_sampling_mask, i, False)),
                sampling_logprobs_mode=_per_item(body.sampling_logprobs_mode, i, None),
                rid=_per_item(body.rid, i, None),
                log_metrics=body.log_metrics,
                return_routed_experts=body.return_routed_experts,
                routed_experts_start_len=body.routed_experts_start_len,
            )
        )
    return items, batched


@dataclass
class CheckedSampling:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_new_tokens: int | None
    stop_token_ids: frozenset[int]
    sampling_seed: int | None


def verify_sampling(sp: dict[str, Any]) -> CheckedSampling:
    """SamplingParams.__post_init__ (None = default, temperature < 1e-6 = greedy, top_k -1 = all) and
    SamplingParams.verify, with SGLang's messages."""
    from rlfleet.sampler.sampling import SAMPLING_EPS, TOP_K_ALL

    def get(key: str, default: Any) -> Any:
        v = sp.get(key)
        return default if v is None else v

    # raw JSON numbers, not floats: SGLang's messages print the value as sent ("got 0.", "got 1.5.")
    temperature, top_p = get("temperature", 1.0), get("top_p", 1.0)
    top_k, min_p = get("top_k", -1), get("min_p", 0.0)
    if 0 <= temperature < SAMPLING_EPS:
        temperature, top_k = 1.0, 1
    if top_k == -1:
        top_k = TOP_K_ALL
    max_new_tokens = sp.get("max_new_tokens", 128)
    _check_ranges(temperature, top_p, min_p, top_k)
    _check_lengths(get("min_new_tokens", 0), max_new_tokens)
    seed = sp.get("sampling_seed")
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
        raise value_error(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    for key, neutral in _NEUTRAL_SAMPLING.items():
        if sp.get(key) not in (None, neutral):
            raise value_error(f"sampling_params.{key} is not supported by the reference server")
    return CheckedSampling(
        float(temperature),
        float(top_p),
        int(top_k),
        float(min_p),
        max_new_tokens,
        frozenset(int(t) for t in sp.get("stop_token_ids") or ()),
        seed,
    )


def _check_ranges(temperature: float, top_p: float, min_p: float, top_k: int) -> None:
    if not math.isfinite(temperature) or temperature < 0.0:
        raise value_error(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise value_error(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise value_error(f"min_p must be in [0, 1], got {min_p}.")
    if top_k < 1 or top_k == -1:
        raise value_error(f"top_k must be -1 (disable) or at least 1, got {top_k}.")


def _check_lengths(min_new_tokens: int, max_new_tokens: int | None) -> None:
    if not 0 <= min_new_tokens:
        raise value_error(f"min_new_tokens must be in [0, max_new_tokens], got {min_new_tokens}.")
    if max_new_tokens is None:
        return
    if max_new_tokens < 0:
        raise value_error(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
    if not min_new_tokens <= max_new_tokens:
        raise value_error(
            f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], got {min_new_tokens}."
        )


def mask_rule_message(top_k: int, cap: int) -> str | None:
    """The scheduler's sampling-mask gate (srt/managers/scheduler.py), message verbatim."""
    if top_k != 1 and not (1 < top_k <= cap):
        return (
            "return_sampling_mask requires top_k=1 for greedy sampling "
            f"or finite 1 < top_k <= {cap}; got top_k={top_k}. Lower top_k or increase "
            "--sampling-mask-max-tokens."
        )
    return None


def gate_generate(raw: Any, cfg: EngineConfig) -> tuple[list[GenRequest], bool]:
    """SGLang's /generate gate in its order, for an engine configured with `cfg`: the engine's requests
    and whether the body was a batch. Raises RequestError."""
    if not isinstance(raw, dict):
        raise error_response(400, f"body must be a JSON object, got {type(raw).__name__}", "Bad Request")
    try:
        body = GenerateBody.model_validate(raw)
    except ValidationError as exc:
        raise error_response(400, str(exc), "Bad Request") from None
    _check_contract(raw)
    items, batched = normalise_generate(body)
    if body.stream:
        raise value_error("stream=true is not supported by the reference server")
    for name, neutral in (
        ("logprob_start_len", -1),
        ("return_text_in_logprobs", False),
        ("token_ids_logprob", None),
        ("return_hidden_states", False),
    ):
        value = raw.get(name)
        if value not in (None, neutral, []) and not (
            isinstance(value, list) and all(v in (None, neutral) for v in value)
        ):
            raise value_error(f"{name} is not supported by the reference server")
    return [_engine_request(item, cfg) for item in items], batched


def _engine_request(item: ItemRequest, cfg: EngineConfig) -> GenRequest:
    """One normalised item checked against the model (vocabulary, context length: the tokenizer
    manager's _validate_one_request) and the sampling rules, as the engine's request."""
    from rlfleet.sampler.reference_engine import GenRequest
    from rlfleet.sampler.sampling import RowParams

    vocab, context_len = cfg.model.vocab_size, cfg.model.max_position_embeddings
    if any(i < 0 or i >= vocab for i in item.input_ids):
        raise value_error(f"input_ids must be token ids in [0, {vocab})")
    n_in = len(item.input_ids)
    if n_in >= context_len:
        raise value_error(
            f"The input ({n_in} tokens) is longer than the model's context length ({context_len} tokens)."
        )
    max_new = item.sampling.get("max_new_tokens")
    if max_new is not None and max_new + n_in > context_len:
        raise value_error(
            f"Requested token count exceeds the model's maximum context length "
            f"of {context_len} tokens. You requested a total of {max_new + n_in} "
            f"tokens: {n_in} tokens from the input messages and "
            f"{max_new} tokens for the completion. Please reduce the number "
            f"of tokens in the input messages or the completion to fit within the limit."
        )
    sp = verify_sampling(item.sampling)
    if item.sampling_logprobs_mode is not None and not item.return_sampling_mask:
        raise value_error("sampling_logprobs_mode can only be set when return_sampling_mask=true.")
    if item.return_sampling_mask:
        message = mask_rule_message(sp.top_k, cfg.sampling_mask_max_tokens)
        if message:
            raise value_error(message)
    req = GenRequest(
        input_ids=item.input_ids,
        params=RowParams(sp.temperature, sp.top_p, sp.top_k, sp.min_p),
        max_new_tokens=sp.max_new_tokens if sp.max_new_tokens is not None else context_len - n_in,
        stop_token_ids=sp.stop_token_ids,
        return_logprob=item.return_logprob,
        return_mask=item.return_sampling_mask,
        logprob_mode=item.sampling_logprobs_mode or "selected",
        top_logprobs_num=min(max(item.top_logprobs_num, 0), vocab) if item.return_logprob else 0,
        seed=sp.sampling_seed,
        log_metrics=item.log_metrics,
    )
    if item.return_routed_experts:
        _check_routed_experts_start(item.routed_experts_start_len, n_in)
        req.return_routed_experts = True
        req.routed_experts_start_len = item.routed_experts_start_len
    if item.rid:
        req.rid = item.rid
    return req


def _check_routed_experts_start(start: int, n_in: int) -> None:
    """SGLang's scheduler rule for routed_experts_start_len (scheduler.py: in [0, the input's tokens]),
    with its messages; SGLang aborts such a request, the reference server refuses it (400)."""
    if start < 0:
        raise value_error(
            f"recv_req.routed_experts_start_len={start} is lower than 0. "
            "Please use a non-negative routed_experts_start_len."
        )
    if start > n_in:
        raise value_error(
            f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={n_in}. Please use a smaller routed_experts_start_len."
        )
