"""WebSocket mode at ``/v1/responses``: many responses, one connection.

The client sends ``{"type": "response.create", ...request fields...}`` (the fields may
also sit under ``"response"``) and receives the same events as over SSE, as JSON text
messages. Responses run one after another; ``previous_response_id`` chains them, and
with ``store: false`` a chain lives on this connection only. ``{"type": "response.append",
"previous_response_id": ..., "input": [...]}`` continues a chain with only the new items
(:mod:`.ws_append`); a plugin that keeps the chains' token ids may then tokenize only those
items (``loopstack_prompt_ids``). A malformed message gets an ``error`` event and the
connection stays usable; binary frames close it with 1003.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from loopstack.api.auth import AuthError, Principal
from loopstack.api.errors import APIError, from_validation_error
from loopstack.api.ids import new_id
from loopstack.api.pipeline import ResponseStream, respond
from loopstack.api.routes.ws_append import append_request_fields
from loopstack.api.schemas import ResponsesRequest
from loopstack.api.state import ServerState
from loopstack.api.store import ResponseStore, StoredResponse

UNSUPPORTED_DATA = 1003
POLICY_VIOLATION = 1008


def _error_event(exc: APIError) -> dict[str, Any]:
    return {"type": "error", "status": exc.status, **exc.body()}


def _parse(message: dict[str, Any], store: ResponseStore, principal: Principal,
           local: dict[str, StoredResponse]) -> ResponsesRequest:
    if message.get("type") == "response.append":
        fields = append_request_fields(message, store, principal, local)
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


def record_call(response: ResponseStream, *, bytes_received: int, bytes_sent: int) -> None:
    """Per-call metrics of a WebSocket response, for every arm: bytes each way, tokens tokenized."""
    ctx, prepared = response.ctx, response.prepared
    # a plugin that supplied the prompt counts what it tokenized; else prepare tokenized it all
    tokenized = prepared.prompt.num_tokenized if prepared.prompt is not None else len(prepared.prompt_ids)
    ctx.observe("loopstack_api_ws_bytes_received", bytes_received, help="bytes of one response.create/append message")
    ctx.observe("loopstack_api_ws_bytes_sent", bytes_sent, help="bytes of the events of one response")
    ctx.observe("loopstack_api_tokens_tokenized", tokenized, help="tokens tokenized for one response (prompt + output)")


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
                request = _parse(message, state.store, principal, local)
            except APIError as exc:
                await websocket.send_text(json.dumps(_error_event(exc)))
                continue
            response = respond(state, request, principal, local=local,
                               session_id=request.prompt_cache_key or new_id("sess"))
            try:
                await response.open()
            except APIError as exc:
                await websocket.send_text(json.dumps(_error_event(exc)))
                continue
            async with response:
                num_sent = 0
                async for event in response:
                    payload = json.dumps(event, separators=(",", ":"))
                    num_sent += len(payload)  # ASCII: json.dumps escapes the rest
                    await websocket.send_text(payload)
                record_call(response, bytes_received=len(text), bytes_sent=num_sent)
    except WebSocketDisconnect:
        return
