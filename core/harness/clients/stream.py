"""One reader of a response's event stream, for every client that receives one.

The HTTP client's SSE path, the WebSocket client and the embedded client each get a
response as Responses stream events; each hands every event, in order, to a
:class:`ResponseStreamReader`, which

* follows tool calls as the model writes them (``loopstack_tool_call_delta``, through
  :func:`~loopstack.harness.call_stream.observe_stream_event`);
* passes output text deltas to ``on_text_delta``;
* returns the response of the final event (``response.completed`` / ``response.incomplete``);
* turns ``response.failed`` and ``error`` events into :class:`ModelClientError`.

How the events arrive (SSE lines, WebSocket frames, an in-process iterator) and how their
bytes are counted stays with each client.

Example::

    reader = ResponseStreamReader(ctx, on_text_delta, failed_status=500, error_status=400)
    async for event in events:
        if (response := reader.feed(event)) is not None:
            return response
    raise reader.ended_early(500)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loopstack.harness.call_stream import observe_stream_event
from loopstack.harness.clients.base import ModelClientError, TextCallback
from loopstack.items import FINAL_EVENT_TYPES

if TYPE_CHECKING:
    from loopstack.context import RequestContext

__all__ = ["ResponseStreamReader"]

_TEXT_DELTA = "response.output_text.delta"


class ResponseStreamReader:
    """Reads the events of one response (see the module doc).

    Args:
        ctx: the request (its plugins follow streamed tool calls).
        on_text_delta: receives each piece of output text; None ignores them.
        failed_status: the status of the error a ``response.failed`` event raises.
        error_status: the status of the error an ``error`` event without its own raises.
    """

    __slots__ = ("ctx", "on_text_delta", "failed_status", "error_status", "response")

    def __init__(self, ctx: RequestContext, on_text_delta: TextCallback | None = None, *,
                 failed_status: int = 500, error_status: int = 500) -> None:
        self.ctx = ctx
        self.on_text_delta = on_text_delta
        self.failed_status = failed_status
        self.error_status = error_status
        self.response: dict[str, Any] | None = None  # set by the final event

    def feed(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """Follow one event; the response when it is the final one, else None.

        Raises:
            ModelClientError: a ``response.failed`` event (status ``failed_status``) or an
                ``error`` event (its own ``status``, else ``error_status``).
        """
        observe_stream_event(self.ctx, event)
        kind = event.get("type")
        if kind == _TEXT_DELTA:
            if self.on_text_delta is not None:
                self.on_text_delta(event.get("delta", ""))
            return None
        if kind in FINAL_EVENT_TYPES:
            self.response = event["response"]
            return self.response
        if kind == "response.failed":
            error = event["response"].get("error") or {}
            raise ModelClientError(self.failed_status, str(error.get("message") or "generation failed"),
                                   error.get("code"))
        if kind == "error":
            error = event.get("error") or {}
            raise ModelClientError(int(event.get("status") or self.error_status),
                                   str(error.get("message") or "the server sent an error event"), error.get("code"))
        return None

    def ended_early(self, status: int) -> ModelClientError:
        """The error for a stream that ended before its final event (to raise)."""
        return ModelClientError(status, "the event stream ended without a final response")
