"""Model clients: a Responses API request body in, the final response object out.

``ModelClient`` is the one-method seam the agent loop calls (a test double is a class
with ``create``); the clients are in this package (:mod:`~loopstack.harness.clients.http`,
:mod:`~loopstack.harness.clients.websocket`, :mod:`~loopstack.harness.clients.chat`,
:mod:`~loopstack.harness.clients.embedded`, :mod:`~loopstack.harness.clients.replay`).
This module holds what they share: the error, request serialization and byte accounting,
and the transport seam.

Transport seam: before each call the Responses clients ask the stack's
``loopstack_client_transport`` hook for a :class:`ClientTransport` for the session (the
``ws_deltas`` plugin answers with its per-session WebSocket). A transport gets the
client's :class:`ServerEndpoint` and the client's own send path as ``fallback``; with no
transport (the default, or the plugin's arm "off") the client sends as usual
(:func:`dispatch`). The client keeps the transports its calls went through in a
:class:`TransportCache` and closes them with itself.

Example::

    async def create(self, request, ctx, *, on_text_delta=None):  # a client's create
        return await dispatch(self, request, ctx, self._send, on_text_delta)
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from loopstack.types import StateKey

if TYPE_CHECKING:
    from loopstack.context import RequestContext

__all__ = [
    "MAX_OPEN_TRANSPORTS",
    "ClientTransport",
    "ModelClient",
    "ModelClientError",
    "SendFull",
    "ServerEndpoint",
    "TextCallback",
    "TransportCache",
    "TransportClient",
    "dispatch",
    "last_request_bytes",
    "observe_call_bytes",
    "record_request_bytes",
    "serialize_request",
]

TextCallback = Callable[[str], None]


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


class TransportCache:
    """The transports a client's calls went through (one per session, as a rule), kept open
    for the session's next call and closed with the client: a session may outlive its calls.

    At most ``max_open`` stay open: past that the least recently used one (a finished
    session's, as a rule) is closed, so a long-lived client does not keep a socket per
    session; that session's next call reopens it.
    """

    def __init__(self, max_open: int = MAX_OPEN_TRANSPORTS) -> None:
        self.max_open = max_open
        self._open: dict[int, ClientTransport] = {}  # by identity (a transport need not be hashable), oldest first

    async def use(self, transport: ClientTransport) -> None:
        """Mark ``transport`` as the most recently used; close the least recently used past ``max_open``."""
        self._open.pop(id(transport), None)
        self._open[id(transport)] = transport
        while len(self._open) > self.max_open:
            await self._open.pop(next(iter(self._open))).aclose()

    def __len__(self) -> int:
        return len(self._open)

    async def aclose(self) -> None:
        """Close every transport (the client's ``aclose`` calls it); the cache stays usable."""
        transports, self._open = list(self._open.values()), {}
        for transport in transports:
            await transport.aclose()


class TransportClient(Protocol):
    """What :func:`dispatch` needs of a client: where it sends, and its transport cache."""

    @property
    def endpoint(self) -> ServerEndpoint: ...

    @property
    def transports(self) -> TransportCache: ...


async def dispatch(client: TransportClient, request: dict[str, Any], ctx: RequestContext, send: SendFull,
                   on_text_delta: TextCallback | None) -> dict[str, Any]:
    """Send through the session's transport when a plugin gives one, else with ``send``."""
    transport = ctx.hooks.client_transport(ctx)
    if transport is None:
        return await send(request, ctx, on_text_delta)
    await client.transports.use(transport)
    return await transport.create(request, ctx, endpoint=client.endpoint, fallback=send, on_text_delta=on_text_delta)


def observe_call_bytes(ctx: RequestContext, sent: int, received: int) -> None:
    """Per-call client metrics (every arm, every client): bytes of the request and of the answer."""
    ctx.observe("loopstack_client_request_bytes", sent, help="bytes a model client sent for one call")
    ctx.observe("loopstack_client_response_bytes", received, help="bytes a model client received for one call")


@dataclass
class _CallRecord:
    request_bytes: int = 0


_CALL_RECORD = StateKey("loopstack.model_client", _CallRecord)  # per request: what the client sent


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
    ctx.state(_CALL_RECORD).request_bytes = size


def last_request_bytes(ctx: RequestContext) -> int | None:
    """Bytes of the body a client sent for this request, or None when none was serialized."""
    record = ctx.state(_CALL_RECORD)
    return record.request_bytes or None
