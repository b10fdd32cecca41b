"""The gateway's error types and their OpenAI-shaped HTTP responses, in one place."""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.tokenizer.errors import TokenizerTimeoutError

logger = logging.getLogger(__name__)


class GatewayError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    @property
    def headers(self) -> dict[str, str]:
        """What HTTP asks a response of this status to carry."""
        return {}


class InvalidRequestError(GatewayError):
    status, type = 400, "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    code = "context_length_exceeded"


class UnauthorizedError(GatewayError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"

    def __init__(self, message: str, *, key_given: bool) -> None:
        super().__init__(message)
        self.key_given = key_given

    @property
    def headers(self) -> dict[str, str]:
        # RFC 9110 asks a 401 for its challenge; RFC 6750 words a rejected bearer token.
        return {"WWW-Authenticate": 'Bearer error="invalid_token"' if self.key_given else "Bearer"}


class ModelNotFoundError(GatewayError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class ServiceUnavailableError(GatewayError):
    status, type = 503, "service_unavailable"


class UpstreamTimeoutError(GatewayError):
    """A service the gateway needs took longer than its deadline to answer."""

    status, type = 504, "timeout_error"


class EngineFailedError(GatewayError):
    """The engine failed a request it had accepted."""

    status, type = 502, "engine_error"


class RequestFieldError(ValueError):
    """A request check across fields, raised in validation; `param` is the field to change, and
    `where` the place inside it (`input[2].role`) when the message should name that instead."""

    def __init__(self, param: str, problem: str, *, where: str | None = None) -> None:
        super().__init__(f"{where or param}: {problem}")
        self.param = param


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def tokenizer_failure(error: grpc.aio.AioRpcError | TokenizerTimeoutError) -> GatewayError:
    """A failed tokenizer-service call as the client sees it. Past its deadline it is a 504, not
    a 503: the service is up but hung or overloaded, not unreachable, and the status tells an
    operator which; OpenAI's clients retry both."""
    if isinstance(error, TokenizerTimeoutError):
        logger.warning("%s", error)
        return UpstreamTimeoutError(str(error))
    logger.warning("tokenizer service call failed: %s %s", error.code().name, error.details())
    return ServiceUnavailableError(f"the tokenizer service failed: {error.code().name}")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, error: GatewayError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        media_type = _media_type_not_read_as_json(request)
        if (media_type is not None and first.get("type") != "missing"
                and tuple(first.get("loc", ()))[:1] == ("body",)):
            # FastAPI left the body unparsed, so its field errors would blame a body that may
            # be valid JSON; the Content-Type is what the client must change.
            return JSONResponse(error_body(
                "Unsupported Media Type: send the body as JSON with `Content-Type: "
                f"application/json` (got {media_type or 'none'})", "invalid_request_error"),
                status_code=415)
        if first.get("type") == "json_invalid":
            # Its location is a character offset, not a field.
            detail = first.get("ctx", {}).get("error", "")
            return JSONResponse(error_body(f"body: invalid JSON: {detail}".rstrip(": "),
                                           "invalid_request_error"), status_code=400)
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, RequestFieldError):
            return JSONResponse(error_body(str(cause), "invalid_request_error", cause.param),
                                status_code=400)
        location = field_path(first.get("loc", ()))
        param = ".".join(str(part) for part in location)
        if not location and first.get("type") == "missing":
            # No body, or `null`: "Field required" would not say which.
            message = "body: a JSON object is required"
        else:
            message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        return JSONResponse(error_body(message, "invalid_request_error", param or None), status_code=400)

    @app.exception_handler(grpc.aio.AioRpcError)
    @app.exception_handler(TokenizerTimeoutError)
    async def tokenizer_call_error(request: Request,
                                   error: grpc.aio.AioRpcError | TokenizerTimeoutError) -> JSONResponse:
        # Engine calls handle their own failures (retry, then 503); a gRPC error that reaches
        # here is the tokenizer service's, and a 503 or 504, not an unexpected 500.
        failure = tokenizer_failure(error)
        return JSONResponse(failure.body(), status_code=failure.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        # The exception's headers carry what HTTP asks of the status (a 405's `Allow`).
        message = _unreadable_body_problem(error.__cause__) or str(error.detail)
        return JSONResponse(error_body(message, "invalid_request_error"),
                            status_code=error.status_code, headers=error.headers)


class UnexpectedErrorMiddleware:
    """Answers an error no handler knows with an OpenAI-shaped 500.

    Starlette sends a handler for `Exception` from its outermost middleware, past CORS, so a
    page could not read the 500, and it re-raises, which closes the client's connection. Added
    inside CORS, this answers first. Once a response has begun, there is nothing to answer
    with: the error goes on up and the server ends the connection.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        response_started = False

        async def send_noting_start(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception:
            if response_started:
                raise
            logger.exception("request failed: %s %s", scope["method"], scope["path"])
            body = json.dumps(error_body("internal server error", "internal_error")).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


def _unreadable_body_problem(cause: BaseException | None) -> str | None:
    """What FastAPI's "There was an error parsing the body" stands for, when the cause is known:
    it answers so for a body that fails to decode before JSON parsing can blame an offset."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"body: invalid JSON: not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} "
                f"at offset {cause.start})")
    if isinstance(cause, RecursionError):
        return "body: invalid JSON: arrays and objects are nested too deeply"
    return None


# The names pydantic gives union members in an error's location (`str` of `str | list[str]`,
# `list[str]`, a model's class name): not fields the client wrote.
_UNION_MEMBER_NAMES = frozenset({"str", "int", "float", "bool", "bytes", "none"})


def field_path(location: tuple[int | str, ...] | list[int | str]) -> list[int | str]:
    """A validation error's location as the client's fields: without the leading `body` (or
    `query`, for a query parameter) and the names of union members tried."""
    parts = list(location)[1:] if location and location[0] in ("body", "query") else list(location)
    return [part for part in parts if isinstance(part, int) or not (
        part[:1].isupper() or "[" in part or part in _UNION_MEMBER_NAMES)]


def _media_type_not_read_as_json(request: Request) -> str | None:
    """The request's media type ("" when it names none) when FastAPI does not read its body as
    JSON: it reads only `application/json` and `application/*+json`."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    main_type, _, subtype = media_type.partition("/")
    if main_type == "application" and (subtype == "json" or subtype.endswith("+json")):
        return None
    return media_type
