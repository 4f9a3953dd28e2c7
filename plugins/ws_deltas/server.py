"""The server half: prompt ids from the chain token state, and commits of completed outputs.

:func:`chain_prompt` answers ``loopstack_prompt_ids`` for WebSocket requests (a connection's
chains; see :mod:`loopstack.plugins.ws_deltas.chain_prompt`). The ``response`` middleware
:func:`commit_middleware` then watches the events and, when the response completes (or stops
at ``max_output_tokens``: it is stored and can be chained from), tokenizes its output and
caches the new chain under the response's id. It passes every event on at once and holds
nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from loopstack.items import FINAL_EVENT_TYPES
from loopstack.plugins.ws_deltas.chain_prompt import ChainPrompt, ChainPrompts, TokenState

if TYPE_CHECKING:
    from loopstack.api.pipeline import ResponseJob
    from loopstack.context import RequestContext
    from loopstack.types import Event, PromptRequest, ResponseHandler

__all__ = ["chain_prompt", "commit_middleware"]


def chain_prompt(state: TokenState, prompt: PromptRequest) -> ChainPrompt | None:
    """The prompt of a WebSocket request from ``state``, or None (an HTTP request, a template
    that cannot append exactly, an empty conversation): the server renders it whole."""
    if prompt.local is None:  # HTTP: no connection, the client resends every item anyway
        return None
    return ChainPrompts(state).build(prompt)


def commit_middleware(next_handler: ResponseHandler) -> ResponseHandler:
    async def handler(job: ResponseJob, ctx: RequestContext) -> AsyncIterator[Event]:
        answer = job.prepared.prompt
        prompts = answer.prompts if isinstance(answer, ChainPrompt) else None  # served from the token state
        async for event in next_handler(job, ctx):
            if prompts is not None and event.get("type") in FINAL_EVENT_TYPES:
                before = prompts.num_tokenized
                if prompts.commit(job.prepared, event["response"]) is not None:
                    ctx.observe("loopstack_ws_deltas_output_tokens_tokenized", prompts.num_tokenized - before,
                                help="output tokens tokenized to extend a chain")
            yield event
        if prompts is not None:
            ctx.count("loopstack_api_chain_prompts_total", help="prompts from the chain token state, by kind",
                      kind=prompts.kind)

    return handler
