"""A model client that runs the API layer and the engine in this process: no server, no socket.

``EmbeddedClient`` drives the same code a ``loopstack serve`` request runs — request
validation, conversation rendering, the stack's ``response`` middleware chain, the engine —
so an agent gets the full stack (prefix cache, tool-call parsing, guards) from a script or
a notebook without starting a server. Errors come back as :class:`ModelClientError` with
the status and code the HTTP server would have sent.

Example::

    async with EmbeddedClient.from_stack("baseline") as client:   # loads SmolLM2 once
        agent = Agent(client, [get_weather], instructions="Use tools.")
        print((await agent.run("Weather in Paris?")).final_text)
"""

from __future__ import annotations

import time
from contextlib import aclosing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import anyio.to_thread
from pydantic import ValidationError

from loopstack.api.auth import ANONYMOUS
from loopstack.api.errors import APIError, from_validation_error
from loopstack.api.routes.responses import TERMINAL, observe
from loopstack.api.pipeline import ResponseJob, run_response
from loopstack.api.schemas import ResponsesRequest
from loopstack.context import Session
from loopstack.harness.call_stream import observe_stream_event
from loopstack.harness.clients.base import ModelClientError, TextCallback, serialize_request

if TYPE_CHECKING:
    from loopstack.api.state import ServerState
    from loopstack.context import RequestContext

__all__ = ["EmbeddedClient"]


def _client_error(exc: APIError) -> ModelClientError:
    body = exc.body().get("error") or {}
    return ModelClientError(exc.status, str(body.get("message", exc)), body.get("code"))


class EmbeddedClient:
    """The API layer and engine of a stack, called in process.

    Args:
        state: a server state (:func:`loopstack.api.server.build_state`); the client does not
            close a state it was given.
    """

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self._owned = False
        self.num_requests = 0

    @classmethod
    def from_stack(cls, stack_ref: str | Path, *, engine: Any = None) -> EmbeddedClient:
        """Load ``stack_ref`` and start its engine (unless one is given); the client owns both.

        Responses are stored in memory: the harness sends the whole conversation each turn.
        """
        from loopstack.api.server import build_state

        client = cls(build_state(stack_ref, engine=engine, store_path=":memory:"))
        client._owned = True
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
        try:
            prepared = self.state.service.prepare(body, ANONYMOUS)
        except APIError as exc:
            raise _client_error(exc) from None
        session = Session(id=body.prompt_cache_key or ctx.session.id, tenant=ANONYMOUS.tenant)
        started = time.perf_counter()
        final: dict[str, Any] | None = None
        with self.state.live.request(session=session) as server_ctx:
            async with aclosing(run_response(ResponseJob(self.state.service, prepared), server_ctx)) as stream:
                async for event in stream:
                    observe_stream_event(ctx, event)
                    if event["type"] == "response.output_text.delta" and on_text_delta is not None:
                        on_text_delta(event.get("delta", ""))
                    elif event["type"] in TERMINAL:
                        final = event["response"]
                        observe(server_ctx, final, time.perf_counter() - started)
                    elif event["type"] == "error":
                        error = event.get("error") or {}
                        raise ModelClientError(int(event.get("status") or 500), str(error.get("message")), error.get("code"))
        if final is None:
            raise ModelClientError(500, "generation ended without a final response")
        if final["status"] == "failed":
            error = final.get("error") or {}
            raise ModelClientError(500, str(error.get("message", "generation failed")), error.get("code"))
        return final

    async def aclose(self) -> None:
        if self._owned:
            from loopstack.api.server import close_state

            await anyio.to_thread.run_sync(close_state, self.state)
            self._owned = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
