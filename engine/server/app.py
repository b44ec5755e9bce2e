"""The FastAPI application: OpenAI routes, /health, /metrics, and errors as OpenAI's error JSON.

Whatever a client sends is answered with a 2xx or a 4xx: validation failures (pydantic, bad JSON)
become 400 ``invalid_request_error``; 5xx is kept for the server's own faults (a failed engine
step: 500; a dead or stalled engine: 503).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.server.async_engine import AsyncEngine
from engine.server.metrics import ServerMetrics
from engine.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
)
from engine.server.serving import OpenAIServing

log = logging.getLogger("cuteinfer.server")

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request"},
    500: {"model": ErrorResponse, "description": "the engine step serving it failed"},
    503: {"model": ErrorResponse, "description": "the engine is dead or shutting down"},
}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts = []
    param = None
    for err in exc.errors()[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or where or None
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request", param


def build_app(engine: AsyncEngine, served_model_name: str,
              metrics: ServerMetrics | None = None) -> FastAPI:
    app = FastAPI(title="cuteinfer", summary="OpenAI-compatible LLM inference server",
                  version="0.1.0")
    serving = OpenAIServing(engine, served_model_name)
    created = int(time.time())
    app.state.engine = engine
    app.state.metrics = metrics

    def error(e: APIError) -> JSONResponse:
        if metrics is not None and e.status in (400, 503):
            metrics.refused(e.status)
        return JSONResponse(e.body(), status_code=e.status)

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
        return JSONResponse(APIError(str(exc.detail), exc.status_code, type=kind).body(),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(APIError(f"internal error: {type(exc).__name__}: {exc}", 500,
                                     type="server_error", code="internal_error").body(),
                            status_code=500)

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI text completion; ``stream: true`` for server-sent events."""
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completion with the checkpoint's chat template."""
        return await serving.chat(body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": created,
            "owned_by": "cuteinfer", "root": str(engine.engine.model_dir),
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
