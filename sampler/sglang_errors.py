"""SGLang 0.5.23's error bodies, stage by stage (srt/entrypoints/http_server.py), as the reference server
answers a refused request: a body FastAPI cannot parse -> 400 ErrorResponse {object: "error", message,
type: "Bad Request", param, code}; a body the JSON contract gate refuses -> 400 {"error": "<text>"}; a
ValueError of normalisation, SamplingParams.verify, the tokenizer manager or a 400 scheduler abort ->
400 {"error": {"message"}}; a 500 abort -> 500 ErrorResponse with type "500"."""

from __future__ import annotations

from typing import Any

from aiohttp import web


class RequestError(Exception):
    """A refused request: `body` and `status` exactly as SGLang answers it."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(str(body))
        self.status, self.body = status, body

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return web.json_response(self.body, status=self.status, headers=headers)


def value_error(message: str, status: int = 400) -> RequestError:
    """A ValueError (or a 400 abort) caught by /generate: `_create_error_response`."""
    return RequestError(status, {"error": {"message": message}})


def error_response(status: int, message: str, type_: str | None = None) -> RequestError:
    """SGLang's ErrorResponse (protocol.py), as its HTTPException / RequestValidationError handlers
    send it: type is str(status) for an HTTPException, the status phrase for a validation error."""
    return RequestError(
        status,
        {"object": "error", "message": message, "type": type_ or str(status), "param": None, "code": status},
    )


def contract_error(message: str) -> RequestError:
    return RequestError(400, {"error": message})


def error_json(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return value_error(message, status).response(headers)
