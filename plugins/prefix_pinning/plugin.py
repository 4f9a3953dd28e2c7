"""The ``prefix_pinning`` plugin: every request of a session starts with the previous one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loopstack.context import RequestContext
from loopstack.harness.prefix_detector import prefix_policy
from loopstack.hookspecs import hookimpl
from loopstack.items import message_item
from loopstack.plugin import Layer, Plugin
from loopstack.plugins.prefix_pinning.canonical import canonical_json, first_seen_key, sort_keys_deep, sorted_key
from loopstack.plugins.prefix_pinning.config import PrefixPinningConfig
from loopstack.plugins.prefix_pinning.volatile import context_item, round_times, split_volatile_lines
from loopstack.tools import ToolSet
from loopstack.types import StateKey

__all__ = ["SESSION_PINS", "PrefixPinning", "SessionPins"]


@dataclass
class SessionPins:
    """Per-session pins.

    Attributes:
        tool_positions: the first-seen position of every tool name (``tool_order = "first_seen"``).
        context_items: each context item sent, with its place: the number of the harness's own
            items before it. Re-inserted there in every later request (history is append-only).
        num_items_seen: the harness's item count at the last request (fewer now: a compaction).
        last_lines: the volatile lines of the newest context item.
    """

    tool_positions: dict[str, int] = field(default_factory=dict)
    context_items: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    num_items_seen: int = 0
    last_lines: tuple[str, ...] = ()


SESSION_PINS = StateKey("prefix_pinning", SessionPins)
"""Per session: the plugin's :class:`SessionPins`."""


def _with_context(items: list[dict[str, Any]], context_items: list[tuple[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    by_place: dict[int, list[dict[str, Any]]] = {}
    for place, item in context_items:
        by_place.setdefault(place, []).append(item)
    merged: list[dict[str, Any]] = []
    for index in range(len(items) + 1):
        merged.extend(by_place.get(index, ()))
        if index < len(items):
            merged.append(items[index])
    return merged


class PrefixPinning(Plugin):
    """Canonical, append-only requests so the engine's prefix cache keeps hitting.

    * tools in a pinned order (``tool_order``), each schema with sorted keys;
    * volatile lines of the instructions moved into a context item appended to the history
      whenever their values change (or rounded in place);
    * the body serialized as canonical JSON (sorted keys, fixed separators);
    * ``prompt_cache_key`` = the session id unless the harness set one.

    The hooks run last (``trylast``), after other plugins have shaped the request. The
    prefix-break detector (:mod:`loopstack.harness.prefix_detector`) runs with or without
    this plugin; with it, ``strict = true`` makes any break an error.
    """

    name = "prefix_pinning"
    layers = (Layer.HARNESS, Layer.API)
    Config = PrefixPinningConfig
    summary = "Canonical, append-only requests so the engine's prefix cache keeps hitting."

    config: PrefixPinningConfig

    @hookimpl(trylast=True)
    def loopstack_visible_tools(self, tools: ToolSet, ctx: RequestContext) -> None:
        if self.config.tool_order == "sorted":
            tools.pin_order(sorted_key)
        else:
            pins = ctx.session.state(SESSION_PINS)
            tools.pin_order(first_seen_key(pins.tool_positions, list(tools)))

    @hookimpl(trylast=True)
    def loopstack_prepare_request(self, request: dict[str, Any], ctx: RequestContext) -> None:
        if request.get("tools"):
            request["tools"] = [sort_keys_deep(tool) for tool in request["tools"]]
        policy = prefix_policy(ctx)
        policy.strict = self.config.strict
        policy.volatile_patterns = tuple(self.config.volatile_patterns)
        instructions = request.get("instructions")
        if isinstance(instructions, str) and instructions:
            self._pin_instructions(request, instructions, ctx)
        request.setdefault("prompt_cache_key", ctx.session.id)

    def _pin_instructions(self, request: dict[str, Any], instructions: str, ctx: RequestContext) -> None:
        if self.config.volatile == "round":
            request["instructions"] = round_times(instructions, self.config.round_to)
            return
        if self.config.volatile != "append":
            return
        split = split_volatile_lines(instructions, self.config.volatile_patterns)
        pins = ctx.session.state(SESSION_PINS)
        if not split.moved and not pins.context_items:
            return
        items = request.get("input") or []
        items = [message_item("user", items)] if isinstance(items, str) else list(items)
        if len(items) < pins.num_items_seen:
            # the history was rewritten (an explicit compaction): earlier places are gone
            pins.context_items.clear()
            pins.last_lines = ()
        pins.num_items_seen = len(items)
        if split.moved and split.moved != pins.last_lines:
            # appended once, where the value changed, and kept there: the history stays append-only
            pins.context_items.append((len(items), context_item(split.moved)))
            pins.last_lines = split.moved
            ctx.count("prefix_pinning_context_items_total",
                      help="context items appended because a volatile value in the instructions changed")
        request["instructions"] = split.stable
        request["input"] = _with_context(items, pins.context_items)

    @hookimpl
    def loopstack_serialize_request(self, request: dict[str, Any], ctx: RequestContext) -> bytes:
        return canonical_json(request)
