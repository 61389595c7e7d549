"""SGLang 0.5.23 `/generate` wire format: building requests and parsing responses into `SampledTurn`s.

Pure functions, no I/O (the async client in `client.py` does the HTTP and the retry policy). The shapes
below are SGLang's own (srt/managers/tokenizer_manager.py builds meta_info; the contract tier in
tests/sglang_contract runs that code and parses its output with this module; docs/sampler.md).

Request: `input_ids` (token-in/token-out, never re-tokenised), `sampling_params {temperature, top_p,
top_k, min_p, max_new_tokens, stop_token_ids, sampling_seed}`, `return_logprob: true`, and either
- support mode: `return_sampling_mask: true`, `sampling_logprobs_mode: "support"`: per token the
  kept set (top-k ∩ top-p, then min-p; sorted by probability desc) and q renormalised inside it. SGLang
  only accepts the mask with top_k == 1 or 1 < top_k <= --sampling-mask-max-tokens, so whenever the
  policy truncates with top_k = -1 we send a finite `mask_top_k` (1024);
- head mode: `top_logprobs_num: K`: per token the top-K of the full-vocabulary q (for SC's tail model
  when sampling is not truncated).

Response `{"text", "output_ids", "meta_info": {...}}`, meta_info keys read here:
- `output_token_logprobs`: [[logprob, id, text|null], ...], one per output token;
- `output_token_sampling_mask`: per token the kept ids; `output_token_sampling_logprobs`: per token a
  list aligned with the mask ("support" mode) or ONE float, log q_S(y) (the default "selected" mode);
  `output_token_sampling_mask_length`: ONE int, the number of mask rows;
- `output_top_logprobs`: per token a list of [logprob, id, text] triples (head mode);
- `weight_versions`: spans `[{"version": "<str>", "start": i, "end": j}, ...]` covering the output
  tokens (several when the request straddled a weight update); `weight_version` (the last span's
  version, else the server's launch `--weight-version`); versions are our ints as decimal strings;
- `completion_tokens`, `cached_tokens`, `finish_reason` ({"type": "stop" | "length" | "abort", ...});
- `routed_experts` (a mixture of experts, requested with `return_routed_experts: true` when
  `SamplingConfig.routed_experts_top_k` > 0; the server must run with --enable-return-routed-experts):
  base64 of the little-endian int32 bytes of a C-order [P + n - 1, layers, top_k] array
  (detokenizer_manager.py `_b64_encode_per_request` of the scheduler's `capturer.get_topk`: the
  positions [routed_experts_start_len = 0, seqlen - 1), each the top-k expert ids the router chose in
  every layer; the last output token was never forwarded), sent with the finishing chunk.
`meta_info.rlfleet_group` / `rlfleet_replica` (added by our router) are read when present.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:  # 5-10x faster than the stdlib on logprob-heavy bodies (1.8 KB of JSON per token at K = 64)
    import orjson

    def loads_json(data: bytes | str) -> Any:
        return orjson.loads(data)

    def dumps_json(obj: Any) -> bytes:
        return orjson.dumps(obj)

except ImportError:  # pragma: no cover - orjson is in the sampler/trainer extras
    import json

    def loads_json(data: bytes | str) -> Any:
        return json.loads(data)

    def dumps_json(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()


from rlfleet.records import HEAD_MODE, LOGPROB_TOL, R_MALFORMED, SUPPORT_MODE, SampledTurn, validate_turn

DEFAULT_MASK_TOP_K = 1024  # finite top_k sent with top_p < 1 when the caller said -1 (SGLang needs one)
DEFAULT_MASK_CAP = 4096  # SGLang's --sampling-mask-max-tokens default
R_LENGTH_MISMATCH = "meta_info_lengths_disagree"
R_SUPPORT_MISSING = "support_logprobs_missing"  # selected mode: q over the support was not returned
R_MASK_LENGTH = "output_token_sampling_mask_length"  # the mask row count disagrees with the token count


class ProtocolError(ValueError):
    """A response that cannot be read as an SGLang /generate answer at all."""


@dataclass
class SamplingConfig:
    """What the rollout asks for; `candidate_mode=None` picks support mode when sampling truncates
    (top_p < 1, finite top_k or min_p > 0) and head mode otherwise."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    candidate_mode: str | None = None
    head_size: int = 128  # top_logprobs_num in head mode
    mask_top_k: int = DEFAULT_MASK_TOP_K
    routed_experts_top_k: int = 0
    """0: a dense model, routing not asked for; k > 0: the model's num_experts_per_tok, and each turn
    carries the experts its mixture of experts routed every position to (`SampledTurn.routed_experts`)."""

    def __post_init__(self) -> None:
        if self.routed_experts_top_k < 0:
            raise ValueError(f"routed_experts_top_k must be >= 0, got {self.routed_experts_top_k}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if self.candidate_mode not in (None, SUPPORT_MODE, HEAD_MODE):
            raise ValueError(f"candidate_mode must be support or head, got {self.candidate_mode!r}")
        if self.head_size < 1 or self.mask_top_k < 2:
            raise ValueError("head_size must be >= 1 and mask_top_k >= 2")

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> SamplingConfig:
        """From the rollout's sampling dict (unknown keys are ignored)."""
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in params.items() if k in known}
        if "stop_token_ids" in kwargs:
            kwargs["stop_token_ids"] = [int(t) for t in kwargs["stop_token_ids"] or []]
        return cls(**kwargs)

    @property
    def truncates(self) -> bool:
        return self.top_p < 1 or self.top_k > 0 or self.min_p > 0 or self.temperature == 0

    @property
    def mode(self) -> str:
        if self.candidate_mode is not None:
            return self.candidate_mode
        return SUPPORT_MODE if self.truncates else HEAD_MODE

    def wire_top_k(self) -> int:
        """top_k as sent: finite whenever the sampling mask is requested (SGLang rejects -1 with it)."""
        if self.mode == SUPPORT_MODE and self.top_k == -1:
            return self.mask_top_k
        return self.top_k


def build_generate_request(
    input_ids: Sequence[int],
    config: SamplingConfig,
    sampling_seed: int | None = None,
    top_k_override: int | None = None,
    rid: str | None = None,
) -> dict[str, Any]:
    """The JSON body of one `/generate` call."""
    params: dict[str, Any] = {
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": top_k_override if top_k_override is not None else config.wire_top_k(),
        "max_new_tokens": config.max_new_tokens,
        "stop_token_ids": list(config.stop_token_ids),
    }
    if config.min_p > 0:
        params["min_p"] = config.min_p
    if sampling_seed is not None:
        params["sampling_seed"] = int(sampling_seed)
    body: dict[str, Any] = {
        "input_ids": [int(i) for i in input_ids],
        "sampling_params": params,
        "return_logprob": True,
    }
    if config.mode == SUPPORT_MODE:
        body["return_sampling_mask"] = True
        body["sampling_logprobs_mode"] = "support"
    else:
        body["top_logprobs_num"] = config.head_size
    if config.routed_experts_top_k:
        body["return_routed_experts"] = True  # from position 0 (routed_experts_start_len's default)
    if rid is not None:
        body["rid"] = rid
    return body


def finish_reason_of(raw: object) -> str:
    """SGLang reports an object ({"type": "stop", "matched": 2}, {"type": "length", "length": 16},
    {"type": "abort", "message": ...}); older builds a plain string; None while unfinished."""
    if isinstance(raw, Mapping):
        return str(raw.get("type") or "")
    return "" if raw is None else str(raw)


def weight_version_of(raw: object) -> int:
    """meta_info.weight_version is the decimal string of our int version; -1 when absent or not an int
    (those tokens then fail validation: a record must say which weights produced it)."""
    try:
        v = int(str(raw))
    except (TypeError, ValueError):
        return -1
    return v if v >= 0 else -1


def token_weight_versions(meta: Mapping[str, Any], n: int) -> np.ndarray | None:
    """Per-token weight versions from `meta_info.weight_versions` spans (srt/utils/weight_versions.py:
    `{version, start, end}` back to back from token 0 to the last output token; `weight_version` is the
    last span's version). Without spans (SGLang omits them only on unfinished stream chunks) every token
    gets `weight_version`. None when the spans do not tile [0, n) or disagree with `weight_version`."""
    scalar = weight_version_of(meta.get("weight_version"))
    spans = meta.get("weight_versions")
    if spans is None:
        return np.full(n, scalar, dtype=np.int64)
    if not isinstance(spans, list) or not spans:
        return None
    versions = np.empty(n, dtype=np.int64)
    position = 0
    for span in spans:
        if not isinstance(span, Mapping):
            return None
        try:
            start, end = int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError):
            return None
        if start != position or end < start or end > n:
            return None
        versions[start:end] = weight_version_of(span.get("version"))
        position = end
    if position != n or str(spans[-1].get("version")) != str(
        meta.get("weight_version", spans[-1].get("version"))
    ):
        return None
    return versions


def routed_experts_of(meta: Mapping[str, Any], positions: int, top_k: int) -> np.ndarray | None:
    """`meta_info.routed_experts` -> int32 [positions, layers, top_k] (the layers are what the bytes
    leave); None when the bytes are not that shape or hold a negative id. ProtocolError when the field
    is absent: SGLang leaves it out unless launched with --enable-return-routed-experts."""
    encoded = meta.get("routed_experts")
    if encoded is None:
        raise ProtocolError(
            "meta_info.routed_experts missing: the server must run with --enable-return-routed-experts "
            "(and serve a mixture of experts) when routed experts are requested"
        )
    try:
        raw = base64.b64decode(str(encoded), validate=True)
    except (binascii.Error, ValueError):
        return None
    slots = positions * top_k  # int32 ids per layer
    if positions < 1 or len(raw) % (4 * slots) or not raw:
        return None
    ids = np.frombuffer(raw, dtype="<i4").astype(np.int32)
    if (ids < 0).any():
        return None
    return ids.reshape(positions, ids.size // slots, top_k)


def _flatten_float(rows: Sequence[Sequence[float]], count: int) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(rows), dtype=np.float64, count=count).astype(np.float32)


def _flatten_int(rows: Sequence[Sequence[int]], count: int) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=count).astype(np.int32)


def _float_or_nan(x: object) -> float:
    return float("nan") if x is None else float(x)  # type: ignore[arg-type]


@dataclass
class _Candidates:
    """What one answer says about each token's candidate set: the CSR pieces of SampledTurn, the
    sampled-token logprobs when the answer gives them directly, the alignment problems found, and
    per-token invalidity flags (reason -> bool mask)."""

    mode: str
    sizes: np.ndarray
    sid: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    slp: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    sampled: np.ndarray | None = None
    problems: list[str] = field(default_factory=list)
    flags: dict[str, np.ndarray] = field(default_factory=dict)


def parse_generate_response(
    body: Mapping[str, Any],
    prompt_ids: Sequence[int] | np.ndarray,
    *,
    group: str = "",
    replica: str = "",
    vocab_size: int | None = None,
    untruncated: bool = False,
    tol: float = LOGPROB_TOL,
    routed_experts_top_k: int = 0,
    weight_version: int | None = None,
) -> SampledTurn:
    """One SGLang /generate JSON answer -> a validated SampledTurn.

    Support mode is detected from `output_token_sampling_mask`, head mode from `output_top_logprobs`.
    `untruncated=True` (top_p = 1, top_k = -1, min_p = 0) lets head mode fill `sampled_logprobs` with
    the full-vocabulary logprob (q_S = q then). `routed_experts_top_k` > 0: `routed_experts` is read
    (`routed_experts_of`; the server's missing flag is a ProtocolError, bytes of another shape make
    the turn untrainable as a length mismatch). `weight_version`: every token's version, given by the
    caller (LoRA: the version of the adapter the request named, the router's X-RLFleet-Adapter-Version;
    meta_info's `weight_versions` spans then say only when loads happened and are not read); None: the
    spans'. Raises ProtocolError only when there is no readable token list at all (or no routing when
    it was asked for); every other defect becomes invalid tokens counted by reason.
    """
    meta = body.get("meta_info") if isinstance(body, Mapping) else None
    if not isinstance(meta, Mapping):
        raise ProtocolError("response has no meta_info object")
    output_ids, logprobs = _output_tokens(meta)
    n = len(output_ids)
    common = dict(
        prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=finish_reason_of(meta.get("finish_reason")),
        group=str(meta.get("rlfleet_group") or group),
        replica=str(meta.get("rlfleet_replica") or replica),
        cached_tokens=int(meta.get("cached_tokens") or 0),
    )
    problems, versions = _count_problems(body, meta, output_ids, weight_version)
    cand = _candidates(meta, n, logprobs, untruncated)
    problems += cand.problems
    routed = None
    if routed_experts_top_k:
        routed = routed_experts_of(meta, len(prompt_ids) + n - 1, routed_experts_top_k)
        if routed is None:
            problems.append("routed_experts")

    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(cand.sizes, out=offsets[1:])
    sampled = cand.sampled
    if sampled is None:
        sampled = (
            _sampled_from_support(output_ids, offsets, cand.sid, cand.slp)
            if cand.mode == SUPPORT_MODE
            else (np.full(n, np.nan, dtype=np.float32))
        )
    turn = SampledTurn(
        sampled_logprobs=sampled,
        support_offsets=offsets,
        support_ids=cand.sid,
        support_logprobs=cand.slp,
        weight_versions=versions,
        candidate_mode=cand.mode,
        routed_experts=routed,
        **common,  # type: ignore[arg-type]
    )
    if problems:  # the arrays do not line up: nothing of this turn may be trained on
        turn.valid = np.zeros(n, dtype=bool)
        turn.invalid_reasons = {R_LENGTH_MISMATCH: max(n, 1)}
        return turn
    validate_turn(turn, vocab_size=vocab_size, tol=tol)
    _invalidate_flagged(turn, cand.flags)
    return turn


def _output_tokens(meta: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The sampled token ids and their logprobs from output_token_logprobs; ProtocolError when unreadable."""
    otl = meta.get("output_token_logprobs")
    if not isinstance(otl, list):
        raise ProtocolError("meta_info.output_token_logprobs missing: was return_logprob sent?")
    try:
        # [[logprob, token_id, text|null], ...]
        output_ids = np.asarray([int(t[1]) for t in otl], dtype=np.int64).astype(np.int32)
        logprobs = np.asarray([_float_or_nan(t[0]) for t in otl], dtype=np.float32)
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise ProtocolError(f"output_token_logprobs entries must be [logprob, id, text]: {exc}") from None
    return output_ids, logprobs


def _count_problems(
    body: Mapping[str, Any], meta: Mapping[str, Any], output_ids: np.ndarray, weight_version: int | None
) -> tuple[list[str], np.ndarray]:
    """The fields whose token count or ids disagree with output_token_logprobs, and the per-token
    weight versions: `weight_version` for every token when given, else the spans' (all -1 when the
    spans do not cover the output)."""
    n = len(output_ids)
    problems: list[str] = []
    if (
        "output_ids" in body
        and body["output_ids"] is not None
        and list(body["output_ids"]) != output_ids.tolist()
    ):
        problems.append("output_ids")
    completion = meta.get("completion_tokens")
    if completion is not None and int(completion) != n:
        problems.append("completion_tokens")
    if weight_version is not None:
        return problems, np.full(n, weight_version, dtype=np.int64)
    spanned = token_weight_versions(meta, n)
    if spanned is None:
        problems.append("weight_versions")
        return problems, np.full(n, -1, dtype=np.int64)
    return problems, spanned


def _candidates(meta: Mapping[str, Any], n: int, logprobs: np.ndarray, untruncated: bool) -> _Candidates:
    """The candidate sets, read in support mode when the answer carries a sampling mask, else in head mode."""
    mask = meta.get("output_token_sampling_mask")
    if mask is not None:
        return _support_candidates(meta, mask, n)
    head = meta.get("output_top_logprobs")
    if head is not None:
        return _head_candidates(head, n, logprobs, untruncated)
    raise ProtocolError("response carries neither output_token_sampling_mask nor output_top_logprobs")


def _support_candidates(meta: Mapping[str, Any], mask: object, n: int) -> _Candidates:
    """Support mode: the captured sampling support per token and its logprobs."""
    cand = _Candidates(SUPPORT_MODE, sizes=np.zeros(n, np.int64))
    s_lps = meta.get("output_token_sampling_logprobs")
    if not isinstance(mask, list) or len(mask) != n or not isinstance(s_lps, list) or len(s_lps) != n:
        cand.problems.append("output_token_sampling_mask/logprobs")
    else:
        _read_support_rows(cand, mask, s_lps, n)
    # ONE int: the number of mask rows (tokenizer_manager: len(state.output_token_sampling_mask))
    mlen = meta.get("output_token_sampling_mask_length")
    if mlen is not None and (isinstance(mlen, bool) or not isinstance(mlen, int) or mlen != n):
        cand.problems.append(R_MASK_LENGTH)
    return cand


def _read_support_rows(cand: _Candidates, mask: list[Any], s_lps: list[Any], n: int) -> None:
    """Fill `cand` from mask rows of the right count; a row-shape defect leaves it empty with a problem."""
    sizes = np.fromiter(map(len, mask), dtype=np.int64, count=n)
    nnz = int(sizes.sum())
    sid = _flatten_int(mask, nnz)
    # SamplingMaskChunk.to_lists: "support" -> a list per row, "selected" -> one float per row
    list_rows = sum(isinstance(x, list) for x in s_lps)
    if 0 < list_rows < n:
        cand.problems.append("output_token_sampling_logprobs mixes lists and floats")
        return
    if list_rows == 0:  # "selected": log q_S(y) only, no q over the rest of the support
        cand.sizes, cand.sid = sizes, sid
        cand.sampled = np.asarray([_float_or_nan(x) for x in s_lps], dtype=np.float32)
        cand.slp = np.full(nnz, np.nan, dtype=np.float32)
        cand.flags[R_SUPPORT_MISSING] = np.ones(n, dtype=bool)
        return
    lens = np.fromiter(map(len, s_lps), dtype=np.int64, count=n)
    if not np.array_equal(lens, sizes):
        cand.problems.append("output_token_sampling_logprobs row lengths")
        return
    cand.sizes, cand.sid, cand.slp = sizes, sid, _flatten_float(s_lps, nnz)


def _head_candidates(head: object, n: int, logprobs: np.ndarray, untruncated: bool) -> _Candidates:
    """Head mode: the top-k logprobs per token; q_S(y) is the sampled logprob only when untruncated."""
    cand = _Candidates(HEAD_MODE, sizes=np.zeros(n, np.int64))
    if not isinstance(head, list) or len(head) != n:
        cand.problems.append("output_top_logprobs")
    else:
        rows = [r or [] for r in head]
        cand.sizes = np.fromiter(map(len, rows), dtype=np.int64, count=n)
        flat = list(itertools.chain.from_iterable(rows))
        cand.slp = np.asarray([_float_or_nan(t[0]) for t in flat], dtype=np.float32)
        cand.sid = np.asarray([t[1] for t in flat], dtype=np.int64).astype(np.int32)
    cand.sampled = logprobs.copy() if untruncated else None
    return cand


def _invalidate_flagged(turn: SampledTurn, flags: dict[str, np.ndarray]) -> None:
    """Mark the flagged tokens invalid and count them under their reason."""
    for reason, flagged in flags.items():
        count = int(flagged.sum())
        if count:
            turn.valid &= ~flagged
            turn.invalid_reasons[reason] = turn.invalid_reasons.get(reason, 0) + count


def _sampled_from_support(
    out: np.ndarray, offsets: np.ndarray, sid: np.ndarray, slp: np.ndarray
) -> np.ndarray:
    """log q_S(y): the support logprob at the sampled token (NaN when y is not in its support)."""
    n = out.shape[0]
    sampled = np.full(n, np.nan, dtype=np.float32)
    if sid.size == 0:
        return sampled
    row = np.repeat(np.arange(n), np.diff(offsets))
    hit = np.flatnonzero(sid == out[row])
    sampled[row[hit[::-1]]] = slp[hit[::-1]]  # first hit per row wins
    return sampled


def error_message(body: object) -> str:
    """The message of an SGLang /generate error body. SGLang 0.5.23 answers in three shapes
    (srt/entrypoints/http_server.py): the JSON contract gate `{"error": "<text>"}` (400); a ValueError
    (bad request, or a 400 abort such as the sampling-mask cap) `{"error": {"message": ...}}`; an
    HTTPException (5xx aborts: sampled token outside the captured support) and request validation
    errors as `ErrorResponse {"object": "error", "message", "type", "param", "code"}`. FastAPI's own
    `{"detail": ...}` is read too."""
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if key in body:
                return str(body[key])
    return "" if body is None else str(body)


# The two 400s SGLang gives a sampling-mask request (scheduler.py / batch_result_processor.py), both
# naming the server's --sampling-mask-max-tokens: top_k outside (1, cap] before running, and a realised
# support above the cap (ties at the cutoff) mid-request.
_MASK_TOP_K_REJECTED = re.compile(r"return_sampling_mask requires top_k=1\b.*?top_k <= (\d+)", re.DOTALL)
_MASK_OVERFLOW = re.compile(r"Sampling support exceeds --sampling-mask-max-tokens=(\d+)")


def mask_cap_error(message: str) -> tuple[str, int] | None:
    """("top_k_rejected" | "support_overflow", the server's cap) for SGLang's sampling-mask 400s."""
    if m := _MASK_TOP_K_REJECTED.search(message):
        return "top_k_rejected", int(m.group(1))
    if m := _MASK_OVERFLOW.search(message):
        return "support_overflow", int(m.group(1))
    return None


__all__ = [
    "DEFAULT_MASK_CAP",
    "DEFAULT_MASK_TOP_K",
    "ProtocolError",
    "R_LENGTH_MISMATCH",
    "R_MALFORMED",
    "R_MASK_LENGTH",
    "R_SUPPORT_MISSING",
    "SamplingConfig",
    "build_generate_request",
    "dumps_json",
    "error_message",
    "finish_reason_of",
    "loads_json",
    "mask_cap_error",
    "parse_generate_response",
    "routed_experts_of",
    "token_weight_versions",
    "weight_version_of",
]
