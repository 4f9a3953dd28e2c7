"""One response, start to end: what every route and the embedded client run.

:func:`respond` is the one place a response is made. Opening it enters a request context
(``state.live.request(...)``, or the caller's own) and prepares the request there (a plugin
may supply the prompt ids through ``loopstack_prompt_ids``; every client error is raised
here, before anything streams). Iterating it runs the stack's ``response`` middleware chain
around :meth:`ResponsesService.run`, stores the response, and records the per-request
metrics when the terminal event passes. Routes only turn its events into JSON, SSE, WebSocket
frames or chat chunks.

The ``response`` chain's contract: a handler is called as ``handler(job, ctx)`` and is an async
generator of Responses stream events (``response.created`` ... a terminal event); the endpoint
(:func:`generate`) runs the engine. A middleware may start work alongside the inner handler (a
guard overlapping inference), hold or drop events, or stop iterating the inner generator:
closing it cancels the generation and frees its KV blocks at once (``aclosing`` all the way
down). ``job.prepared`` carries the parsed request, the principal, the new input items and the
prompt ids.

Example (what ``POST /v1/responses`` does)::

    async with respond(state, body, principal) as response:
        async for event in response:
            ...
    response.final  # the terminal event's response
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Mapping, MutableMapping
from contextlib import ExitStack, aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from loopstack.api.ids import new_id
from loopstack.api.service import Prepared
from loopstack.context import Session
from loopstack.items import FINAL_EVENT_TYPES, TERMINAL_EVENT_TYPES

if TYPE_CHECKING:
    from loopstack.api.auth import Principal
    from loopstack.api.schemas import ResponsesRequest
    from loopstack.api.service import ResponsesService
    from loopstack.api.state import ServerState
    from loopstack.api.store import StoredResponse
    from loopstack.context import RequestContext
    from loopstack.types import Event

__all__ = ["ResponseJob", "ResponseStream", "generate", "observe", "respond", "run_response"]


@dataclass(frozen=True)
class ResponseJob:
    """One response to generate: what the ``response`` chain's handlers receive.

    ``local`` holds the connection's ``store: false`` responses (WebSocket); None elsewhere.
    """

    service: ResponsesService
    prepared: Prepared
    local: MutableMapping[str, StoredResponse] | None = None


async def generate(job: ResponseJob, ctx: RequestContext) -> AsyncGenerator[Event, None]:
    """The ``response`` chain's endpoint: the engine's events for ``job``.

    Module-level, so ``ctx.chain`` composes one chain per combination of arms.
    """
    # aclosing: a consumer that stops early (a client gone, a guard's cut) closes the
    # engine stream now, which aborts the request and frees its KV blocks, not at GC time
    async with aclosing(job.service.run(job.prepared, ctx)) as events:
        async for event in events:
            yield event


async def run_response(job: ResponseJob, ctx: RequestContext) -> AsyncGenerator[Event, None]:
    """The events of ``job`` through the stack's response middlewares, outermost first.

    The response is stored here, after the outermost middleware let its final event
    through and before the client sees that event: a response a guard failed is never
    stored (nor retrievable, nor chainable), and one the client saw complete already is.
    """
    async with aclosing(ctx.chain("response", generate)(job, ctx)) as events:
        async for event in events:
            if event.get("type") in FINAL_EVENT_TYPES:
                await job.service.remember(job.prepared, event["response"], job.local)
            yield event


def observe(ctx: RequestContext, response: Mapping[str, Any], elapsed: float) -> None:
    """Per-request metrics, labelled by plugin and arm through the request context."""
    ctx.observe("loopstack_api_response_seconds", elapsed, help="wall time of a response")
    usage = response.get("usage") or {}
    if usage:
        ctx.count("loopstack_api_input_tokens_total", usage["input_tokens"], help="prompt tokens")
        ctx.count("loopstack_api_cached_tokens_total", usage["input_tokens_details"]["cached_tokens"],
                  help="prompt tokens served from the prefix cache")
        ctx.count("loopstack_api_output_tokens_total", usage["output_tokens"], help="generated tokens")
    ctx.count("loopstack_api_responses_total", help="responses by final status", status=response["status"])


class ResponseStream:
    """One response of :func:`respond`: open it, iterate its events (once), close it.

    Attributes (once open):
        ctx: the request context the response runs in.
        prepared: the prepared request.
        final: the response of the terminal event, once it passed; else None.
    """

    def __init__(self, state: ServerState, request: ResponsesRequest | Prepared, principal: Principal, *,
                 ctx: RequestContext | None, local: MutableMapping[str, StoredResponse] | None,
                 overrides: Mapping[str, str] | None, session_id: str | None) -> None:
        self.state = state
        self.final: dict[str, Any] | None = None
        self._request, self._principal = request, principal
        self._given_ctx, self._local = ctx, local
        self._overrides, self._session_id = overrides, session_id
        self._exits = ExitStack()
        self._ctx: RequestContext | None = None
        self._prepared: Prepared | None = None
        self._events: AsyncGenerator[Event, None] | None = None
        self._started = 0.0

    @property
    def ctx(self) -> RequestContext:
        if self._ctx is None:
            raise RuntimeError("the response is not open")
        return self._ctx

    @property
    def prepared(self) -> Prepared:
        if self._prepared is None:
            raise RuntimeError("the response is not open")
        return self._prepared

    async def open(self) -> Self:
        """Enter the request context and prepare the request (a no-op once open).

        Raises:
            APIError: the request is invalid (the context is left again).
        """
        if self._prepared is not None:
            return self
        self._started = time.perf_counter()
        request = self._request
        if isinstance(request, Prepared):
            response_id = request.response_id
            cache_key = request.request.prompt_cache_key
        else:
            response_id = new_id("resp")
            cache_key = request.prompt_cache_key
        ctx = self._given_ctx
        if ctx is None:
            session = Session(id=self._session_id or cache_key or response_id, tenant=self._principal.tenant)
            ctx = self._exits.enter_context(self.state.live.request(session=session, overrides=self._overrides))
        try:
            self._prepared = request if isinstance(request, Prepared) else self.state.service.prepare(
                request, self._principal, ctx=ctx, local=self._local, response_id=response_id)
        except BaseException:
            self._exits.close()
            raise
        self._ctx = ctx
        return self

    def __aiter__(self) -> AsyncGenerator[Event, None]:
        if self._events is None:
            self._events = self._run()
        return self._events

    async def _run(self) -> AsyncGenerator[Event, None]:
        ctx, job = self.ctx, ResponseJob(self.state.service, self.prepared, self._local)
        async with aclosing(run_response(job, ctx)) as events:
            async for event in events:
                if event.get("type") in TERMINAL_EVENT_TYPES:
                    self.final = event["response"]
                    observe(ctx, self.final, time.perf_counter() - self._started)
                yield event

    async def final_response(self) -> dict[str, Any] | None:
        """Run the response to its end; the terminal event's response (None: there was none)."""
        async for _ in self:
            pass
        return self.final

    async def aclose(self) -> None:
        """Stop the response (the engine aborts, its KV is freed) and leave the request context.
        Safe to call twice, and on a response that never opened."""
        events, self._events = self._events, None
        try:
            if events is not None:
                await events.aclose()
        finally:
            self._exits.close()

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def respond(state: ServerState, request: ResponsesRequest | Prepared, principal: Principal, *,
            ctx: RequestContext | None = None, local: MutableMapping[str, StoredResponse] | None = None,
            overrides: Mapping[str, str] | None = None, session_id: str | None = None) -> ResponseStream:
    """One response of ``state``'s stack (see the module doc); use it as ``async with``.

    Args:
        request: a Responses request, prepared in the request context; or one already
            :class:`Prepared` (Chat Completions builds its own), run as it is.
        principal: who asks.
        ctx: a request context to run in (the embedded client passes the harness's); None
            enters a new one from ``state.live``.
        local: the connection's ``store: false`` responses (WebSocket): chains read them, and
            unstored responses are kept there.
        overrides: A/B arm overrides for the new request context.
        session_id: the new context's session id (default: ``prompt_cache_key``, else the
            response id).
    """
    return ResponseStream(state, request, principal, ctx=ctx, local=local, overrides=overrides,
                          session_id=session_id)
