"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Every client mistake is mapped to a 4xx here, so bad input never surfaces as a 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "server_overloaded",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    body = error_body(err.status, err.message, err.param, err.code)
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def _param(loc: tuple[Any, ...]) -> str | None:
    """'messages.0.role' from pydantic's location, without union-member tags like 'list[int]'."""
    tags = {"str", "int", "float", "bool", "list", "dict", "literal"}
    parts: list[str] = []
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        # Union members appear as tags: 'list[int]', 'constrained-str', 'str', 'TextPart'.
        text = str(part)
        if isinstance(part, str) and ("[" in text or "-" in text or text[:1].isupper()):
            break
        if text in tags:
            break
        parts.append(str(part))
    return ".".join(parts) or None


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
    param = _param(tuple(first.get("loc", ())))
    if param is None and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        return "the body must be a JSON object", None
    where = f"'{param}': " if param else ""
    return f"{where}{first.get('msg', 'invalid value')}", param


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, err: APIError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(err.errors()))
        return error_response(APIError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(err.status_code, str(err.detail), headers=err.headers))

    @app.exception_handler(Exception)
    async def _crash(_: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(err).__name__}"))
