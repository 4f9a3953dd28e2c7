"""Tool calls as the model writes them: streamed events in, ``loopstack_tool_call_delta`` out.

The server opens a ``function_call`` item as soon as the model has written the tool's name
and streams its arguments (``response.function_call_arguments.delta``). A client that
receives those events passes each one to :func:`observe_stream_event`, which keeps the
arguments written so far per call (a :class:`StreamedCall`) and tells the stack's plugins,
so one can start work on a call before it is complete (``tool_search`` embeds its query).
The complete call still arrives in the final response; this is only a head start.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loopstack.types import StateKey

if TYPE_CHECKING:

    from loopstack.context import RequestContext

__all__ = ["CALL_STREAMS", "CallStreams", "StreamedCall", "observe_stream_event"]

log = logging.getLogger(__name__)


@dataclass
class StreamedCall:
    """A tool call the model is still writing.

    ``arguments`` is the text written so far (the model's own, usually not yet valid JSON),
    joined on first read after each delta: a hook that looks only at ``name`` costs nothing
    per delta, even for a call whose arguments run to megabytes.
    """

    call_id: str
    name: str
    delta: str = ""  # the piece that arrived last
    _pieces: list[str] = field(default_factory=list, repr=False)
    _joined: str = field(default="", repr=False)
    _num_joined: int = field(default=0, repr=False)

    def add(self, delta: str) -> None:
        """One more piece of the arguments (it becomes ``delta``)."""
        self.delta = delta
        self._pieces.append(delta)

    @property
    def arguments(self) -> str:
        if self._num_joined < len(self._pieces):
            self._joined += "".join(self._pieces[self._num_joined :])
            self._num_joined = len(self._pieces)
        return self._joined


@dataclass
class CallStreams:
    """The calls of one request whose arguments are streaming, by item id."""

    open: dict[str, StreamedCall] = field(default_factory=dict)
    wanted: bool | None = None  # whether any plugin of this request implements the hook
    num_failures: int = 0


CALL_STREAMS = StateKey("loopstack.call_stream", CallStreams)
"""Per request: the calls whose arguments are streaming (kept only while a plugin listens)."""


def _streams(ctx: RequestContext) -> CallStreams | None:
    """This request's record, or None when no plugin listens (nothing is kept then)."""
    streams = ctx.state(CALL_STREAMS)
    if streams.wanted is None:
        caller = ctx.hooks.caller("loopstack_tool_call_delta")
        streams.wanted = bool(caller.get_hookimpls())
    return streams if streams.wanted else None


def _function_call(event: dict[str, Any]) -> dict[str, Any] | None:
    item = event.get("item")
    return item if isinstance(item, dict) and item.get("type") == "function_call" else None


def observe_stream_event(ctx: RequestContext, event: dict[str, Any]) -> None:
    """Follow one Responses stream event; a streamed call's argument delta calls the stack's
    ``loopstack_tool_call_delta`` hook with the call so far. Never raises: a plugin's
    failure is logged (once per request) and the stream goes on."""
    kind = event.get("type")
    if kind == "response.output_item.added":
        item = _function_call(event)
        if item is not None and isinstance(item.get("id"), str) and (streams := _streams(ctx)) is not None:
            streams.open[item["id"]] = StreamedCall(str(item.get("call_id", "")), str(item.get("name", "")))
    elif kind == "response.function_call_arguments.delta":
        streams = _streams(ctx)
        call = streams.open.get(str(event.get("item_id"))) if streams is not None else None
        if streams is None or call is None or not event.get("delta"):
            return
        call.add(str(event["delta"]))
        try:
            ctx.hooks.tool_call_delta(call=call, ctx=ctx)
        except Exception:  # a head start must never fail the model call
            streams.num_failures += 1
            if streams.num_failures == 1:
                log.warning("a loopstack_tool_call_delta hook failed; the call goes on", exc_info=True)
    elif kind == "response.output_item.done":
        item = _function_call(event)
        if item is not None and (streams := _streams(ctx)) is not None:
            streams.open.pop(str(item.get("id")), None)
