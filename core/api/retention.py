"""What a request asks of the engine's prefix cache: ``prompt_cache_retention`` /
``prompt_cache_options.ttl`` as the Responses API defines them, and the static prefix a stack may pin.

:func:`retention_for` asks the plugins (``loopstack_kv_retention``) with a
:class:`~loopstack.engine.cache_options.RetentionRequest`; the static prefix (the instructions, the
leading system and developer messages, and the tools, as rendered before the first turn) is counted
only if a plugin asks for it, and only as far as it is a prefix of the prompt token for token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loopstack.api.conversation import items_to_messages, normalize_tools, render_prompt
from loopstack.api.tool_calls.grammar import TOOL_CALL_OPEN
from loopstack.engine.cache_options import Retention, RetentionRequest

if TYPE_CHECKING:
    from loopstack.api.service import Prepared
    from loopstack.context import RequestContext

__all__ = ["PROMPT_CACHE_TTLS", "retention_for", "static_prefix_tokens"]

# prompt_cache_options.ttl values (a minimum cache lifetime) in seconds
PROMPT_CACHE_TTLS = {"30m": 1800.0, "12h": 43_200.0}
_STATIC_ROLES = ("system", "developer")


def static_prefix_tokens(prepared: Prepared, tokenizer: Any) -> int:
    """Leading prompt tokens that only the instructions, system messages and tools decide."""
    request = prepared.request
    leading = []
    for item in request.input_items() if not request.previous_response_id else []:
        if item.get("type", "message") != "message" or item.get("role") not in _STATIC_ROLES:
            break
        leading.append(item)
    if request.instructions is None and not leading and not request.tools:
        return 0
    text = render_prompt(tokenizer, items_to_messages(request.instructions, leading), normalize_tools(request.tools),
                         add_generation_prompt=False)
    static = tokenizer.encode(text)
    prompt = prepared.prompt_ids
    common = 0
    for mine, theirs in zip(static, prompt, strict=False):
        if mine != theirs:
            break
        common += 1
    # the last static token may merge with what follows in the full prompt: keep only what surely is
    return common if common == len(static) else max(0, common - 1)


def retention_for(prepared: Prepared, tokenizer: Any, ctx: RequestContext | None) -> Retention | None:
    if ctx is None:
        return None
    request = prepared.request
    ttl = request.prompt_cache_options.ttl if request.prompt_cache_options is not None else None
    ask = RetentionRequest(
        num_prompt_tokens=len(prepared.prompt_ids),
        prompt_cache_key=request.prompt_cache_key,
        prompt_cache_retention=request.prompt_cache_retention,
        prompt_cache_ttl_s=PROMPT_CACHE_TTLS.get(ttl) if ttl else None,
        static_prefix_tokens=lambda: static_prefix_tokens(prepared, tokenizer),
        # an agent request (it offers tools) answered without a call ends the agent's task
        tool_call_markers=(TOOL_CALL_OPEN,) if prepared.tool_names or prepared.search is not None else (),
    )
    return ctx.hooks.kv_retention(ask, ctx)
