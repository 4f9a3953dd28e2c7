"""Server-sent events: one ``event:``/``data:`` pair per Responses event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any


def encode_event(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def encode_data(payload: dict[str, Any] | str) -> bytes:
    """A ``data:``-only event (chat completions chunks and the final ``[DONE]``)."""
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


async def sse_stream(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async for event in events:
        yield encode_event(event)
