"""A Responses API client over HTTP: ``POST {base_url}/responses``, JSON or streamed (SSE).

``ResponsesHTTPClient`` posts to any Responses API server — loopstack's own
``loopstack serve`` or an OpenAI-compatible one — over one keep-alive connection pool.
A ``loopstack_client_transport`` plugin may carry its calls instead (see
:mod:`loopstack.harness.clients.base`).

Example::

    async with ResponsesHTTPClient("http://127.0.0.1:8321/v1") as client:
        response = await client.create({"input": "Hi", "max_output_tokens": 16}, ctx)
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, NamedTuple, Self, cast

import httpx

from loopstack.harness.clients.base import (
    ModelClientError,
    ServerEndpoint,
    TextCallback,
    TransportCache,
    dispatch,
    observe_call_bytes,
    serialize_request,
)
from loopstack.harness.clients.stream import ResponseStreamReader

if TYPE_CHECKING:
    from loopstack.context import RequestContext

__all__ = ["ResponsesHTTPClient", "ResponsesHTTPStatistics", "error_of_response"]


class ResponsesHTTPStatistics(NamedTuple):
    num_requests: int
    num_errors: int
    bytes_sent: int
    bytes_received: int


def error_of_response(response: httpx.Response) -> ModelClientError:
    """The :class:`ModelClientError` for an error status, with the server's message and code
    (an OpenAI-style ``{"error": {...}}`` body, or ``{"error": "text"}``, or any text)."""
    try:
        error = response.json().get("error") or {}
        if isinstance(error, str):  # some servers send {"error": "text"}
            return ModelClientError(response.status_code, error)
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
    with :meth:`aclose` (or ``async with``). A ``loopstack_client_transport`` plugin (see
    :mod:`loopstack.harness.clients.base`) may carry the calls instead; the transports it
    gives are kept in :attr:`transports` and closed with the client.
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
        self.transports = TransportCache()
        limits = httpx.Limits() if keepalive else httpx.Limits(max_keepalive_connections=0)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport,
            verify=ssl_context if ssl_context is not None else True, limits=limits,
        )
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
            raise error_of_response(response)
        result: dict[str, Any] = response.json()
        return result

    async def _post_streaming(self, body: bytes, ctx: RequestContext,
                              on_text_delta: TextCallback | None) -> dict[str, Any]:
        async with self._http.stream("POST", "/responses", content=body) as response:
            if response.status_code >= 400:
                await response.aread()
                self._bytes_received += len(response.content)
                raise error_of_response(response)
            reader = ResponseStreamReader(ctx, on_text_delta, failed_status=response.status_code, error_status=500)
            # read to the end (the stream ends with its final event): leaving httpx's nested
            # byte iterators suspended hands their closing to the garbage collector, which
            # may run it when the event loop shuts down, and fail there
            async with aclosing(cast("AsyncGenerator[str, None]", response.aiter_lines())) as lines:
                async for line in lines:
                    self._bytes_received += len(line) + 1
                    if reader.response is None and line.startswith("data:"):
                        reader.feed(json.loads(line[5:]))
        if reader.response is None:
            raise reader.ended_early(response.status_code)
        return reader.response

    async def aclose(self) -> None:
        """Close the connection pool and every transport that carried this client's calls."""
        await self.transports.aclose()
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def statistics(self) -> ResponsesHTTPStatistics:
        return ResponsesHTTPStatistics(self._num_requests, self._num_errors, self._bytes_sent, self._bytes_received)
