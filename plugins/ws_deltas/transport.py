"""The client half: one WebSocket per session, deltas when the chain allows, every fallback.

:class:`DeltaTransport` is what the plugin's ``loopstack_client_transport`` hook returns
for a session (``ctx.session.state(SESSION_TRANSPORT)``), so the harness's Responses client
sends through it.
The connection opens on the first call and is reused; each call is planned by
:func:`~.delta.plan_request` and sent with
:meth:`~loopstack.harness.clients.websocket.ResponsesWebSocketClient.exchange`. Fallbacks:

* ``previous_response_not_found`` (evicted, expired, restarted without the response,
  another tenant's): the same request again, in full, on the same connection;
* a server that does not know ``response.append``: full requests from then on;
* a connection lost mid-response or a first-event timeout: reconnect (with backoff) and
  resend, up to ``max_resends`` times (a ``store: false`` chain is gone with the
  connection, so that resend is full);
* the server refuses the WebSocket upgrade: this session uses the client's HTTP path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from loopstack.harness.clients.base import ModelClientError, SendFull, ServerEndpoint, TextCallback, serialize_request
from loopstack.harness.clients.websocket import (
    ConnectionLostError,
    FirstEventTimeoutError,
    ResponsesWebSocketClient,
    WebSocketRefusedError,
    create_message,
)
from loopstack.plugins.ws_deltas.delta import ChainCursor, Plan, cursor_after, plan_request
from loopstack.types import StateKey

if TYPE_CHECKING:
    from loopstack.context import RequestContext
    from loopstack.plugins.ws_deltas.config import WsDeltasConfig

__all__ = ["SESSION_TRANSPORT", "DeltaTransport", "DeltaTransportStatistics", "SessionTransport"]

_METRIC = "loopstack_ws_deltas"
_LOST = (ConnectionLostError, FirstEventTimeoutError)  # the response may not have finished: resend


class DeltaTransportStatistics(NamedTuple):
    num_delta: int
    num_full: int
    num_http: int
    num_not_found: int
    num_resends: int
    bytes_sent: int
    connection_setups: int


@dataclass
class _Counts:
    delta: int = 0
    full: int = 0
    http: int = 0
    not_found: int = 0
    resends: int = 0
    bytes_sent: int = 0


class DeltaTransport:
    """One session's WebSocket and chain cursor (see the module doc)."""

    def __init__(self, config: WsDeltasConfig) -> None:
        self.config = config
        self._client: ResponsesWebSocketClient | None = None
        self._endpoint: ServerEndpoint | None = None
        self._cursor: ChainCursor | None = None
        self._use_http = False
        self._supports_append = True
        self._counts = _Counts()

    @property
    def client(self) -> ResponsesWebSocketClient | None:
        """The session's WebSocket client (None before the first call over it)."""
        return self._client

    @property
    def cursor(self) -> ChainCursor | None:
        """Where the session's chain stands on the server (None: the next request goes in full)."""
        return self._cursor

    async def _ws(self, endpoint: ServerEndpoint) -> ResponsesWebSocketClient:
        if self._client is None or endpoint != self._endpoint:
            if self._client is not None:  # the session moved to another server: its chain stays behind
                await self._client.aclose()
            config = self.config
            self._client = ResponsesWebSocketClient(
                endpoint.base_url, endpoint.api_key, ssl_context=endpoint.ssl_context,
                ping_interval_s=config.ping_interval_s, ping_timeout_s=config.ping_timeout_s,
                first_event_timeout_s=config.first_event_timeout_s, max_connection_age_s=config.max_connection_age_s,
                max_reconnects=config.max_reconnects, backoff_s=config.backoff_s, max_backoff_s=config.max_backoff_s,
            )
            self._endpoint, self._cursor = endpoint, None
        return self._client

    async def create(self, request: dict[str, Any], ctx: RequestContext, *, endpoint: ServerEndpoint,
                     fallback: SendFull, on_text_delta: TextCallback | None = None) -> dict[str, Any]:
        """Send ``request`` as a delta when possible, else in full; see the module doc.

        Raises:
            ModelClientError: the server refused the request, or the connection could not be
                kept after ``max_resends`` resends.
        """
        if self._use_http:
            return await self._http(request, ctx, fallback, on_text_delta)
        client = await self._ws(endpoint)
        setups = client.connection_generation
        started = time.perf_counter()
        resends = 0
        while True:
            plan = plan_request(request, self._cursor, connection=client.connection_generation,
                                supports_append=self._supports_append)
            message = self._message(plan, request, ctx)
            try:
                response = await client.exchange(message, ctx, on_text_delta=on_text_delta)
            except WebSocketRefusedError:
                self._use_http = True
                self._fallback(ctx, "refused")
                return await self._http(request, ctx, fallback, on_text_delta)
            except ModelClientError as exc:
                if exc.code == "previous_response_not_found" and plan.kind == "delta":
                    self._counts.not_found += 1
                    self._cursor = None  # resend in full
                    self._fallback(ctx, "not_found")
                elif exc.code == "invalid_message" and plan.kind == "delta":
                    self._supports_append = False  # a server without response.append
                elif isinstance(exc, _LOST) and resends < self.config.max_resends:
                    resends += 1
                    self._counts.resends += 1
                    self._fallback(ctx, exc.code or "connection_lost", counted=False)
                else:
                    self._cursor = None
                    raise
                continue
            self._cursor = cursor_after(request, response, connection=client.connection_generation)
            self._record(ctx, plan, len(message), client.connection_generation - setups, time.perf_counter() - started)
            return response

    def _message(self, plan: Plan, request: dict[str, Any], ctx: RequestContext) -> bytes:
        if plan.message is not None:
            return plan.message
        if plan.reason not in ("no_chain", "caller_chains"):
            self._fallback(ctx, plan.reason)
        return create_message(serialize_request(request, ctx))

    @staticmethod
    def _fallback(ctx: RequestContext, reason: str, *, counted: bool = True) -> None:
        name = f"{_METRIC}_fallbacks_total" if counted else f"{_METRIC}_resends_total"
        ctx.count(name, help="requests not sent as deltas (or resent), by reason", reason=reason)

    async def _http(self, request: dict[str, Any], ctx: RequestContext, fallback: SendFull,
                    on_text_delta: TextCallback | None) -> dict[str, Any]:
        self._counts.http += 1
        ctx.count(f"{_METRIC}_requests_total", help="model calls by how they were sent", kind="http")
        return await fallback(request, ctx, on_text_delta)

    def _record(self, ctx: RequestContext, plan: Plan, num_bytes: int, new_connections: int, seconds: float) -> None:
        if plan.kind == "delta":
            self._counts.delta += 1
        else:
            self._counts.full += 1
        self._counts.bytes_sent += num_bytes
        ctx.count(f"{_METRIC}_requests_total", help="model calls by how they were sent", kind=plan.kind)
        ctx.count(f"{_METRIC}_connection_setups_total", new_connections, help="WebSocket connections opened")
        ctx.observe(f"{_METRIC}_call_seconds", seconds, help="wall time of one model call over the session socket")

    async def aclose(self) -> None:
        """Close the session's connection (a later call opens a new one)."""
        if self._client is not None:
            await self._client.aclose()

    def statistics(self) -> DeltaTransportStatistics:
        counts = self._counts
        setups = self._client.connection_generation if self._client is not None else 0
        return DeltaTransportStatistics(counts.delta, counts.full, counts.http, counts.not_found, counts.resends,
                                        counts.bytes_sent, setups)


@dataclass
class SessionTransport:
    """A session's :class:`DeltaTransport`, made by the first call the plugin serves (None before)."""

    transport: DeltaTransport | None = None


SESSION_TRANSPORT = StateKey("ws_deltas.transport", SessionTransport)
"""Where a session keeps its transport: ``ctx.session.state(SESSION_TRANSPORT).transport``."""
