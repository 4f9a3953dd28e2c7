"""``unstable_harness``: a fault injector that breaks the prefix the way real harnesses do.

Not a technique and not discovered: tests and the ``prefix`` bench add it to a catalog
(``catalog.add_plugin(UnstableHarness)``) to reproduce two common bugs:

* MCP tools kept in an unordered collection, so their order changes from turn to turn
  (hash randomization across processes; tools re-listed after a reconnect);
* the current date and time written into the instructions (a session clock that advances
  ``seconds_per_turn`` per request, as real turns take tens of seconds).

Its hooks run before ``prefix_pinning``'s (which are ``trylast``), so with pinning on the
request is repaired; with it off the detector sees every break.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import Field

from loopstack.context import RequestContext
from loopstack.hookspecs import hookimpl
from loopstack.plugin import Layer, Plugin, PluginConfig
from loopstack.tools import ToolSet
from loopstack.types import StateKey

__all__ = ["UnstableHarness", "UnstableHarnessConfig"]

class UnstableHarnessConfig(PluginConfig):
    shuffle_tools: bool = Field(True, description="reorder the tools at random for every request")
    clock_in_instructions: bool = Field(True, description="append 'Current date and time: ...' to the instructions")
    start: str = Field("2026-11-29T10:15:42", description="the session clock's first reading (UTC, ISO)")
    seconds_per_turn: float = Field(37.0, ge=0, description="how far the session clock moves per request")
    seed: int = 0


@dataclass
class _SessionClock:
    num_requests: int = 0


STATE_KEY = StateKey("unstable_harness.clock", _SessionClock)


class UnstableHarness(Plugin):
    name = "unstable_harness"
    layers = (Layer.HARNESS,)
    Config = UnstableHarnessConfig
    summary = "Fault injector for tests and benches: tools in random order, a clock in the instructions."

    config: UnstableHarnessConfig

    @hookimpl
    def loopstack_visible_tools(self, tools: ToolSet, ctx: RequestContext) -> None:
        clock = ctx.session.state(STATE_KEY)
        clock.num_requests += 1
        if not self.config.shuffle_tools:
            return
        names = sorted(tools.names())
        random.Random(f"{self.config.seed}/{ctx.session.id}/{clock.num_requests}").shuffle(names)
        position = {name: index for index, name in enumerate(names)}
        tools.pin_order(lambda tool: position[tool.name])

    @hookimpl
    def loopstack_prepare_request(self, request: dict[str, Any], ctx: RequestContext) -> None:
        if not self.config.clock_in_instructions:
            return
        clock = ctx.session.state(STATE_KEY)
        start = datetime.fromisoformat(self.config.start).replace(tzinfo=UTC)
        now = start + timedelta(seconds=self.config.seconds_per_turn * max(clock.num_requests - 1, 0))
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        request["instructions"] = f"{request.get('instructions') or ''}\n\nCurrent date and time: {stamp}".lstrip("\n")
