"""A model client that runs the API layer and the engine in this process: no server, no socket.

``EmbeddedClient`` drives the same code a ``loopstack serve`` request runs — request
validation, conversation rendering, the stack's ``response`` middleware chain, the engine
(:func:`loopstack.api.pipeline.respond`) — so an agent gets the full stack (prefix cache,
tool-call parsing, guards) from a script or a notebook without starting a server. Errors come
back as :class:`ModelClientError` with the status and code the HTTP server would have sent.

Given the harness's own live stack (:meth:`EmbeddedClient.from_live`), the stack is built once:
the harness and the API layer share its plugins, and each call runs in the harness's request
context. :meth:`EmbeddedClient.from_stack` loads a stack of its own for the API side.

Example::

    async with EmbeddedClient.from_stack("baseline") as client:   # loads SmolLM2 once
        agent = Agent(client, [get_weather], instructions="Use tools.")
        print((await agent.run("Weather in Paris?")).final_text)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import anyio.to_thread
from pydantic import ValidationError

from loopstack.api.auth import ANONYMOUS
from loopstack.api.errors import APIError, from_validation_error
from loopstack.api.pipeline import respond
from loopstack.api.schemas import ResponsesRequest
from loopstack.harness.clients.base import ModelClientError, TextCallback, serialize_request
from loopstack.harness.clients.stream import ResponseStreamReader

if TYPE_CHECKING:
    from loopstack.api.state import ServerState
    from loopstack.context import RequestContext
    from loopstack.live import LiveStack

__all__ = ["EmbeddedClient"]


def _client_error(exc: APIError) -> ModelClientError:
    body = exc.body().get("error") or {}
    return ModelClientError(exc.status, str(body.get("message", exc)), body.get("code"))


class EmbeddedClient:
    """The API layer and engine of a stack, called in process.

    Args:
        state: a server state (:func:`loopstack.api.server.build_state`); the client does not
            close a state it was given.
        shares_context: run each call in the caller's request context (its runtime is the
            state's); False makes a server-side context per call, as a server does.
    """

    def __init__(self, state: ServerState, *, shares_context: bool = False) -> None:
        self.state = state
        self.shares_context = shares_context
        self.num_requests = 0
        self._close: Callable[[], None] | None = None

    @classmethod
    def from_stack(cls, stack_ref: str | Path, *, engine: Any = None) -> EmbeddedClient:
        """Load ``stack_ref`` and start its engine (unless one is given); the client owns both.

        Responses are stored in memory: the harness sends the whole conversation each turn.
        """
        from loopstack.api.server import build_state, close_state

        client = cls(build_state(stack_ref, engine=engine, store_path=":memory:"))
        client._close = lambda: close_state(client.state)
        return client

    @classmethod
    def from_live(cls, live: LiveStack, *, engine: Any = None) -> EmbeddedClient:
        """Serve the harness's own ``live`` stack: start its engine (unless one is given) and an
        in-memory store, owned by the client; ``live`` stays the caller's. Each call runs in the
        caller's request context, so the stack's plugins exist once and a call makes one context.

        Example::

            live = LiveStack(PluginCatalog.discover(), "baseline")
            client = EmbeddedClient.from_live(live)
            agent = Agent(client, tools, runtime=live.current)
        """
        from loopstack.api.server import close_state, state_for

        client = cls(state_for(live, engine=engine, store_path=":memory:"), shares_context=True)
        client._close = lambda: close_state(client.state, close_live=False)
        return client

    async def create(self, request: dict[str, Any], ctx: RequestContext, *,
                     on_text_delta: TextCallback | None = None) -> dict[str, Any]:
        """Run ``request`` through the stack's API layer and engine; return the final response.

        Raises:
            ModelClientError: the request is invalid (400 + code) or generation failed (500).
        """
        serialize_request(request, ctx)  # the bytes a remote client would send: same accounting
        self.num_requests += 1
        try:
            body = ResponsesRequest.model_validate({**request, "stream": on_text_delta is not None})
        except ValidationError as exc:
            raise _client_error(from_validation_error(exc)) from None
        reader = ResponseStreamReader(ctx, on_text_delta, failed_status=500, error_status=500)
        response = respond(self.state, body, ANONYMOUS, ctx=ctx if self.shares_context else None,
                           session_id=body.prompt_cache_key or ctx.session.id)
        try:
            await response.open()
        except APIError as exc:
            raise _client_error(exc) from None
        failure: ModelClientError | None = None
        async with response:
            async for event in response:  # to the end: middlewares finish their work past the final event
                if failure is None:
                    try:
                        reader.feed(event)
                    except ModelClientError as exc:  # raised once the stream is read to its end
                        failure = exc
        if failure is not None:
            raise failure
        if reader.response is None:
            raise reader.ended_early(500)
        return reader.response

    async def aclose(self) -> None:
        close, self._close = self._close, None
        if close is not None:
            await anyio.to_thread.run_sync(close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
