"""SGLang 0.5.23's /generate error shapes, and our client's reading of them.

http_server.py cannot be imported here (its imports need xgrammar): the lines that turn an exception
into a body are read from its source and must still say what sglang_made.error_response builds. The
abort reasons and messages themselves come from SGLang's code (scheduler rule compiled from its source,
SchedulerBatchResultProcessor.get_sampling_mask_finish_reason, TokenizerManager's abort handling)."""

from __future__ import annotations

import ast

import sglang_made as sm
from sglang.srt.entrypoints.api_contract import generate_contract_error
from sglang.srt.entrypoints.openai.protocol import ErrorResponse
from sglang.srt.managers.schedule_batch import FINISH_ABORT

from rlfleet.sampler import protocol as proto


def _functions(relative: str) -> dict[str, str]:
    tree = ast.parse(sm.sglang_source(relative))
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out[node.name] = out.get(node.name, "") + ast.unparse(node)
    return out


def test_http_server_error_bodies_are_the_shapes_we_read() -> None:
    fns = _functions("srt/entrypoints/http_server.py")
    assert (
        "return ORJSONResponse(status_code=400, content={'error': contract_error})" in fns["generate_request"]
    )
    assert "except ValueError as e:" in fns["serve_generate_request"]
    assert "return _create_error_response(e)" in fns["serve_generate_request"]
    assert (
        "return ORJSONResponse({'error': {'message': str(e)}}, status_code=getattr(e, 'status_code', "
        "HTTPStatus.BAD_REQUEST))"
    ) in fns["_create_error_response"]
    handler = fns["validation_exception_handler"]
    assert (
        "error = ErrorResponse(object='error', message=exc.detail, type=str(exc.status_code), code=exc.status_code)"
        in handler
    )
    assert "return ORJSONResponse(content=error.model_dump(), status_code=exc.status_code)" in handler
    # ... and the abort path: 400 -> ValueError, anything else -> HTTPException
    abort = _functions("srt/managers/tokenizer_manager.py")["_handle_abort_finish_reason"]
    assert (
        "if status_code == HTTPStatus.BAD_REQUEST:\n            raise ValueError(finish_reason['message'])"
        in abort
    )
    assert "raise fastapi.HTTPException(status_code=status_code, detail=finish_reason['message'])" in abort


def test_error_message_reads_every_sglang_shape() -> None:
    contract = generate_contract_error({"input_ids": [1], "sampling_params": {"top_k": "x"}})
    assert contract is not None
    assert proto.error_message({"error": contract}) == contract
    status, body = sm.error_response(FINISH_ABORT("input too long", 400).to_json())
    assert status == 400 and proto.error_message(body) == "input too long"
    status, body = sm.error_response(sm.outside_support_abort())
    assert status == 500 and body["object"] == "error" and body["code"] == 500
    assert (
        proto.error_message(body)
        == "The sampling backend selected a token outside its captured sampling support."
    )
    validation = ErrorResponse(message="bad field", type="Bad Request", code=400).model_dump()
    assert proto.error_message(validation) == "bad field"
    assert proto.error_message({"detail": "Not Found"}) == "Not Found"


def test_mask_cap_errors_are_recognised_from_sglangs_own_messages() -> None:
    for cap in (256, 4096):
        message = sm.scheduler_mask_error(cap * 2, cap)
        assert message is not None and proto.mask_cap_error(message) == ("top_k_rejected", cap)
    _, body = sm.error_response(sm.mask_overflow_abort())
    assert proto.mask_cap_error(proto.error_message(body)) == ("support_overflow", 4096)
    _, body = sm.error_response(sm.outside_support_abort())
    assert proto.mask_cap_error(proto.error_message(body)) is None
    assert (
        proto.mask_cap_error("sampling_logprobs_mode can only be set when return_sampling_mask=true.") is None
    )
