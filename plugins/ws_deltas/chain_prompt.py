"""Prompt token ids of a request from its chain's token state: O(new items), not O(history).

:class:`TokenState` is what a server keeps (the ``ws_deltas`` plugin owns one per arm):
a :class:`~loopstack.plugins.ws_deltas.token_state.ChainTokenCache` and the suffix renderer of the
engine's tokenizer. Per request, a :class:`ChainPrompts` answers the ``loopstack_prompt_ids``
hook the server calls in ``prepare`` (:meth:`ChainPrompts.build`, from the
:class:`~loopstack.types.PromptRequest` it is given: the request, the tokenizer, readers of
the chain; it never calls the service back):

* the previous response's entry is in the cache, visible to this tenant (and connection, for
  ``store: false``), still in the store, and the request renders the same head
  (instructions, tools): only the new items and the generation prompt are rendered and
  tokenized, appended to the entry's ids (``kind = "delta"``);
* otherwise the chain is rebuilt from the store and tokenized whole, as without the cache
  (``kind = "full"``).

When the response completes, :meth:`ChainPrompts.commit` (the plugin's response middleware)
tokenizes its output and caches the new entry under the response's id. The resulting prompt ids equal, token for token,
those of a full render of the same conversation (the renderer's probe checks the template;
any split it cannot make exactly falls back to the full path).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loopstack.api.conversation import (
    ConversationError,
    FunctionTool,
    InvalidToolError,
    items_to_messages,
    normalize_tools,
    render_prompt,
)
from loopstack.api.errors import APIError
from loopstack.api.prompt_suffix import SuffixRenderer
from loopstack.plugins.ws_deltas.token_state import ChainTokenCache, ChainTokens, token_array

if TYPE_CHECKING:
    from loopstack.api.service import Prepared
    from loopstack.types import PromptRequest

__all__ = ["ChainPrompt", "ChainPrompts", "TokenState"]


@dataclass(frozen=True)
class ChainPrompt:
    """What :meth:`ChainPrompts.build` answers to ``loopstack_prompt_ids`` (a
    :class:`~loopstack.types.PromptIds`); ``prompts`` commits the response's output later."""

    prompt_ids: list[int]
    tools: list[FunctionTool]
    tool_items: list[Mapping[str, Any]]  # the chain's tool_search_output items, new ones included
    prompts: ChainPrompts = field(repr=False)

    @property
    def num_tokenized(self) -> int:
        """Tokens this request tokenized so far: the prompt's, then its output's once committed."""
        return self.prompts.num_tokenized


@dataclass
class _Pending:
    parent: ChainTokens | None
    segment: Any  # array of the tokens the request's input adds
    head: list[dict[str, Any]]
    tools: list[FunctionTool]
    tail: Mapping[str, Any] | None
    call_names: dict[str, str]
    render_key: str
    tool_items: tuple[Mapping[str, Any], ...]


class TokenState:
    """A server's token state: the chain cache plus the suffix renderer of its tokenizer."""

    def __init__(self, max_chains: int) -> None:
        self.cache = ChainTokenCache(max_chains)
        self._renderer: SuffixRenderer | None = None

    def renderer(self, tokenizer: Any) -> SuffixRenderer:
        """The renderer of ``tokenizer`` (probed once; another tokenizer empties the cache)."""
        if self._renderer is None or self._renderer.tokenizer is not tokenizer:
            if self._renderer is not None:
                self.cache = ChainTokenCache(self.cache.max_chains)
            self._renderer = SuffixRenderer(tokenizer)
        return self._renderer


def render_key(instructions: str | None, tools: Sequence[Any]) -> str:
    """What the head of a prompt depends on, hashed: entries extend only under the same key."""
    text = json.dumps([instructions, list(tools)], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _call_names(messages: Sequence[Mapping[str, Any]], names: dict[str, str]) -> dict[str, str]:
    for message in messages:
        for call in message.get("tool_calls") or ():
            names[call["id"]] = call["function"]["name"]
    return names


def _name_tool_results(messages: list[dict[str, Any]], names: Mapping[str, str]) -> None:
    # a full render names a tool result after the earlier call with its id (conversation.py);
    # a suffix sees only its own items, so the chain's names fill in the rest
    for message in messages:
        if message.get("role") == "tool" and "name" not in message and message.get("tool_call_id") in names:
            message["name"] = names[message["tool_call_id"]]


def _merges_into(tail: Mapping[str, Any] | None, items: Sequence[Mapping[str, Any]]) -> bool:
    # a function_call right after an assistant message joins that message: not an append
    if not items or tail is None:
        return False
    return tail.get("role") == "assistant" and items[0].get("type") == "function_call"


def _tool_items(items: Sequence[Mapping[str, Any]]) -> tuple[Mapping[str, Any], ...]:
    return tuple(item for item in items if isinstance(item, Mapping) and item.get("type") == "tool_search_output")


def _messages(items: Sequence[Mapping[str, Any]], instructions: str | None = None) -> list[dict[str, Any]]:
    try:
        return items_to_messages(instructions, items)
    except ConversationError as exc:
        raise APIError(str(exc), param="input", code="invalid_input") from None


class ChainPrompts:
    """One request's use of the token state (see the module doc).

    Attributes:
        kind: ``"delta"`` (appended to a cached chain), ``"full"`` (rendered whole), or
            ``"none"`` before ``prompt_ids`` ran or when the template cannot append exactly.
        num_tokenized: tokens this request tokenized (prompt, then output on commit).
        tokenize_seconds: time spent in the tokenizer for them.
    """

    def __init__(self, state: TokenState) -> None:
        self.state = state
        self.kind = "none"
        self.num_tokenized = 0
        self.tokenize_seconds = 0.0
        self._pending: _Pending | None = None
        self._renderer: SuffixRenderer | None = None

    def _encode(self, text: str) -> list[int]:
        assert self._renderer is not None
        started = time.perf_counter()
        ids = self._renderer.tokenizer.encode(text)
        self.tokenize_seconds += time.perf_counter() - started
        self.num_tokenized += len(ids)
        return ids

    def build(self, prompt: PromptRequest) -> ChainPrompt | None:
        """Prompt ids for ``prompt.request``, or None to let ``prepare`` render it as usual.

        Raises:
            APIError: what ``prepare`` would raise for the same request (bad items or tools,
                an unknown ``previous_response_id``).
        """
        request = prompt.request
        self._renderer = self.state.renderer(prompt.tokenizer)
        if not self._renderer.is_exact:
            return None
        try:
            tools = normalize_tools(request.tools)
        except InvalidToolError as exc:
            raise APIError(f"invalid tools: {exc}", param="tools", code="invalid_value") from None
        head = _messages([], request.instructions)
        key = render_key(request.instructions, request.tools)
        parent = self._parent(prompt, key)
        if parent is not None:
            answer = self._delta(parent, head, tools, key, request.input_items())
            if answer is not None:
                return answer
        return self._full(prompt, head, tools, key)

    def _parent(self, prompt: PromptRequest, key: str) -> ChainTokens | None:
        previous = prompt.request.previous_response_id
        if not previous:
            return None
        entry = self.state.cache.get(previous, tenant=prompt.tenant, local=prompt.local)
        if entry is None or entry.render_key != key:
            return None
        # every stored link must still be visible, as store.chain() would require: a deleted or
        # expired ancestor ends the chain (its text must not live on in the cached tokens)
        stored = [link.response_id for link in _links(entry) if link.is_stored]
        if not prompt.all_stored(stored):
            self.state.cache.discard(previous, tenant=prompt.tenant)
            return None
        return entry

    def _delta(self, parent: ChainTokens, head: list[dict[str, Any]], tools: list[FunctionTool], key: str,
               new_items: list[dict[str, Any]]) -> ChainPrompt | None:
        assert self._renderer is not None
        if _merges_into(parent.tail, new_items):
            return None
        new_messages = _messages(new_items)
        _name_tool_results(new_messages, parent.call_names)
        context = [parent.tail] if parent.tail is not None else []
        suffix = self._renderer.suffix(head, tools, context, new_messages, generation=True)
        if suffix is None:
            return None
        new_ids = self._encode(suffix.text)
        generation_ids = self._encode(suffix.generation)
        tail = new_messages[-1] if new_messages else parent.tail
        tool_items = (*parent.tool_items, *_tool_items(new_items))
        self._pending = _Pending(parent, token_array(new_ids), head, tools, tail,
                                 _call_names(new_messages, dict(parent.call_names)), key, tool_items)
        self.kind = "delta"
        return ChainPrompt(parent.token_ids() + new_ids + generation_ids, tools, list(tool_items), self)

    def _full(self, prompt: PromptRequest, head: list[dict[str, Any]], tools: list[FunctionTool],
              key: str) -> ChainPrompt | None:
        assert self._renderer is not None
        items = prompt.history() + prompt.request.input_items()
        messages = _messages(items, prompt.request.instructions)
        if not messages:
            return None
        text = render_prompt(self._renderer.tokenizer, messages, tools, add_generation_prompt=False)
        generation = self._renderer.suffix(head, tools, messages[-1:], [], generation=True)
        if generation is None or not self._renderer.is_clean_split(text, generation.generation):
            return None
        ids = self._encode(text)
        generation_ids = self._encode(generation.generation)
        tool_items = _tool_items(items)
        self._pending = _Pending(None, token_array(ids), head, tools, messages[-1], _call_names(messages, {}), key,
                                 tool_items)
        self.kind = "full"
        return ChainPrompt(ids + generation_ids, tools, list(tool_items), self)

    def commit(self, prepared: Prepared, response: Mapping[str, Any]) -> ChainTokens | None:
        """Append the completed ``response``'s output to the chain and cache it under its id."""
        pending, self._pending = self._pending, None
        output = list(response.get("output") or [])
        if pending is None or self._renderer is None or _merges_into(pending.tail, output):
            return None
        try:
            out_messages = items_to_messages(None, output)
        except ConversationError:
            return None
        _name_tool_results(out_messages, pending.call_names)
        suffix = self._renderer.suffix(pending.head, pending.tools, [pending.tail] if pending.tail else [],
                                       out_messages, generation=False)
        if suffix is None:
            return None
        segment = pending.segment
        segment.extend(self._encode(suffix.text))
        entry = ChainTokens.extend(
            pending.parent, segment, response_id=prepared.response_id, tenant=prepared.principal.tenant,
            render_key=pending.render_key, request_fields=prepared.request.non_input_fields(),
            tail=out_messages[-1] if out_messages else pending.tail,
            call_names=_call_names(out_messages, pending.call_names), is_stored=prepared.request.store,
            tool_items=pending.tool_items,
        )
        self.state.cache.put(entry)
        return entry


def _links(entry: ChainTokens) -> list[ChainTokens]:
    links: list[ChainTokens] = []
    current: ChainTokens | None = entry
    while current is not None:
        links.append(current)
        current = current.parent
    return links
