"""The server's ``response`` middleware chain: what ``loopstack_response_middleware`` wraps.

Contract: a handler is called as ``handler(job, ctx)`` and is an async generator of
Responses API stream events (``response.created`` ... ``response.completed``); the
endpoint runs the engine through :meth:`ResponsesService.run`. A middleware may start
work alongside the inner handler (a guard overlapping inference), hold or drop events,
or stop iterating the inner generator: closing it cancels the generation and frees its
KV blocks. ``job.prepared`` carries the parsed request, the principal, the new input
items and the prompt token ids.

HTTP (JSON and SSE) and WebSocket requests all go through :func:`run_response`, which
also stores the response once every middleware has passed its final event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, MutableMapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loopstack.context import RequestContext
    from loopstack.api.service import Prepared, ResponsesService
    from loopstack.api.store import StoredResponse

__all__ = ["ResponseJob", "run_response"]


@dataclass(frozen=True)
class ResponseJob:
    """One response to generate: what the ``response`` chain's handlers receive."""

    service: ResponsesService
    prepared: Prepared
    local: MutableMapping[str, StoredResponse] | None = None


async def _generate(job: ResponseJob, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
    # the chain's endpoint; module-level so ctx.chain caches one chain per arm combination
    # aclosing: a consumer that stops early (a client gone, a guard's cut) closes the
    # engine stream now, which aborts the request and frees its KV blocks, not at GC time
    async with aclosing(job.service.run(job.prepared, job.local)) as events:
        async for event in events:
            yield event


_STORED_ON = ("response.completed", "response.incomplete")


async def run_response(job: ResponseJob, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
    """The events of ``job`` through the stack's response middlewares, outermost first.

    The response is stored here, after the outermost middleware let its final event
    through and before the client sees that event: a response a guard failed is never
    stored (nor retrievable, nor chainable), and one the client saw complete already is.
    """
    async with aclosing(ctx.chain("response", _generate)(job, ctx)) as events:
        async for event in events:
            if event.get("type") in _STORED_ON:
                await job.service.remember(job.prepared, event["response"], job.local)
            yield event
