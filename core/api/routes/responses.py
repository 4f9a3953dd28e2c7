"""``POST /v1/responses`` (JSON or SSE), ``GET`` and ``DELETE /v1/responses/{id}``."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loopstack.api.errors import not_found
from loopstack.api.pipeline import respond
from loopstack.api.routes.common import (
    arm_overrides,
    handles_errors,
    parse_model,
    principal_of,
    read_json,
    state_of,
)
from loopstack.api.routes.sse import EventStreamResponse
from loopstack.api.schemas import ResponsesRequest

# failures that are the request's content, not the server's fault
_REFUSAL_CODES = {"guard_tripped": 400}


def _status_of(response: dict[str, Any]) -> int:
    if response["status"] != "failed":
        return 200
    return _REFUSAL_CODES.get(str((response.get("error") or {}).get("code")), 500)


@handles_errors
async def create_response(request: Request) -> Response:
    state = state_of(request)
    principal = principal_of(request)
    body = parse_model(ResponsesRequest, await read_json(request, state.max_body_bytes))
    response = respond(state, body, principal, overrides=arm_overrides(request, body.metadata))
    if body.stream:  # prepared when the response starts: an invalid request still gets a JSON error
        return EventStreamResponse(response)
    async with response:
        final = await response.final_response()
    assert final is not None, "the response chain ended without a terminal event"
    return JSONResponse(final, status_code=_status_of(final))


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
