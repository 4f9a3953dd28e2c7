"""WebSocket mode at ``/v1/responses``: many responses, one connection.

The client sends ``{"type": "response.create", ...request fields...}`` (the fields may
also sit under ``"response"``) and receives the same events as over SSE, as JSON text
messages. Responses run one after another; ``previous_response_id`` chains them, and
with ``store: false`` a chain lives on this connection only. ``{"type": "response.append",
"previous_response_id": ..., "input": [...]}`` continues a chain with only the new items
(:mod:`.ws_append`); where a plugin keeps the chains' token state (``ws_deltas``), such a
request tokenizes only those items (:mod:`.chain_prompt`). A malformed message gets an
``error`` event and the connection stays usable; binary frames close it with 1003.
"""

from __future__ import annotations

import json
import time
from contextlib import aclosing
from typing import Any

from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from loopstack.context import Session
from loopstack.api.auth import AuthError, Principal
from loopstack.plugins.ws_deltas.chain_prompt import chain_prompts, record_ws_call
from loopstack.api.errors import APIError, from_validation_error
from loopstack.api.routes.responses import TERMINAL, observe
from loopstack.api.ids import new_id
from loopstack.api.pipeline import ResponseJob, run_response
from loopstack.api.schemas import ResponsesRequest
from loopstack.api.service import ResponsesService
from loopstack.api.state import ServerState
from loopstack.api.store import StoredResponse
from loopstack.api.routes.ws_append import append_request_fields

UNSUPPORTED_DATA = 1003
POLICY_VIOLATION = 1008


def _error_event(exc: APIError) -> dict[str, Any]:
    return {"type": "error", "status": exc.status, **exc.body()}


def _parse(message: dict[str, Any], service: ResponsesService, principal: Principal,
           local: dict[str, StoredResponse]) -> ResponsesRequest:
    if message.get("type") == "response.append":
        fields = append_request_fields(message, service, principal, local)
    elif message.get("type") == "response.create":
        fields = message.get("response", {k: v for k, v in message.items() if k != "type"})
    else:
        raise APIError(f"unknown message type {message.get('type')!r}; expected 'response.create' or "
                       "'response.append'", param="type", code="invalid_message")
    if not isinstance(fields, dict):
        raise APIError("'response' must be an object", param="response", code="invalid_message")
    try:
        return ResponsesRequest.model_validate({**fields, "stream": True})
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def responses_websocket(websocket: WebSocket) -> None:
    state: ServerState = websocket.app.state.loopstack
    try:
        principal = state.keyring.authenticate(websocket.headers.get("authorization"))
    except AuthError:
        await websocket.close(code=POLICY_VIOLATION, reason="invalid or missing API key")
        return
    await websocket.accept()
    local: dict[str, StoredResponse] = {}  # store=false chains of this connection
    try:
        while True:
            raw = await websocket.receive()
            if raw["type"] == "websocket.disconnect":
                return
            if raw.get("bytes") is not None:
                await websocket.close(code=UNSUPPORTED_DATA, reason="send JSON text messages")
                return
            try:
                text = raw.get("text") or ""
                if len(text) > state.max_body_bytes:
                    raise APIError(f"message exceeds {state.max_body_bytes} bytes", status=413, code="body_too_large")
                try:
                    message = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise APIError(f"message is not valid JSON: {exc}", code="invalid_json") from None
                if not isinstance(message, dict):
                    raise APIError("message must be a JSON object", code="invalid_json")
                request = _parse(message, state.service, principal, local)
            except APIError as exc:
                await websocket.send_text(json.dumps(_error_event(exc)))
                continue
            session = Session(id=request.prompt_cache_key or new_id("sess"), tenant=principal.tenant)
            started = time.perf_counter()
            with state.live.request(session=session) as ctx:
                try:  # the context first: whether the chain token state serves it depends on the arms
                    prepared = state.service.prepare(request, principal, local, prompts=chain_prompts(ctx))
                except APIError as exc:
                    await websocket.send_text(json.dumps(_error_event(exc)))
                    continue
                num_sent = 0
                async with aclosing(run_response(ResponseJob(state.service, prepared, local), ctx)) as stream:
                    async for event in stream:
                        if event["type"] in TERMINAL:
                            observe(ctx, event["response"], time.perf_counter() - started)
                        payload = json.dumps(event, separators=(",", ":"))
                        num_sent += len(payload)  # ASCII: json.dumps escapes the rest
                        await websocket.send_text(payload)
                record_ws_call(ctx, prepared, bytes_received=len(text), bytes_sent=num_sent)
    except WebSocketDisconnect:
        return
