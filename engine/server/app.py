"""The FastAPI application: OpenAI routes, vLLM's /tokenize, /detokenize, /version and /ping,
/health, /metrics, and errors as OpenAI's error JSON.

Whatever a client sends is answered with a 2xx or a 4xx: validation failures (pydantic, bad JSON)
become 400 ``invalid_request_error``; a body over ``--max-request-bytes`` is refused with 413 by
an ASGI middleware before anything parses it; 5xx is kept for the server's own faults (a failed
engine step: 500; a dead or stalled engine: 503; a bug: 500 with an opaque error id, the details
logged under it). With API keys, a request without an accepted one gets 401 before anything else
(engine/server/auth.py).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine import __version__, tracepoints
from engine.server.async_engine import AsyncEngine
from engine.server.auth import OPEN_PATHS, APIKeyAuth, APIKeys
from engine.server.metrics import ServerMetrics
from engine.server.protocol import (
    INVALID_TEXT,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)
from engine.server.serving import OpenAIServing

log = logging.getLogger("cuteinfer.server")

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request"},
    401: {"model": ErrorResponse, "description": "no or a wrong API key (with --api-key)"},
    413: {"model": ErrorResponse, "description": "the body is over --max-request-bytes"},
    500: {"model": ErrorResponse, "description": "the engine step serving it failed"},
    503: {"model": ErrorResponse, "description": "the engine is dead or shutting down"},
}


class _JSONRequest(Request):
    """A request whose JSON body msgspec decodes (4x faster than ``json.loads`` on a body of
    3,000 token ids: 0.11 vs 0.42 ms on the dev box, per request on the event loop). Anything
    msgspec refuses (invalid JSON, NaN literals, integers past 64 bits) goes to ``json.loads``,
    so the accepted bodies and FastAPI's error for invalid JSON stay the standard library's."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = msgspec.json.decode(body)
            except (msgspec.DecodeError, ValueError, TypeError):
                self._json = json.loads(body)
        return self._json


class _JSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(_JSONRequest(request.scope, request.receive))

        return handle


def _error_json(body: dict[str, Any]) -> bytes:
    # ASCII escapes: an error may quote client text, and must render whatever that text is
    return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode()


class ErrorJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return _error_json(content)


class BodyLimit:
    """Pure ASGI middleware: a request body over ``limit`` bytes is answered 413 (OpenAI's error
    JSON) before the app sees any of it: at once when Content-Length says so, else (chunked) as
    soon as the bytes received pass the limit. The body is read here, counted, then replayed to
    the app in one piece (which reads it whole anyway); the rest of a refused body is discarded
    by the HTTP server as it arrives, so nothing past the limit is ever held."""

    def __init__(self, app: ASGIApp, limit: int,
                 on_refuse: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.limit = limit
        self.on_refuse = on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if tracepoints.mark is not None:
            tracepoints.mark("http", scope.get("path", ""))
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            await self._refuse(send, f"the request body is {declared} bytes, over")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._refuse(send, "the request body is over")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: bytes | None = b"".join(chunks)
        del chunks  # not held while the app runs

        async def replay() -> Message:
            nonlocal body
            if body is None:
                return await receive()  # http.disconnect, for the handlers that watch for it
            whole: Message = {"type": "http.request", "body": body, "more_body": False}
            body = None
            return whole

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, what: str) -> None:
        if self.on_refuse is not None:
            self.on_refuse(413)
        e = APIError(f"{what} this server's limit of {self.limit} bytes: send a smaller request, "
                     "or start the server with a larger --max-request-bytes", 413,
                     code="request_too_large")
        content = _error_json(e.body())
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(content)).encode())]})
        await send({"type": "http.response.body", "body": content})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses it before the app runs
    return None


def _is_union_tag(x: object) -> bool:
    # pydantic names the member of a union in the error location ("str", "list[int]",
    # "function-after[_text(), str]"): not a field a client wrote
    return isinstance(x, str) and (not x.isidentifier() or x in ("str", "int", "float", "bool"))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One message and the ``param`` for pydantic's errors: union members left out of the
    location, and of a union's errors only those about the value (too long, invalid text) when
    some are, not "should be a valid list" from the members that did not match its type."""
    errors = []
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_union_tag(x)]
        kind = str(err.get("type", ""))
        msg = INVALID_TEXT if kind in ("invalid_text", "string_unicode") else str(err.get("msg"))
        errors.append((".".join(loc), kind.endswith("_type"), msg))
    about_value = {where.split(".")[0] for where, is_type, _ in errors if not is_type}
    parts: list[str] = []
    param = None
    for where, is_type, msg in errors:
        if is_type and where.split(".")[0] in about_value:
            continue
        part = f"{where}: {msg}" if where else msg
        if part not in parts:
            parts.append(part)
            param = param or where or None
    return "; ".join(parts[:5]) or "invalid request", param


def build_app(engine: AsyncEngine, served_model_name: str,
              metrics: ServerMetrics | None = None, *,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              api_keys: list[str] | None = None, metrics_require_key: bool = False,
              cache_isolation: bool = True, tool_call_parser: str = "auto") -> FastAPI:
    """``max_request_bytes``: the largest request body accepted (``--max-request-bytes``);
    ``api_keys``: the keys accepted (none: no auth); ``metrics_require_key``: /metrics needs one
    too; ``cache_isolation``: a prefix-cache namespace per key; ``tool_call_parser``: the
    tool-call format (``--tool-call-parser``)."""
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) \
            or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be a positive number of bytes, got "
                         f"{max_request_bytes!r}: set --max-request-bytes to, e.g., "
                         f"{DEFAULT_MAX_REQUEST_BYTES}")
    app = FastAPI(title="cuteinfer", summary="OpenAI-compatible LLM inference server",
                  version=__version__)
    app.router.route_class = _JSONRoute  # (before the routes are added)
    serving = OpenAIServing(engine, served_model_name, tool_call_parser)
    created = int(time.time())
    app.state.engine = engine
    app.state.metrics = metrics
    on_refuse = None if metrics is None else metrics.refused
    app.add_middleware(BodyLimit, limit=max_request_bytes, on_refuse=on_refuse)
    if api_keys:  # added last: outermost, so a stranger's body is never read
        open_paths = OPEN_PATHS if metrics_require_key else OPEN_PATHS | {"/metrics"}
        app.add_middleware(APIKeyAuth, keys=APIKeys(api_keys, cache_isolation),
                           open_paths=open_paths, on_refuse=on_refuse)

    def error(e: APIError) -> JSONResponse:
        if metrics is not None and e.status in (400, 503):
            metrics.refused(e.status)
        return ErrorJSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return error(APIError(msg, 400, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
        return ErrorJSONResponse(APIError(str(exc.detail), exc.status_code, type=kind).body(),
                                 status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # the client gets an id to quote, never the exception (paths, internals): the log has it
        error_id = f"err-{uuid.uuid4().hex[:16]}"
        log.exception("internal error %s in %s %s", error_id, request.method, request.url.path)
        return ErrorJSONResponse(APIError(
            f"internal server error (error id {error_id}); the server log has the details under "
            "this id", 500, type="server_error", code="internal_error").body(), status_code=500)

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI text completion; ``stream: true`` for server-sent events."""
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completion with the checkpoint's chat template."""
        return await serving.chat(body, request)

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's: a prompt, or chat messages through the chat template, -> token ids."""
        return await serving.tokenize(body)

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's: token ids -> text."""
        return await serving.detokenize(body)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    def pong() -> Response:
        return Response(status_code=200 if engine.health()[0] else 503)

    @app.get("/ping", responses={503: {"description": "the engine is dead or stalled"}})
    async def ping() -> Response:
        """As /health (SageMaker's name for it), with an empty body."""
        return pong()

    @app.post("/ping", responses={503: {"description": "the engine is dead or stalled"}})
    async def ping_post() -> Response:
        """As GET /ping."""
        return pong()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": created,
            "owned_by": "cuteinfer", "root": served_model_name,
            "max_model_len": serving.max_model_len}]}

    @app.get("/health", responses={503: {"description": "the engine is dead or stalled"}})
    async def health() -> JSONResponse:
        """200 while the engine loop is alive and making progress; 503 otherwise."""
        ok, reason = engine.health()
        return JSONResponse({"status": "ok" if ok else "unhealthy", "reason": reason},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if metrics is None:
            return Response("metrics are disabled\n", status_code=404)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        # Bad input is answered 400 (OpenAI's convention), never FastAPI's default 422.
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
