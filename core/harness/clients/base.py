"""Model clients: a Responses API request body in, the final response object out.

``ModelClient`` is the one-method seam the agent loop calls (a test double is a class
with ``create``). ``ResponsesHTTPClient`` posts to any Responses API server — loopstack's
own ``loopstack serve`` or an OpenAI-compatible one — over one keep-alive connection pool.

Transport seam: before each call the Responses clients ask the stack's
``loopstack_client_transport`` hook for a :class:`ClientTransport` for the session (the
``ws_deltas`` plugin answers with its per-session WebSocket). A transport gets the
client's :class:`ServerEndpoint` and the client's own send path as ``fallback``; with no
transport (the default, or the plugin's arm "off") the client sends as usual.

Example::

    client = ResponsesHTTPClient("http://127.0.0.1:8321/v1")
    try:
        response = await client.create({"input": "Hi", "max_output_tokens": 16}, ctx)
    finally:
        await client.aclose()
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, Self, runtime_checkable

import httpx

from loopstack.harness.call_stream import observe_stream_event

if TYPE_CHECKING:
    from loopstack.context import RequestContext

__all__ = [
    "ClientTransport",
    "ModelClient",
    "ModelClientError",
    "ResponsesHTTPClient",
    "ResponsesHTTPStatistics",
    "ServerEndpoint",
    "TextCallback",
    "dispatch",
    "last_request_bytes",
    "observe_call_bytes",
    "record_request_bytes",
    "serialize_request",
]

_RECORD = "loopstack.model_client"
FINAL_EVENT_TYPES = ("response.completed", "response.incomplete")

TextCallback = Callable[[str], None]  # ctx.state key of the per-request record below


@runtime_checkable
class ModelClient(Protocol):
    """Anything that turns a Responses API request body into a response object."""

    async def create(
        self, request: dict[str, Any], ctx: RequestContext, *, on_text_delta: TextCallback | None = None
    ) -> dict[str, Any]:
        """Send ``request`` and return the final response (``output``, ``usage``, ...).

        ``on_text_delta``, when given, receives output text as it is generated (a client
        that cannot stream may call it once with the whole text, or not at all).

        Raises:
            ModelClientError: the server refused the request or failed.
        """
        ...


class ModelClientError(Exception):
    """The model server answered with an error status.

    Attributes:
        status: the HTTP status (4xx, 5xx).
        message: the server's error message.
        code: the server's error code (``invalid_value``, ...) when it sent one.
    """

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(f"{status}: {message}" + (f" ({code})" if code else ""))
        self.status = status
        self.message = message
        self.code = code


@dataclass(frozen=True)
class ServerEndpoint:
    """Where a Responses client sends: what a transport needs to reach the same server.

    Attributes:
        base_url: the API root, ``http(s)://host:port/v1``.
        api_key: the bearer key, or None.
        ssl_context: for ``https`` with a private CA (loopback TLS), or None for the default.
    """

    base_url: str
    api_key: str | None = None
    ssl_context: ssl.SSLContext | None = None


SendFull = Callable[..., Awaitable[dict[str, Any]]]  # (request, ctx, on_text_delta) -> response


@runtime_checkable
class ClientTransport(Protocol):
    """What ``loopstack_client_transport`` returns: another way to send a client's requests."""

    async def create(self, request: dict[str, Any], ctx: RequestContext, *, endpoint: ServerEndpoint,
                     fallback: SendFull, on_text_delta: TextCallback | None = None) -> dict[str, Any]:
        """Send ``request`` to ``endpoint`` and return the final response; ``fallback(request,
        ctx, on_text_delta)`` sends it the client's own way (e.g. when WebSocket is refused)."""
        ...

    async def aclose(self) -> None:
        """Close what the transport opened (the client calls it from its own ``aclose``)."""
        ...


MAX_OPEN_TRANSPORTS = 64  # per client: sessions' transports kept open, least recently used closed first


async def dispatch(client: Any, request: dict[str, Any], ctx: RequestContext, send: SendFull,
                   on_text_delta: TextCallback | None) -> dict[str, Any]:
    """Send through the session's transport when a plugin gives one, else with ``send``."""
    transport = ctx.hooks.client_transport(ctx)
    if transport is None:
        return await send(request, ctx, on_text_delta)
    key = id(transport)
    client._transports.pop(key, None)  # most recently used last
    client._transports[key] = transport
    while len(client._transports) > MAX_OPEN_TRANSPORTS:
        # the least recently used session's transport (a finished session's, as a rule): closed
        # now so a long-lived client does not keep a socket per session; a later call reopens it
        await client._transports.pop(next(iter(client._transports))).aclose()
    return await transport.create(request, ctx, endpoint=client.endpoint, fallback=send, on_text_delta=on_text_delta)


def observe_call_bytes(ctx: RequestContext, sent: int, received: int) -> None:
    """Per-call client metrics (every arm, every client): bytes of the request and of the answer."""
    ctx.observe("loopstack_client_request_bytes", sent, help="bytes a model client sent for one call")
    ctx.observe("loopstack_client_response_bytes", received, help="bytes a model client received for one call")


def final_response(event: dict[str, Any], *, failed_status: int, error_status: int) -> dict[str, Any] | None:
    """The response a final stream event carries, or None for any other event.

    Raises:
        ModelClientError: a ``response.failed`` event (status ``failed_status``) or an
            ``error`` event (its own ``status``, else ``error_status``).
    """
    kind = event.get("type")
    if kind in FINAL_EVENT_TYPES:
        return event["response"]
    if kind == "response.failed":
        error = event["response"].get("error") or {}
        raise ModelClientError(failed_status, str(error.get("message")), error.get("code"))
    if kind == "error":
        error = event.get("error") or {}
        raise ModelClientError(int(event.get("status") or error_status), str(error.get("message")), error.get("code"))
    return None


@dataclass
class _CallRecord:
    request_bytes: int = 0


def serialize_request(request: dict[str, Any], ctx: RequestContext) -> bytes:
    """The request body as sent: a plugin's ``loopstack_serialize_request`` bytes, else compact JSON.

    Records the size on ``ctx`` for :func:`last_request_bytes`.
    """
    body = ctx.hooks.serialize_request(request=request, ctx=ctx)
    if body is None:
        body = json.dumps(request, separators=(",", ":"), ensure_ascii=False).encode()
    record_request_bytes(ctx, len(body))
    return body


def record_request_bytes(ctx: RequestContext, size: int) -> None:
    """Record the size of the body a client sent (for clients that send another shape)."""
    ctx.state(_RECORD, _CallRecord).request_bytes = size


def last_request_bytes(ctx: RequestContext) -> int | None:
    """Bytes of the body a client sent for this request, or None when none was serialized."""
    record = ctx.state(_RECORD, _CallRecord)
    return record.request_bytes or None


class ResponsesHTTPStatistics(NamedTuple):
    num_requests: int
    num_errors: int
    bytes_sent: int
    bytes_received: int


def _error_of(response: httpx.Response) -> ModelClientError:
    try:
        error = response.json().get("error") or {}
        message, code = str(error.get("message") or response.text), error.get("code")
    except (ValueError, AttributeError):
        message, code = response.text or response.reason_phrase, None
    return ModelClientError(response.status_code, message, code)


class ResponsesHTTPClient:
    """A Responses API client over HTTP (``POST {base_url}/responses``); it streams (SSE)
    when asked for text deltas (``on_text_delta``).

    Args:
        base_url: the API root as the OpenAI SDK takes it, e.g. ``http://127.0.0.1:8321/v1``.
        api_key: sent as ``Authorization: Bearer``; None sends no header.
        timeout_s: per-request timeout; None disables it.
        transport: an httpx transport (tests, or a plugin's), default: the network.
        ssl_context: verifies ``https`` servers (a private CA, loopback TLS); default: system CAs.
        keepalive: keep connections open between calls (False: a new connection, and TLS
            handshake, per call).

    One ``httpx.AsyncClient`` per instance keeps connections alive across calls; close it
    with :meth:`aclose` (or ``async with``). A ``loopstack_client_transport`` plugin (see the
    module doc) may carry the calls instead.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float | None = 120,
        transport: httpx.AsyncBaseTransport | None = None,
        ssl_context: ssl.SSLContext | None = None,
        keepalive: bool = True,
    ) -> None:
        headers = {"content-type": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self.base_url = base_url.rstrip("/")
        self.endpoint = ServerEndpoint(self.base_url, api_key, ssl_context)
        limits = httpx.Limits() if keepalive else httpx.Limits(max_keepalive_connections=0)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport,
            verify=ssl_context if ssl_context is not None else True, limits=limits,
        )
        self._transports: dict[int, Any] = {}  # closed by aclose (a session may outlive its calls)
        self._num_requests = self._num_errors = self._bytes_sent = self._bytes_received = 0

    async def create(
        self, request: dict[str, Any], ctx: RequestContext, *, on_text_delta: TextCallback | None = None
    ) -> dict[str, Any]:
        """POST the request; with ``on_text_delta``, as SSE (``"stream": true``), calling it per
        delta and passing every event to the plugins that follow calls as the model writes
        them (``loopstack_tool_call_delta``).

        Raises:
            ModelClientError: an error status, a ``response.failed`` or ``error`` event, or a
                stream that ended without a final response.
            httpx.HTTPError: the connection failed or timed out.
        """
        return await dispatch(self, request, ctx, self._send, on_text_delta)

    async def _send(self, request: dict[str, Any], ctx: RequestContext,
                    on_text_delta: TextCallback | None = None) -> dict[str, Any]:
        stream = on_text_delta is not None
        if stream:
            request = {**request, "stream": True}
        body = serialize_request(request, ctx)
        self._num_requests += 1
        self._bytes_sent += len(body)
        received = self._bytes_received
        try:
            if not stream:
                return await self._post(body)
            return await self._post_streaming(body, ctx, on_text_delta)
        except (ModelClientError, httpx.HTTPError):
            self._num_errors += 1
            raise
        finally:
            observe_call_bytes(ctx, len(body), self._bytes_received - received)

    async def _post(self, body: bytes) -> dict[str, Any]:
        response = await self._http.post("/responses", content=body)
        self._bytes_received += len(response.content)
        if response.status_code >= 400:
            raise _error_of(response)
        return response.json()

    async def _post_streaming(self, body: bytes, ctx: RequestContext,
                              on_text_delta: TextCallback | None) -> dict[str, Any]:
        async with self._http.stream("POST", "/responses", content=body) as response:
            if response.status_code >= 400:
                await response.aread()
                self._bytes_received += len(response.content)
                raise _error_of(response)
            # read to the end (the stream ends with its final event): leaving httpx's nested
            # byte iterators suspended hands their closing to the garbage collector, which
            # may run it when the event loop shuts down, and fail there
            final: dict[str, Any] | None = None
            async with aclosing(response.aiter_lines()) as lines:
                async for line in lines:
                    self._bytes_received += len(line) + 1
                    if final is not None or not line.startswith("data:"):
                        continue
                    event = json.loads(line[5:])
                    observe_stream_event(ctx, event)
                    if event.get("type") == "response.output_text.delta" and on_text_delta is not None:
                        on_text_delta(event.get("delta", ""))
                    else:
                        final = final_response(event, failed_status=response.status_code, error_status=500)
        if final is None:
            raise ModelClientError(response.status_code, "the event stream ended without a final response")
        return final

    async def aclose(self) -> None:
        """Close the connection pool and every transport that carried this client's calls."""
        transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            await transport.aclose()
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def statistics(self) -> ResponsesHTTPStatistics:
        return ResponsesHTTPStatistics(self._num_requests, self._num_errors, self._bytes_sent, self._bytes_received)
