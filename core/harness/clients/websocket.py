"""A Responses API client over one WebSocket (``ws(s)://host/v1/responses``).

Each :meth:`create` sends one ``{"type": "response.create", ...}`` message and reads
events until the response completes; the connection is opened lazily on the first call
and reused for every later one (loopstack's server and OpenAI's WebSocket mode run the
responses of one connection one after another). This client always sends the full
request: sending only the new items with ``previous_response_id`` is the ``ws_deltas``
technique, built on :meth:`ResponsesWebSocketClient.exchange`.

Connection management, every limit a keyword option where ``None`` disables it:

* keepalive pings (``ping_interval_s``, ``ping_timeout_s``);
* a first-event timeout: a response whose first event does not come in time drops the
  connection (:class:`FirstEventTimeoutError`);
* reconnect with exponential backoff when opening the connection fails (refused, reset,
  timed out), before anything is sent, so retrying is always safe;
* a connection age limit: an older connection is closed and a new one opened before the
  next message (never in the middle of a response);
* errors by condition: :class:`WebSocketRefusedError` (the server answered the upgrade
  with an HTTP status: use HTTP instead), :class:`ConnectionLostError` (closed before the
  final event; the next call reconnects).

Example::

    async with ResponsesWebSocketClient("ws://127.0.0.1:8321/v1") as client:
        response = await client.create({"input": "Hi", "max_output_tokens": 16}, ctx)
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Self

import anyio
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from loopstack.harness.clients.base import (
    ModelClientError,
    ServerEndpoint,
    TextCallback,
    TransportCache,
    dispatch,
    observe_call_bytes,
    record_request_bytes,
    serialize_request,
)
from loopstack.harness.clients.stream import ResponseStreamReader

if TYPE_CHECKING:
    from loopstack.context import RequestContext

__all__ = [
    "ConnectionLostError",
    "FirstEventTimeoutError",
    "ResponsesWebSocketClient",
    "ResponsesWebSocketStatistics",
    "WebSocketRefusedError",
    "create_message",
    "websocket_url",
]


class WebSocketRefusedError(ModelClientError):
    """The server answered the WebSocket upgrade with an HTTP status (it does not speak it there)."""


class ConnectionLostError(ModelClientError):
    """The connection closed, or could not be opened, before the response's final event."""


class FirstEventTimeoutError(ModelClientError):
    """No event came within the first-event timeout after a message was sent."""


def create_message(body: bytes) -> bytes:
    """A ``response.create`` message from a serialized Responses request body."""
    # the serialized body (a JSON object) with "type" put first: the bytes a plugin
    # serialized (byte-stable prefix) go out unchanged after it
    rest = body.strip()[1:].lstrip()
    if not body.strip().startswith(b"{"):
        raise ValueError("a serialized Responses request must be a JSON object")
    return b'{"type":"response.create"' + (b"}" if rest == b"}" else b"," + rest)


def websocket_url(base_url: str) -> str:
    """``{base_url}/responses`` with ``http(s)://`` mapped to ``ws(s)://``.

    Raises:
        ValueError: another scheme.
    """
    url = base_url.rstrip("/")
    for http, ws in (("http://", "ws://"), ("https://", "wss://")):
        if url.startswith(http):
            url = ws + url[len(http):]
    if not url.startswith(("ws://", "wss://")):
        raise ValueError(f"base_url must start with ws://, wss://, http:// or https://, got {base_url!r}")
    return url + "/responses"


class ResponsesWebSocketStatistics(NamedTuple):
    num_requests: int
    num_errors: int
    bytes_sent: int
    bytes_received: int
    connection_setups: int
    num_rotations: int = 0
    num_reconnect_attempts: int = 0


class ResponsesWebSocketClient:
    """Responses API over one kept-open WebSocket.

    Args:
        base_url: the API root, ``ws://host:port/v1`` (``http(s)://`` is accepted and
            mapped to ``ws(s)://``); messages go to ``{base_url}/responses``.
        api_key: sent as ``Authorization: Bearer`` in the upgrade request.
        timeout_s: limit on one response (from send to its final event).
        ssl_context: for ``wss://`` with a private CA (tests, loopback TLS).
        ping_interval_s, ping_timeout_s: keepalive pings; a missed pong closes the connection.
        first_event_timeout_s: limit on the wait for a response's first event.
        max_connection_age_s: open a new connection for the next message past this age.
        max_reconnects: further attempts when opening the connection fails.
        backoff_s, max_backoff_s: the wait before the first retry, doubled up to the cap.
        open_timeout_s: limit on opening one connection (TCP, TLS, upgrade).
        clock: monotonic seconds (tests).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float | None = 120,
        ssl_context: ssl.SSLContext | None = None,
        ping_interval_s: float | None = 20.0,
        ping_timeout_s: float | None = 20.0,
        first_event_timeout_s: float | None = None,
        max_connection_age_s: float | None = None,
        max_reconnects: int = 0,
        backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        open_timeout_s: float | None = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = websocket_url(base_url)
        http_root = base_url.rstrip("/").replace("ws://", "http://", 1).replace("wss://", "https://", 1)
        self.endpoint = ServerEndpoint(http_root, api_key, ssl_context)
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout_s = timeout_s
        self._ssl = ssl_context
        self._ping = (ping_interval_s, ping_timeout_s)
        self._first_event_timeout_s = first_event_timeout_s
        self._max_age_s = max_connection_age_s
        self._max_reconnects = max_reconnects
        self._backoff = (backoff_s, max_backoff_s)
        self._open_timeout_s = open_timeout_s
        self._clock = clock
        self._connection: ClientConnection | None = None
        self._opened_at = 0.0
        self._lock = anyio.Lock()  # one response at a time per connection
        self.transports = TransportCache()  # what a loopstack_client_transport plugin gave; closed by aclose
        self._num_requests = self._num_errors = self._bytes_sent = self._bytes_received = self._setups = 0
        self._rotations = self._reconnect_attempts = 0

    @property
    def connection_generation(self) -> int:
        """Connections opened so far: a change means the server lost this connection's
        ``store: false`` responses."""
        return self._setups

    @property
    def is_connected(self) -> bool:
        return self._connection is not None

    @property
    def latency(self) -> float | None:
        """The connection's last keepalive round trip in seconds (0 before the first pong);
        None when not connected."""
        return self._connection.latency if self._connection is not None else None

    async def create(
        self, request: dict[str, Any], ctx: RequestContext, *, on_text_delta: TextCallback | None = None
    ) -> dict[str, Any]:
        """Send ``request`` as ``response.create`` and return the final response.

        Raises:
            ModelClientError: an ``error`` or ``response.failed`` event (its subclasses: a
                refused upgrade, a lost connection, a first-event timeout).
            TimeoutError: no final event within ``timeout_s``.
        """
        return await dispatch(self, request, ctx, self._send, on_text_delta)

    async def _send(self, request: dict[str, Any], ctx: RequestContext,
                    on_text_delta: TextCallback | None = None) -> dict[str, Any]:
        message = create_message(serialize_request(request, ctx))
        return await self.exchange(message, ctx, on_text_delta=on_text_delta)

    async def exchange(self, message: bytes, ctx: RequestContext, *,
                       on_text_delta: TextCallback | None = None) -> dict[str, Any]:
        """Send one message (a JSON object) and read events until its response's final one.

        The building block of :meth:`create` and of the ``ws_deltas`` transport. Records the
        message size for the ``ModelCalled`` event and the per-call byte metrics.

        Raises:
            as :meth:`create`.
        """
        record_request_bytes(ctx, len(message))
        async with self._lock:
            self._num_requests += 1
            received = self._bytes_received
            try:
                with anyio.fail_after(self._timeout_s):
                    return await self._exchange(message.decode(), ctx, on_text_delta)
            except (ModelClientError, TimeoutError):
                self._num_errors += 1
                raise
            finally:
                observe_call_bytes(ctx, len(message), self._bytes_received - received)

    async def _exchange(self, message: str, ctx: RequestContext, on_text_delta: TextCallback | None) -> dict[str, Any]:
        connection = await self._connect()
        reader = ResponseStreamReader(ctx, on_text_delta, failed_status=500, error_status=400)
        try:
            await connection.send(message)
            self._bytes_sent += len(message.encode())
            is_first = True
            while True:
                raw = await self._receive(connection, is_first)
                is_first = False
                self._bytes_received += len(raw)
                if (response := reader.feed(json.loads(raw))) is not None:
                    return response
        except ConnectionClosed as exc:
            await self._drop()
            raise ConnectionLostError(503, f"the WebSocket closed before the response finished: {exc}",
                                      "connection_lost") from None
        except ModelClientError:
            raise  # an error or response.failed event ended the response: the connection is in step
        except BaseException:
            # timeout, cancellation, a failing callback or a bad frame: the server may still be
            # streaming this response, and its events must not answer the next request
            with anyio.CancelScope(shield=True):
                await self._drop()
            raise

    async def _receive(self, connection: ClientConnection, is_first: bool) -> str | bytes:
        if not is_first or self._first_event_timeout_s is None:
            return await connection.recv()
        with anyio.move_on_after(self._first_event_timeout_s):
            return await connection.recv()
        await self._drop()
        raise FirstEventTimeoutError(504, f"no event within {self._first_event_timeout_s} s of sending",
                                     "first_event_timeout")

    async def _connect(self) -> ClientConnection:
        if self._connection is not None and self._max_age_s is not None \
                and self._clock() - self._opened_at >= self._max_age_s:
            await self._drop()  # between responses: nothing is in flight on it
            self._rotations += 1
        if self._connection is not None:
            return self._connection
        delay, max_delay = self._backoff
        for attempt in range(self._max_reconnects + 1):
            if attempt:
                self._reconnect_attempts += 1
                await anyio.sleep(delay)
                delay = min(delay * 2, max_delay)
            try:
                self._connection = await connect(
                    self.url, additional_headers=self._headers, ssl=self._ssl if self.url.startswith("wss") else None,
                    max_size=None, ping_interval=self._ping[0], ping_timeout=self._ping[1],
                    open_timeout=self._open_timeout_s,
                )
            except InvalidStatus as exc:
                raise WebSocketRefusedError(exc.response.status_code, f"WebSocket upgrade refused by {self.url}",
                                            "websocket_refused") from None
            except (OSError, TimeoutError, InvalidHandshake) as exc:
                failure = exc
                continue
            self._setups += 1
            self._opened_at = self._clock()
            return self._connection
        raise ConnectionLostError(503, f"cannot connect to {self.url} after {self._max_reconnects + 1} "
                                       f"attempt(s): {failure}", "connection_failed")

    async def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()

    async def aclose(self) -> None:
        """Close the connection and every transport that carried this client's calls."""
        await self.transports.aclose()
        await self._drop()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def statistics(self) -> ResponsesWebSocketStatistics:
        return ResponsesWebSocketStatistics(
            self._num_requests, self._num_errors, self._bytes_sent, self._bytes_received, self._setups,
            self._rotations, self._reconnect_attempts,
        )
