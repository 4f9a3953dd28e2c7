"""Workload ``kernel``: what the plugin kernel itself costs per request.

Each request does what every served request does before any technique runs: get a
context (sticky A/B assignment), ask the visible-tools and prepare-request hooks, and
pass through the composed model-middleware chain to an endpoint that returns at once.
Comparing stacks shows the per-request price of the plugins they enable; an "off"
arm should cost what an absent plugin costs.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from loopstack.bench.workload import BenchOptions, Workload
from loopstack.catalog import PluginCatalog
from loopstack.context import Session
from loopstack.runtime import StackRuntime
from loopstack.stack.schema import ResolvedStack
from loopstack.tools import ToolInfo, ToolSet

REQUESTS_PER_STEP = 2000
NUM_SESSIONS = 64


async def _endpoint(request: dict[str, Any], ctx: Any) -> AsyncIterator[dict[str, Any]]:
    yield {"type": "response.completed"}


class KernelOverheadWorkload(Workload):
    name = "kernel"
    description = "per-request cost of the plugin kernel: arm assignment, hooks, middleware chain"
    default_steps = 10

    def __init__(self) -> None:
        self._runtimes: dict[str, StackRuntime] = {}
        self._tools = [ToolInfo(name=f"tool_{i}", description=f"tool number {i}") for i in range(20)]
        self._requests = REQUESTS_PER_STEP

    async def setup(self, columns: list[str], stacks: list[ResolvedStack], options: BenchOptions) -> None:
        catalog = PluginCatalog.discover()
        if options.quick:
            self._requests = 200
        for column, stack in zip(columns, stacks):
            self._runtimes[column] = StackRuntime(stack, catalog)

    async def step(self, column: str, index: int) -> dict[str, float]:
        runtime = self._runtimes[column]
        sessions = [Session(id=f"session-{i}") for i in range(NUM_SESSIONS)]
        request: dict[str, Any] = {"input": [{"role": "user", "content": "hi"}]}
        started = time.perf_counter()
        for i in range(self._requests):
            ctx = runtime.context(session=sessions[i % NUM_SESSIONS])
            ctx.hooks.visible_tools(tools=ToolSet(self._tools), ctx=ctx)
            ctx.hooks.prepare_request(request=request, ctx=ctx)
            async for _ in ctx.chain("model", _endpoint)(request, ctx):
                pass
        elapsed = time.perf_counter() - started
        return {
            "request_overhead_us": elapsed / self._requests * 1e6,
            "plugins_active": float(len(runtime.active_plugins)),
        }

    async def teardown(self) -> None:
        for runtime in self._runtimes.values():
            runtime.close()

    def config(self) -> dict[str, Any]:
        return {"requests_per_step": self._requests, "sessions": NUM_SESSIONS, "tools": len(self._tools)}
