"""Fit a conversation into the model's context window, explicitly.

When the agent's next request would pass ``compact_at`` of the context window,
:func:`compact` rewrites the history in two stages, oldest first, until it fits the
target (``target`` of the window):

1. **elide** old tool outputs: the output text of a ``function_call_output`` is replaced by
   a one-line marker saying how many characters were dropped (the call stays, so the model
   still sees what it did);
2. **drop** old turns whole: an assistant turn's messages, calls and outputs go together
   (a call is never left without its output).

A tool search's ``tool_search_output`` keeps its loaded ``tools`` through both stages (its
text is elided, the item and its call stay), so the tools it loaded remain callable.

The instructions, every user message and the last ``keep_recent_turns`` turns are never
touched. The agent reports each compaction as one :class:`~loopstack.harness.events.Compacted`
event and counts it in ``loopstack_harness_compactions_total``: history is rewritten only
here, never silently (a prefix-cache break that prefix pinning can attribute).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Compaction", "compact", "estimate_tokens"]

TokenCounter = Callable[[str], int]

_OUTPUT_TYPES = ("function_call_output", "tool_search_output")


def estimate_tokens(text: str) -> int:
    """A tokenizer-free upper-side estimate: about 3 characters per token (English and code
    run 3.5-4.5 with BPE vocabularies; erring high compacts a little early, never late)."""
    return len(text) // 3 + 1


def _is_model_output(item: dict[str, Any]) -> bool:
    kind = item.get("type", "message")
    return kind == "function_call" or (kind == "message" and item.get("role") == "assistant")


def _is_user_message(item: dict[str, Any]) -> bool:
    return item.get("type", "message") == "message" and item.get("role") in ("user", "system", "developer")


def _turn_starts(items: Sequence[dict[str, Any]]) -> list[int]:
    return [i for i, item in enumerate(items) if _is_model_output(item) and (i == 0 or not _is_model_output(items[i - 1]))]


@dataclass(frozen=True)
class Compaction:
    """The compacted items and what it cost: items elided or dropped, tokens before/after."""

    items: list[dict[str, Any]]
    num_elided: int
    num_dropped: int
    tokens_before: int
    tokens_after: int

    @property
    def changed(self) -> bool:
        return bool(self.num_elided or self.num_dropped)


def _tokens(items: Sequence[dict[str, Any]], fixed: int, count: TokenCounter) -> int:
    return fixed + sum(count(json.dumps(item, ensure_ascii=False)) for item in items)


def compact(items: Sequence[dict[str, Any]], *, fixed_tokens: int, budget: int, keep_recent_turns: int = 2,
            count_tokens: TokenCounter = estimate_tokens) -> Compaction:
    """Compact ``items`` until they fit ``budget`` tokens (``fixed_tokens``: instructions and
    tool schemas, which are not touched). Returns the items unchanged when they already fit
    or nothing old enough is left to compact."""
    work = [dict(item) for item in items]
    before = after = _tokens(work, fixed_tokens, count_tokens)
    starts = _turn_starts(work)
    protected_from = starts[-keep_recent_turns] if keep_recent_turns and len(starts) >= keep_recent_turns else (
        starts[0] if starts else len(work))
    if keep_recent_turns == 0:
        protected_from = len(work)
    elided = dropped = 0
    for index in range(protected_from):  # stage 1: elide old tool outputs, oldest first
        if after <= budget:
            break
        item = work[index]
        if item.get("type") in _OUTPUT_TYPES and not str(item.get("output", "")).startswith("[compacted"):
            old = count_tokens(json.dumps(item, ensure_ascii=False))
            size = len(str(item.get("output", "")))
            item["output"] = f"[compacted: {size} characters of tool output dropped to fit the context window]"
            elided += 1  # a tool_search_output keeps its "tools": they stay callable
            after += count_tokens(json.dumps(item, ensure_ascii=False)) - old
    if after > budget:  # stage 2: drop old turns whole (model outputs and their tool outputs)
        bounds = [*(i for i in starts if i < protected_from), protected_from]
        # a search's call and output stay (elided): the tools it loaded must remain callable
        searches = {item.get("call_id") for item in work if item.get("type") == "tool_search_output"}
        gone: set[int] = set()
        for begin, end in zip(bounds, bounds[1:]):
            if after <= budget:
                break
            for index in range(begin, end):
                item = work[index]
                if not _is_user_message(item) and item.get("call_id") not in searches:
                    after -= count_tokens(json.dumps(item, ensure_ascii=False))
                    gone.add(index)
        dropped = len(gone)
        work = [item for index, item in enumerate(work) if index not in gone]
    if not (elided or dropped):
        return Compaction(list(items), 0, 0, before, before)
    return Compaction(work, elided, dropped, before, _tokens(work, fixed_tokens, count_tokens))
