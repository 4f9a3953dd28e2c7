"""Render only what a conversation appends, so that tokenizing it extends the full prompt exactly.

A chat template renders the conversation as a whole, so the text that new messages add
is found as a difference of two renders of a short *window*: the head (the system message
from ``instructions``, with the tools) plus the conversation's last message as context,
with and without the new messages. Every template loopstack serves renders append-only
(:func:`~loopstack.api.conversation.render_prompt`), and the window keeps what a message's
rendering may depend on (a default system prompt, the message before it).

Token ids are exact only where text is split next to a special token: tokenizers cut
special tokens out before anything else, so the text on either side is tokenized alone.
ChatML splits there (``<|im_end|>\\n`` | ``<|im_start|>...``). A split anywhere else, or a
template that fails the probe run at construction, makes :meth:`SuffixRenderer.suffix`
answer None and the caller renders and tokenizes the whole prompt instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from loopstack.api.conversation import FunctionTool, items_to_messages, render_prompt

__all__ = ["PromptSuffix", "SuffixRenderer"]

Message = Mapping[str, Any]

_PROBE_TOOL: dict[str, Any] = {"type": "function", "name": "probe_lookup", "description": "Look a word up.",
               "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}
_PROBE_ITEMS = [
    {"type": "message", "role": "user", "content": "Look up 'delta' and 'chain'."},
    {"type": "message", "role": "assistant", "content": "Looking both up."},
    {"type": "function_call", "call_id": "probe_1", "name": "probe_lookup", "arguments": json.dumps({"word": "delta"})},
    {"type": "function_call", "call_id": "probe_2", "name": "probe_lookup", "arguments": json.dumps({"word": "chain"})},
    {"type": "function_call_output", "call_id": "probe_1", "output": "a difference"},
    {"type": "function_call_output", "call_id": "probe_2", "output": "linked rings"},
    {"type": "message", "role": "assistant", "content": "Delta: a difference. Chain: linked rings."},
    {"type": "message", "role": "user", "content": "Thanks!"},
]


class PromptSuffix(NamedTuple):
    """Text that new messages add (``text``), and the generation prompt after them."""

    text: str
    generation: str


class SuffixRenderer:
    """Suffix rendering for one tokenizer and its chat template.

    ``is_exact`` is the probe's verdict: incremental token ids equal the full render's, token
    for token, on a conversation with instructions, tools, parallel calls and their results.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._specials = _special_tokens(tokenizer)
        self.is_exact = bool(self._specials) and self._probe()

    def is_clean_split(self, before: str, after: str) -> bool:
        """True when tokenizing ``before`` and ``after`` apart gives the ids of ``before + after``."""
        return not after or after.startswith(self._specials) or before.endswith(self._specials)

    def suffix(self, head: Sequence[Message], tools: Sequence[FunctionTool], context: Sequence[Message],
               new: Sequence[Message], *, generation: bool) -> PromptSuffix | None:
        """The text ``new`` adds after ``head + ... + context``, or None when it cannot be split exactly.

        Args:
            head: the messages the conversation starts with (the instructions' system message).
            tools: the request's tools (rendered in the head).
            context: the conversation's last message(s).
            new: the messages to append (from :func:`items_to_messages`).
            generation: also return the generation prompt that follows ``new``.
        """
        window = [*head, *context]
        base = render_prompt(self.tokenizer, window, tools, add_generation_prompt=False)
        extended = render_prompt(self.tokenizer, [*window, *new], tools, add_generation_prompt=False)
        if not extended.startswith(base) or not self.is_clean_split(base, extended[len(base):]):
            return None
        prompt = ""
        if generation:
            prompted = render_prompt(self.tokenizer, [*window, *new], tools, add_generation_prompt=True)
            if not prompted.startswith(extended) or not self.is_clean_split(extended, prompted[len(extended):]):
                return None
            prompt = prompted[len(extended):]
        return PromptSuffix(extended[len(base):], prompt)

    def _probe(self) -> bool:
        encode = self.tokenizer.encode
        for instructions, tools in (("Be brief.", [_PROBE_TOOL]), (None, []), (None, [_PROBE_TOOL])):
            try:
                function_tools = [FunctionTool(t["name"], t["description"], t["parameters"]) for t in tools]
                messages = items_to_messages(instructions, _PROBE_ITEMS)
                head = messages[:1] if instructions else []
                ids = encode(render_prompt(self.tokenizer, messages[:len(head) + 1], function_tools,
                                           add_generation_prompt=False))
                for end in range(len(head) + 2, len(messages) + 1):
                    step = self.suffix(head, function_tools, messages[end - 2:end - 1], messages[end - 1:end],
                                       generation=True)
                    if step is None:
                        return False
                    ids = ids + encode(step.text)
                    full = encode(render_prompt(self.tokenizer, messages[:end], function_tools))
                    if ids + encode(step.generation) != full:
                        return False
            except ValueError:  # no template, or it rejected the probe conversation
                return False
        return True


def _special_tokens(tokenizer: Any) -> tuple[str, ...]:
    backend = getattr(tokenizer, "backend", None)
    try:
        added = backend.get_added_tokens_decoder().values()  # type: ignore[union-attr]
    except AttributeError:
        return ()
    return tuple(token.content for token in added if token.special and token.content)
