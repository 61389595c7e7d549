"""SGLang 0.5.23's own code, run on CPU, as the oracle for what our client sends and parses.

- `admit(body)`: a `/generate` body through SGLang's request gate in the order the server runs it:
  the JSON contract gate (`api_contract.generate_contract_error`), `GenerateReqInput` normalisation,
  `TokenizerManager._validate_one_request` and `_create_tokenized_object` (which builds
  `SamplingParams(**sampling_params)` and runs its `.normalize()` / `.verify()`), then the scheduler's
  sampling-mask top_k rule. `Scheduler._handle_generate_request` cannot be constructed on CPU, so its
  rule is compiled from the installed scheduler.py source (`scheduler_mask_rule`), which fails when the
  lines change.
- `generate_response(...)`: the response SGLang assembles: per output token the host-side rows the
  scheduler queues (`SamplingMaskRows.append` / `.take`, pickled across the process boundary as
  SGLang does), the weight-version spans (`compute_weight_version_spans` from `WeightVersionEvent`s),
  a `BatchStrOutput` per chunk fed to `TokenizerManager._handle_batch_output` (meta_info,
  `SamplingMaskChunk.to_lists`, `add_weight_versions_to_meta_info`), serialised by SGLang's
  `orjson_response`.
- `error_response(...)`: an abort's finish reason (`FINISH_ABORT` from SGLang's own message builders)
  through `TokenizerManager._handle_abort_finish_reason`, then the HTTP body http_server.py makes of
  the exception (its handlers need xgrammar, absent here: the two body shapes are held against the
  source lines in test_contract_errors.py).

Stubbed, because it cannot exist here: the TokenizerManager's process plumbing (ZMQ sockets,
tokenizer, detokenizer, model weights). The instance is built with `__new__` and given only the
plain attributes these methods read; everything they compute is SGLang's code. The runtime context
(SGLang's process-wide config) is built by SGLang's `create_context` from a tiny Qwen3 config.json.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import functools
import importlib.util
import pickle
import tempfile
import types
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

VOCAB = 64


def _run(coroutine: Any) -> Any:
    """Run SGLang's async handlers to completion, also when called from inside an event loop (a test
    server's handler): then on a thread of its own, with its own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def sglang_source(relative: str) -> str:
    """The installed SGLang file's text, read without importing it."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    return (Path(next(iter(spec.submodule_search_locations))) / relative).read_text()


@functools.cache
def model_dir() -> str:
    from transformers import Qwen3Config

    path = Path(tempfile.mkdtemp(prefix="rlfleet-sglang-contract-"))
    Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    ).save_pretrained(path)
    return str(path)


@functools.cache
def context(role: str, weight_version: str = "5", sampling_mask_max_tokens: int = 4096) -> Any:
    from sglang.srt.runtime_context import create_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=model_dir(),
        skip_tokenizer_init=True,
        device="cpu",
        weight_version=weight_version,
        sampling_mask_max_tokens=sampling_mask_max_tokens,
        enable_metrics=True,
    )
    return create_context(args, role=role)


def forget_sglang_default_registry_metrics() -> None:
    """SGLang's GaugeHistogram (utils/gauge_histogram.py) registers its gauges in prometheus' default
    registry whatever metric classes a collector is given, so a second SchedulerMetricsCollector in one
    process fails with DuplicateTimeseries. Call before constructing one (test processes only)."""
    from prometheus_client import REGISTRY

    for collector, names in list(REGISTRY._collector_to_names.items()):
        if any(name.startswith("sglang:") for name in names):
            REGISTRY.unregister(collector)


def tokenizer_manager(ctx: Any) -> Any:
    """A TokenizerManager without its process plumbing (see the module docstring)."""
    from sglang.srt.managers import io_struct
    from sglang.srt.managers import tokenizer_manager as tmm
    from sglang.srt.sampling.sampling_params import SamplingParams

    tm = tmm.TokenizerManager.__new__(tmm.TokenizerManager)
    tm.server_args = ctx.server_args
    tm.rid_to_state = {}
    tm.enable_metrics = False
    tm.skip_tokenizer_init = False
    tm.incremental_streaming_output = False
    tm.dump_requests_folder = None
    tm.crash_dump_folder = None
    tm.enable_lora = False
    tm.tokenizer = None
    tm.preferred_sampling_params = None
    tm.sampling_params_class = SamplingParams
    tm.tokenized_generate_req_type = io_struct.TokenizedGenerateReqInput
    tm.fake_bootstrap_room_counter = 0
    tm.model_config = types.SimpleNamespace(vocab_size=VOCAB, joint_head_config=None, pointer_head=None)
    tm.context_len = 512
    tm.num_reserved_tokens = 0
    tm.validate_total_tokens = True
    tm.allow_auto_truncate = False
    tm.is_generation = True
    return tm


# ------------------------------------------------------------------------------------ requests
@functools.cache
def scheduler_mask_rule() -> tuple[types.CodeType, ast.expr]:
    """`Scheduler._handle_generate_request`'s sampling-mask top_k test and its error f-string, compiled
    from scheduler.py. Asserts the two assignments the test reads (top_k from the request's normalised
    SamplingParams, the cap from --sampling-mask-max-tokens) so that a change in SGLang fails here."""
    tree = ast.parse(sglang_source("srt/managers/scheduler.py"))
    fn = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_handle_generate_request"
    )
    body = ast.unparse(fn)
    assert "top_k = req.sampling_params.top_k" in body, "SGLang's mask rule no longer reads the request top_k"
    assert "sampling_mask_cap = self.server_args.sampling_mask_max_tokens" in body
    rule = next(
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.If)
        and ast.unparse(n.test) == "top_k != 1 and (not 1 < top_k <= sampling_mask_cap)"
    )
    message = next(
        s.value for s in rule.body if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "error_msg"
    )
    assert any("_reject_sampling_mask_request" in ast.unparse(s) for s in rule.body)
    return compile(ast.Expression(rule.test), "scheduler.py", "eval"), message


def scheduler_mask_error(top_k: int, cap: int) -> str | None:
    """SGLang's 400 message for a sampling-mask request with this (normalised) top_k, or None."""
    test, message = scheduler_mask_rule()
    names = {"top_k": top_k, "sampling_mask_cap": cap}
    if not eval(test, {}, names):  # noqa: S307 - SGLang's own expression, compiled from its source
        return None
    return eval(compile(ast.Expression(message), "scheduler.py", "eval"), {}, names)  # noqa: S307


class Rejected(ValueError):
    """SGLang answers 400 with this message; `body` is the JSON it sends (http_server.py)."""

    def __init__(self, message: str, body: dict[str, Any]) -> None:
        super().__init__(message)
        self.body = body


def admit(body: dict[str, Any], sampling_mask_max_tokens: int = 4096) -> Any:
    """The TokenizedGenerateReqInput SGLang builds from `body`, or Rejected with SGLang's message."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers import tokenizer_manager as tmm
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.observability.req_time_stats import APIServerReqTimeStats
    from sglang.srt.runtime_context import use_context

    contract_error = generate_contract_error(orjson.loads(orjson.dumps(body)))
    if contract_error is not None:
        raise Rejected(contract_error, {"error": contract_error})
    ctx = context("tokenizer", sampling_mask_max_tokens=sampling_mask_max_tokens)
    with use_context(ctx):
        tm = tokenizer_manager(ctx)
        try:
            obj = GenerateReqInput(**body)
            obj.normalize_batch_and_arguments()
            tm.rid_to_state[obj.rid] = tmm.ReqState([], False, None, obj, time_stats=APIServerReqTimeStats())
            tm._validate_one_request(obj, list(obj.input_ids))
            tokenized = tm._create_tokenized_object(obj, None, list(obj.input_ids), None, None, None)
        except ValueError as exc:  # http_server._create_error_response
            raise Rejected(str(exc), {"error": {"message": str(exc)}}) from None
    if tokenized.return_sampling_mask:
        message = scheduler_mask_error(tokenized.sampling_params.top_k, sampling_mask_max_tokens)
        if message is not None:  # Scheduler._reject_sampling_mask_request: prepare_abort(..., BAD_REQUEST)
            from sglang.srt.managers.schedule_batch import FINISH_ABORT

            raise Rejected(message, error_response(FINISH_ABORT(message, 400).to_json())[1])
    return tokenized


# ------------------------------------------------------------------------------------ responses
@dataclass
class Token:
    """What SGLang's sampler produced for one output token (the GPU side, given as data)."""

    id: int
    logprob: float  # full-vocabulary log q(y) at the temperature (output_token_logprobs)
    support: list[int] = field(default_factory=list)  # kept ids, sorted by probability desc
    support_logprobs: list[float] = field(default_factory=list)  # log q renormalised in the kept set
    top: list[tuple[float, int]] = field(default_factory=list)  # head mode: (logprob, id) top-K


def _rows(tokens: Sequence[Token], mode: str) -> Any:
    """One chunk of mask rows as the scheduler queues and ships them (batch_result_processor.py
    appends the support and either the support logprobs or [the sampled token's])."""
    from sglang.srt.sampling.sampling_mask import SamplingMaskRows

    rows = SamplingMaskRows()
    for t in tokens:
        ids = np.asarray(t.support, dtype=np.int32)
        lps = np.asarray(t.support_logprobs, dtype=np.float32)
        if mode == "selected":
            lps = lps[[t.support.index(t.id)]]
        rows.append(ids, lps)
    return pickle.loads(pickle.dumps(rows.take(), protocol=5))  # scheduler -> tokenizer process


def generate_response(
    prompt: Sequence[int],
    tokens: Sequence[Token],
    *,
    mode: str = "support",  # "support" | "selected" (the mask) | "head" (top_logprobs_num)
    top_logprobs_num: int = 0,
    version_events: Sequence[tuple[str, int]] = (),  # (version before an update, tokens produced under it)
    current_version: str = "5",
    finish_reason: dict[str, Any] | None = None,
    chunk_sizes: Sequence[int] | None = None,
    cached_tokens: int = 0,
    sampling_params: dict[str, Any] | None = None,
    rid: str = "rlfleet-contract",
    routed_experts: np.ndarray | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(request body, JSON response) exactly as SGLang's tokenizer manager assembles and serialises it.
    The scheduler streams a request's outputs in chunks (`chunk_sizes`, default one chunk); spans come
    with the finishing chunk (output_streamer.py). `routed_experts`: the scheduler's host-side routing
    of the finished request (`capturer.get_topk`: int32 [positions, layers, top_k]), requested with
    `return_routed_experts` and encoded by the detokenizer (`DetokenizerManager._b64_encode_per_request`)
    into the finishing chunk, as batch_result_processor.py collects it when the request finishes."""
    from sglang.srt.managers import tokenizer_manager as tmm
    from sglang.srt.managers.io_struct import BatchStrOutput, GenerateReqInput
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.observability.req_time_stats import APIServerReqTimeStats
    from sglang.srt.runtime_context import use_context
    from sglang.srt.utils.json_response import orjson_response
    from sglang.srt.utils.weight_versions import WeightVersionEvent, compute_weight_version_spans

    n = len(tokens)
    body: dict[str, Any] = {
        "input_ids": list(prompt),
        "sampling_params": sampling_params
        or {"temperature": 1.0, "top_p": 0.9, "top_k": 8, "max_new_tokens": n},
        "return_logprob": True,
        "rid": rid,
    }
    if routed_experts is not None:
        body["return_routed_experts"] = True
    if mode == "head":
        body["top_logprobs_num"] = top_logprobs_num
    else:
        body["return_sampling_mask"] = True
        body["sampling_logprobs_mode"] = mode
    finish = finish_reason or FINISH_LENGTH(n).to_json()
    sizes = list(chunk_sizes or [n])
    assert sum(sizes) == n
    events = [WeightVersionEvent(old_version=v, num_output_tokens=k) for v, k in version_events]
    ctx = context("tokenizer")
    routed = None
    if routed_experts is not None:
        import torch
        from sglang.srt.managers.detokenizer_manager import DetokenizerManager

        routed = DetokenizerManager._b64_encode_per_request(
            [torch.from_numpy(routed_experts.astype(np.int32))]
        )

    async def run() -> dict[str, Any]:
        with use_context(ctx):
            tm = tokenizer_manager(ctx)
            obj = GenerateReqInput(**body)
            obj.normalize_batch_and_arguments()
            state = tmm.ReqState([], False, asyncio.Event(), obj, time_stats=APIServerReqTimeStats())
            tm.rid_to_state[rid] = state
            start = 0
            for c, size in enumerate(sizes):
                part = tokens[start : start + size]
                last = c == len(sizes) - 1
                head = mode == "head"
                recv = BatchStrOutput(
                    rids=[rid],
                    finished_reasons=[finish if last else None],
                    output_strs=[""],
                    output_ids=[array("i", [t.id for t in part])],
                    prompt_tokens=[len(prompt)],
                    completion_tokens=[start + size],
                    reasoning_tokens=[0],
                    cached_tokens=[cached_tokens],
                    input_token_logprobs_val=None,
                    input_token_logprobs_idx=None,
                    output_token_logprobs_val=[[t.logprob for t in part]],
                    output_token_logprobs_idx=[[t.id for t in part]],
                    input_top_logprobs_val=None,
                    input_top_logprobs_idx=None,
                    output_top_logprobs_val=[[[lp for lp, _ in t.top] for t in part]] if head else None,
                    output_top_logprobs_idx=[[[i for _, i in t.top] for t in part]] if head else None,
                    input_token_ids_logprobs_val=None,
                    input_token_ids_logprobs_idx=None,
                    output_token_ids_logprobs_val=None,
                    output_token_ids_logprobs_idx=None,
                    output_token_entropy_val=None,
                    output_token_sampling_mask=None if head else [_rows(part, mode)],
                    output_hidden_states=None,
                    routed_experts=routed if last else None,
                    indexer_topk=None,
                    placeholder_tokens_idx=None,
                    placeholder_tokens_val=None,
                    retraction_counts=[0],
                    weight_versions=[compute_weight_version_spans(events, current_version, n)]
                    if last
                    else None,
                )
                await tm._handle_batch_output(recv)
                start += size
            assert state.finished
            return orjson.loads(orjson_response(state.out_list[-1]).body)

    response = _run(run())
    response["meta_info"].pop("e2e_latency", None)  # wall-clock time: left out so fixtures are stable
    return body, response


# ------------------------------------------------------------------------------------ errors
def mask_overflow_abort() -> dict[str, Any]:
    """The finish reason SGLang gives a request whose realised support exceeded the cap mid-request."""
    from sglang.srt.layers.logits_processor import SamplingMaskStatus
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.runtime_context import use_context

    with use_context(context("scheduler")):
        return SchedulerBatchResultProcessor.get_sampling_mask_finish_reason(
            None, status=SamplingMaskStatus.OVERFLOW
        ).to_json()


def outside_support_abort() -> dict[str, Any]:
    """The finish reason SGLang gives a request whose sampled token fell outside the captured support."""
    from sglang.srt.layers.logits_processor import SamplingMaskStatus
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.runtime_context import use_context

    with use_context(context("scheduler")):
        return SchedulerBatchResultProcessor.get_sampling_mask_finish_reason(
            None, status=SamplingMaskStatus.INVALID
        ).to_json()


def error_response(finish_reason: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a non-streaming /generate whose request SGLang aborted with this finish
    reason: `_handle_abort_finish_reason` raises ValueError (400) or HTTPException (other codes);
    http_server.py answers `_create_error_response(e)` resp. the HTTPException handler's ErrorResponse."""
    import fastapi
    from sglang.srt.entrypoints.openai.protocol import ErrorResponse
    from sglang.srt.managers import tokenizer_manager as tmm
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.observability.req_time_stats import APIServerReqTimeStats
    from sglang.srt.runtime_context import use_context

    ctx = context("tokenizer")

    async def run() -> tuple[int, dict[str, Any]]:
        with use_context(ctx):
            tm = tokenizer_manager(ctx)
            obj = GenerateReqInput(input_ids=[1], rid="e")
            state = tmm.ReqState([], True, asyncio.Event(), obj, time_stats=APIServerReqTimeStats())
            tm.rid_to_state["e"] = state
            try:
                await tm._handle_abort_finish_reason(
                    {"meta_info": {"finish_reason": finish_reason}}, state, False
                )
            except ValueError as e:  # http_server._create_error_response
                return int(getattr(e, "status_code", 400)), {"error": {"message": str(e)}}
            except fastapi.HTTPException as e:  # http_server's HTTPException handler (non-/v1 paths)
                err = ErrorResponse(
                    object="error", message=e.detail, type=str(e.status_code), code=e.status_code
                )
                return e.status_code, err.model_dump()
            raise AssertionError(f"SGLang did not treat {finish_reason} as an error")

    return _run(run())
