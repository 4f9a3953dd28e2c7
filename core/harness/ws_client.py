"""A Responses API client over one WebSocket (``ws(s)://host/v1/responses``).

Each :meth:`create` sends one ``{"type": "response.create", ...}`` message and reads
events until the response completes; the connection is opened lazily on the first call
and reused for every later one (loopstack's server and OpenAI's WebSocket mode run the
responses of one connection one after another). A dropped connection is reopened on the
next call. This client always sends the full request: sending only the new items with
``previous_response_id`` is the ``ws_deltas`` technique, built on top of this client.

Example::

    async with ResponsesWebSocketClient("ws://127.0.0.1:8321/v1") as client:
        response = await client.create({"input": "Hi", "max_output_tokens": 16}, ctx)
"""

from __future__ import annotations

import json
import ssl
from typing import TYPE_CHECKING, Any, NamedTuple, Self

import anyio
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from .model_client import ModelClientError, TextCallback, serialize_request

if TYPE_CHECKING:
    from ..context import RequestContext

__all__ = ["ResponsesWebSocketClient", "ResponsesWebSocketStatistics"]

_FINAL_EVENT_TYPES = ("response.completed", "response.incomplete")


def _create_message(body: bytes) -> bytes:
    # the serialized body (a JSON object) with "type" put first: the bytes a plugin
    # serialized (byte-stable prefix) go out unchanged after it
    rest = body.strip()[1:].lstrip()
    if not body.strip().startswith(b"{"):
        raise ValueError("a serialized Responses request must be a JSON object")
    return b'{"type":"response.create"' + (b"}" if rest == b"}" else b"," + rest)


class ResponsesWebSocketStatistics(NamedTuple):
    num_requests: int
    num_errors: int
    bytes_sent: int
    bytes_received: int
    connection_setups: int


class ResponsesWebSocketClient:
    """Responses API over one kept-open WebSocket.

    Args:
        base_url: the API root, ``ws://host:port/v1`` (``http(s)://`` is accepted and
            mapped to ``ws(s)://``); messages go to ``{base_url}/responses``.
        api_key: sent as ``Authorization: Bearer`` in the upgrade request.
        timeout_s: limit on one response (from send to its final event); None disables it.
        ssl_context: for ``wss://`` with a private CA (tests, loopback TLS).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float | None = 120,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        url = base_url.rstrip("/")
        for http, ws in (("http://", "ws://"), ("https://", "wss://")):
            if url.startswith(http):
                url = ws + url[len(http):]
        if not url.startswith(("ws://", "wss://")):
            raise ValueError(f"base_url must start with ws://, wss://, http:// or https://, got {base_url!r}")
        self.url = url + "/responses"
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout_s = timeout_s
        self._ssl = ssl_context
        self._connection: ClientConnection | None = None
        self._lock = anyio.Lock()  # one response at a time per connection
        self._num_requests = self._num_errors = self._bytes_sent = self._bytes_received = self._setups = 0

    async def _connect(self) -> ClientConnection:
        if self._connection is None:
            try:
                self._connection = await connect(
                    self.url, additional_headers=self._headers, ssl=self._ssl if self.url.startswith("wss") else None,
                    max_size=None,
                )
            except InvalidStatus as exc:
                raise ModelClientError(exc.response.status_code, f"WebSocket upgrade refused by {self.url}") from None
            self._setups += 1
        return self._connection

    async def create(
        self, request: dict[str, Any], ctx: RequestContext, *, on_text_delta: TextCallback | None = None
    ) -> dict[str, Any]:
        """Send ``request`` as ``response.create`` and return the final response.

        Raises:
            ModelClientError: an ``error`` or ``response.failed`` event, a refused upgrade, or
                a connection closed before the final event (the next call reconnects).
            TimeoutError: no final event within ``timeout_s``.
        """
        message = _create_message(serialize_request(request, ctx))
        async with self._lock:
            self._num_requests += 1
            try:
                with anyio.fail_after(self._timeout_s):
                    return await self._exchange(message.decode(), on_text_delta)
            except (ModelClientError, TimeoutError):
                self._num_errors += 1
                raise

    async def _exchange(self, message: str, on_text_delta: TextCallback | None) -> dict[str, Any]:
        connection = await self._connect()
        try:
            await connection.send(message)
            self._bytes_sent += len(message.encode())
            async for raw in connection:
                self._bytes_received += len(raw)
                event = json.loads(raw)
                kind = event.get("type")
                if kind == "response.output_text.delta" and on_text_delta is not None:
                    on_text_delta(event.get("delta", ""))
                elif kind in _FINAL_EVENT_TYPES:
                    return event["response"]
                elif kind == "response.failed":
                    error = event["response"].get("error") or {}
                    raise ModelClientError(500, str(error.get("message")), error.get("code"))
                elif kind == "error":
                    error = event.get("error") or {}
                    raise ModelClientError(int(event.get("status") or 400), str(error.get("message")), error.get("code"))
        except ConnectionClosed as exc:
            await self._drop()
            raise ModelClientError(503, f"the WebSocket closed before the response finished: {exc}") from None
        await self._drop()
        raise ModelClientError(503, "the WebSocket closed before the response finished")

    async def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()

    async def aclose(self) -> None:
        await self._drop()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def statistics(self) -> ResponsesWebSocketStatistics:
        return ResponsesWebSocketStatistics(
            self._num_requests, self._num_errors, self._bytes_sent, self._bytes_received, self._setups
        )
