"""``POST /v1/responses`` (JSON or SSE), ``GET`` and ``DELETE /v1/responses/{id}``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from loopstack.context import Session
from loopstack.api.errors import not_found
from loopstack.api.routes.common import (
    arm_overrides,
    handles_errors,
    parse_model,
    principal_of,
    read_json,
    state_of,
)
from loopstack.api.pipeline import ResponseJob, run_response
from loopstack.api.schemas import ResponsesRequest
from loopstack.api.routes.sse import sse_stream

TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def observe(ctx: Any, response: dict[str, Any], elapsed: float) -> None:
    """Per-request metrics, labelled by plugin and arm through the request context."""
    ctx.observe("loopstack_api_response_seconds", elapsed, help="wall time of a response")
    usage = response.get("usage") or {}
    if usage:
        ctx.count("loopstack_api_input_tokens_total", usage["input_tokens"], help="prompt tokens")
        ctx.count("loopstack_api_cached_tokens_total", usage["input_tokens_details"]["cached_tokens"],
                  help="prompt tokens served from the prefix cache")
        ctx.count("loopstack_api_output_tokens_total", usage["output_tokens"], help="generated tokens")
    ctx.count("loopstack_api_responses_total", help="responses by final status", status=response["status"])


# failures that are the request's content, not the server's fault
_REFUSAL_CODES = {"guard_tripped": 400}


def _status_of(response: dict[str, Any]) -> int:
    if response["status"] != "failed":
        return 200
    return _REFUSAL_CODES.get((response.get("error") or {}).get("code"), 500)


@handles_errors
async def create_response(request: Request) -> Response:
    state = state_of(request)
    principal = principal_of(request)
    body = parse_model(ResponsesRequest, await read_json(request, state.max_body_bytes))
    overrides = arm_overrides(request, body.metadata)
    prepared = state.service.prepare(body, principal)
    session = Session(id=body.prompt_cache_key or prepared.response_id, tenant=principal.tenant)
    started = time.perf_counter()
    if not body.stream:
        with state.live.request(session=session, overrides=overrides) as ctx:
            final = None
            async with aclosing(run_response(ResponseJob(state.service, prepared), ctx)) as stream:
                async for event in stream:
                    if event["type"] in TERMINAL:
                        final = event["response"]
            observe(ctx, final, time.perf_counter() - started)
        return JSONResponse(final, status_code=_status_of(final))

    async def events() -> AsyncIterator[dict[str, Any]]:
        with state.live.request(session=session, overrides=overrides) as ctx:
            async with aclosing(run_response(ResponseJob(state.service, prepared), ctx)) as stream:
                async for event in stream:
                    if event["type"] in TERMINAL:
                        observe(ctx, event["response"], time.perf_counter() - started)
                    yield event

    return StreamingResponse(sse_stream(events()), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


@handles_errors
async def get_response(request: Request) -> Response:
    state = state_of(request)
    principal = principal_of(request)
    response_id = request.path_params["response_id"]
    record = state.store.get(response_id, tenant=principal.tenant)
    if record is None:
        raise not_found("response", response_id, param="response_id")
    return JSONResponse(record.response)


@handles_errors
async def delete_response(request: Request) -> Response:
    state = state_of(request)
    principal = principal_of(request)
    response_id = request.path_params["response_id"]
    if not state.store.delete(response_id, tenant=principal.tenant):
        raise not_found("response", response_id, param="response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
