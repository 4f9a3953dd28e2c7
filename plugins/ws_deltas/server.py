"""The server half: commit each completed response's output to the chain token state.

``prepare`` took the prompt ids from the chain (see :mod:`loopstack.plugins.ws_deltas.chain_prompt`);
this ``response`` middleware watches the events and, when the response completes (or
stops at ``max_output_tokens``: it is stored and can be chained from), tokenizes its
output and caches the new chain under the response's id. It passes every event on at
once and holds nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from loopstack.plugins.ws_deltas.chain_prompt import chain_prompts

if TYPE_CHECKING:
    from loopstack.api.pipeline import ResponseJob
    from loopstack.context import RequestContext
    from loopstack.middleware import Handler

__all__ = ["commit_middleware"]

_CHAINABLE = ("response.completed", "response.incomplete")


def commit_middleware(next_handler: Handler) -> Handler:
    async def handler(job: ResponseJob, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        prompts = chain_prompts(ctx) if job.local is not None else None  # WebSocket requests only
        async for event in next_handler(job, ctx):
            if prompts is not None and event.get("type") in _CHAINABLE:
                before = prompts.num_tokenized
                if prompts.commit(job.prepared, event["response"]) is not None:
                    ctx.observe("loopstack_ws_deltas_output_tokens_tokenized", prompts.num_tokenized - before,
                                help="output tokens tokenized to extend a chain")
            yield event

    return handler
