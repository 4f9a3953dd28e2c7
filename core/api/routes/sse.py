"""Server-sent events: one ``event:``/``data:`` pair per Responses event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse, StreamingResponse

from loopstack.api.errors import APIError

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from loopstack.api.pipeline import ResponseStream

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def encode_event(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def encode_data(payload: dict[str, Any] | str) -> bytes:
    """A ``data:``-only event (chat completions chunks and the final ``[DONE]``)."""
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


async def sse_stream(events: AsyncIterable[dict[str, Any]]) -> AsyncIterator[bytes]:
    async for event in events:
        yield encode_event(event)


class EventStreamResponse(StreamingResponse):
    """A response's events as SSE, prepared when the ASGI server runs this response: a request
    the preparation refuses gets its JSON error (status and body) before any header is sent,
    and the request context is left however the stream ends (done, client gone, never started).
    """

    def __init__(self, response: ResponseStream) -> None:
        super().__init__(sse_stream(response), media_type="text/event-stream", headers=SSE_HEADERS)
        self.response = response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response.open()
        except APIError as exc:
            await JSONResponse(exc.body(), status_code=exc.status)(scope, receive, send)
            return
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.response.aclose()
