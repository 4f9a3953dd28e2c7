"""The ASGI application: routes over a :class:`ServerState`."""

from __future__ import annotations

import asyncio
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute

from loopstack.api.errors import APIError
from loopstack.api.kv_gauges import render_kv_cache_metrics
from loopstack.api.routes.chat_completions import chat_completions
from loopstack.api.routes.common import error_response, handles_errors, principal_of, state_of
from loopstack.api.routes.responses import create_response, delete_response, get_response
from loopstack.api.routes.websocket import responses_websocket
from loopstack.api.state import ServerState


@handles_errors
async def list_models(request: Request) -> Response:
    principal_of(request)
    state = state_of(request)
    return JSONResponse({"object": "list", "data": [
        {"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "loopstack"}]})


async def healthz(request: Request) -> Response:
    state = state_of(request)
    return JSONResponse({"status": "ok", "stack": state.live.current.stack.name, "model": state.model_name})


@handles_errors
async def metrics(request: Request) -> Response:
    state = state_of(request)
    text = (state.live.metrics.render_prometheus() + await engine_gauges(state.engine)
            + await render_kv_cache_metrics(state.engine))
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def engine_gauges(engine: object) -> str:
    """Gauges the engine offers now (a disaggregated router: its workers and hand-offs), as text."""
    view = getattr(engine, "disaggregation", None)
    if view is None:
        return ""
    from loopstack.inference.disaggregated import render_gauges

    gauges = await asyncio.wrap_future(engine.loop.submit(view.gauges()))  # type: ignore[attr-defined]
    return render_gauges(gauges)


@handles_errors
async def metrics_json(request: Request) -> Response:
    return JSONResponse(state_of(request).live.metrics.snapshot())


@handles_errors
async def admin_reload(request: Request) -> Response:
    principal_of(request)
    result = state_of(request).reload()
    body = {"ok": result.ok, "stack": result.stack_name, "error": result.error,
            "issues": [str(issue) for issue in result.issues]}
    return JSONResponse(body, status_code=200 if result.ok else 400)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else "http_error"
    return error_response(APIError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code,
                                   code=kind))


def create_app(state: ServerState) -> Starlette:
    routes = [
        Route("/v1/responses", create_response, methods=["POST"]),
        WebSocketRoute("/v1/responses", responses_websocket),
        Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/metrics.json", metrics_json, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/admin/reload", admin_reload, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.state.loopstack = state
    return app
