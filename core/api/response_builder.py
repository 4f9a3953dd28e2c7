"""Turn an engine token stream into Responses API events and the final response object.

The builder is fed text deltas (already split into plain text and tool calls by the
tool-call stream parser) and emits the event sequence the OpenAI SDK expects::

    response.created, response.in_progress,
    response.output_item.added (message), response.content_part.added,
    response.output_text.delta ..., response.output_text.done, response.content_part.done,
    response.output_item.done,
    response.output_item.added (function_call), response.function_call_arguments.delta ...,
    response.function_call_arguments.done, response.output_item.done, ...
    response.completed | response.incomplete | response.failed

A call's item opens as soon as the model has written its name (:meth:`function_call_begin`)
and its arguments stream as the model writes them (:meth:`function_call_arguments`); the
``.done`` events carry the arguments as normalized JSON, which is what the response keeps.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from loopstack.api.ids import new_id


class ResponseBuilder:
    """Accumulates one response; every method returns the events to send, in order."""

    def __init__(self, response_id: str, request_echo: dict[str, Any],
                 namespaced: Mapping[str, tuple[str, str]] | None = None) -> None:
        """``namespaced``: the model's name of each namespace tool's function -> (namespace, name)."""
        self.response_id = response_id
        self.namespaced = dict(namespaced or {})
        self.created_at = int(time.time())
        self.echo = request_echo
        self.output: list[dict[str, Any]] = []
        self._sequence = 0
        self._message: dict[str, Any] | None = None
        self._text: list[str] = []
        self._call: dict[str, Any] | None = None  # the function call whose arguments are streaming

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def snapshot(self, status: str, *, usage: dict | None = None, error: dict | None = None,
                 incomplete: dict | None = None) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "output": list(self.output),
            "usage": usage,
            **self.echo,
        }

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.snapshot("in_progress")),
            self._event("response.in_progress", response=self.snapshot("in_progress")),
        ]

    def text(self, delta: str) -> list[dict[str, Any]]:
        if not delta:
            return []
        events = []
        if self._message is None:
            self._message = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                             "content": []}
            self._text = []
            index = len(self.output)
            self.output.append(self._message)
            events.append(self._event("response.output_item.added", output_index=index, item=dict(self._message)))
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(self._event("response.content_part.added", item_id=self._message["id"], output_index=index,
                                      content_index=0, part=part))
        self._text.append(delta)
        events.append(self._event("response.output_text.delta", item_id=self._message["id"],
                                  output_index=len(self.output) - 1, content_index=0, delta=delta, logprobs=[]))
        return events

    def _close_message(self) -> list[dict[str, Any]]:
        if self._message is None:
            return []
        message, self._message = self._message, None
        index = self.output.index(message)
        text = "".join(self._text).strip()
        part = {"type": "output_text", "text": text, "annotations": []}
        message.update(status="completed", content=[part])
        return [
            self._event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                        text=text, logprobs=[]),
            self._event("response.content_part.done", item_id=message["id"], output_index=index, content_index=0,
                        part=part),
            self._event("response.output_item.done", output_index=index, item=dict(message)),
        ]

    def function_call_begin(self, name: str) -> list[dict[str, Any]]:
        """Open a function call item whose arguments will stream."""
        events = self._close_message()
        self._call = {"type": "function_call", "id": new_id("fc"), "call_id": new_id("call"), "name": name,
                      "arguments": "", "status": "in_progress"}
        if name in self.namespaced:  # a namespace tool's function: the API names it in two fields
            self._call["namespace"], self._call["name"] = self.namespaced[name]
        self.output.append(self._call)
        events.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                  item=dict(self._call)))
        return events

    def function_call_arguments(self, delta: str) -> list[dict[str, Any]]:
        """More of the open call's arguments, as the model wrote them."""
        if self._call is None or not delta:
            return []
        return [self._event("response.function_call_arguments.delta", item_id=self._call["id"],
                            output_index=self.output.index(self._call), delta=delta)]

    def function_call_abandon(self) -> list[dict[str, Any]]:
        """The open call did not parse after all (its text follows as message text): its
        item ends ``incomplete``. It keeps its output index while the response streams (a
        client's items stay where it was told they are) and leaves the output at
        :meth:`finish`."""
        if self._call is None:
            return []
        item, self._call = self._call, None
        item["status"] = "incomplete"
        return [self._event("response.output_item.done", output_index=self.output.index(item), item=dict(item))]

    def apply(self, kind: str, value: Any) -> list[dict[str, Any]]:
        """The events of one :class:`~loopstack.api.tool_calls.parser.ToolCallStreamParser` output
        (``text``, ``call_begin``, ``call_arguments``, ``call_abandon`` or ``call``)."""
        if kind == "text":
            return self.text(value)
        if kind == "call_begin":
            return self.function_call_begin(value)
        if kind == "call_arguments":
            return self.function_call_arguments(value)
        if kind == "call_abandon":
            return self.function_call_abandon()
        return self.function_call(value.name, value.arguments)

    def function_call(self, name: str, arguments: str) -> list[dict[str, Any]]:
        """A complete call: closes the open one (its ``.done`` events), or adds it whole."""
        item: dict[str, Any] | None
        if self._call is not None:
            item, self._call = self._call, None
            index = self.output.index(item)
            events = []
        else:
            events = self.function_call_begin(name)
            item, self._call = self._call, None
            assert item is not None
            index = len(self.output) - 1
            events += [self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=index, delta=arguments)]
        item.update(name=self.namespaced.get(name, (None, name))[1], arguments=arguments,
                    status="completed")  # the parsed call's, as the response's
        events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=name, arguments=arguments))
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def server_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """An item the server made whole (a hosted search's call and output): added, then done."""
        events = self._close_message()
        self.output.append(item)
        index = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=index,
                                  item={**item, "status": "in_progress"}))
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def finish(self, usage: dict[str, Any], *, truncated: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        events = self._close_message()
        # a message whose text was only whitespace is dropped rather than sent empty, and so is
        # a call abandoned mid-stream
        self.output = [i for i in self.output if not (i["type"] == "message" and not i["content"][0]["text"])
                       and not (i["type"] == "function_call" and i["status"] == "incomplete")]
        if truncated:
            response = self.snapshot("incomplete", usage=usage, incomplete={"reason": "max_output_tokens"})
            events.append(self._event("response.incomplete", response=response))
        else:
            response = self.snapshot("completed", usage=usage)
            events.append(self._event("response.completed", response=response))
        return events, response

    def fail(self, message: str, code: str = "server_error") -> tuple[list[dict[str, Any]], dict[str, Any]]:
        response = self.snapshot("failed", error={"code": code, "message": message})
        return [self._event("response.failed", response=response)], response


def usage_of(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }
