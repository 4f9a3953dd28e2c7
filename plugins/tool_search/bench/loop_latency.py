"""The search's wait in a real agent loop, with ``embed_early`` on and off.

SmolLM2 (the embedded default model, through :class:`~loopstack.harness.clients.embedded.EmbeddedClient`:
the API layer, its streaming tool-call parser and the engine, in process) answers MetaTool
questions with a ``tool_search`` call over the 4,938-tool Docker MCP registry; the agent
then runs the search. The wait is the agent's own timing of that call (``ToolCalled.seconds``:
from the complete response to the search's result), the time the loop stands still.

Both arms run in one process on the same plugin, catalog and embedder, interleaved
question by question (the first arm alternates); the embedder's query cache is emptied
after every turn, so no search finds a vector another turn made. The 135M model sometimes
writes a query until ``max_output_tokens`` runs out; such a turn makes no search and is
counted as ``loop_incomplete``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from loopstack.harness.tools.tool import ToolResult
from loopstack.plugins.tool_search.search import SEARCH_TOOL_NAME
from loopstack.tools import ToolInfo

if TYPE_CHECKING:
    from loopstack.plugins.tool_search.plugin import ToolSearch
    from loopstack.runtime import StackRuntime

__all__ = ["LOOP_INSTRUCTIONS", "measure_loop_wait"]

LOOP_INSTRUCTIONS = "Call tool_search with a short query of a few words that says what the user wants to do."
ARMS = (("early", True), ("late", False))


class _CatalogTool:
    """A registry tool as the agent sees it; never called (the turn ends at the search)."""

    is_concurrency_safe = True

    def __init__(self, info: ToolInfo) -> None:
        self.info = info

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult("ok")


async def measure_loop_wait(runtime: StackRuntime, plugin: ToolSearch, infos: Sequence[ToolInfo],
                            questions: Sequence[str], *, max_output_tokens: int = 128) -> dict[str, float]:
    """Per arm (``_early``: embed_early on, ``_late``: off): the wait's p50, p90 and max in
    ms, the searches measured, the turns without a search, the share of searches that
    found their query's vector already made, and the model call's p50 in s.
    The first question warms both arms up and is not counted."""
    from loopstack.harness.agent import Agent
    from loopstack.harness.clients.embedded import EmbeddedClient
    from loopstack.harness.events import ModelCalled, ToolCalled

    embedder = plugin.embedder()
    if embedder is None:
        return {}
    tools = [_CatalogTool(info) for info in infos]
    waits: dict[str, list[float]] = {arm: [] for arm, _ in ARMS}
    model_s: dict[str, list[float]] = {arm: [] for arm, _ in ARMS}
    cached = dict.fromkeys(waits, 0)  # searches that found their query's vector already embedded
    incomplete = dict.fromkeys(waits, 0)
    original = plugin.config
    client = EmbeddedClient.from_stack("baseline")  # loads SmolLM2 once
    try:
        for index, question in enumerate(tqdm(questions, desc="  search wait in the loop (SmolLM2)", leave=False,
                                              unit="q")):
            for arm, early in (ARMS if index % 2 else ARMS[::-1]):
                plugin.config = original.model_copy(update={"embed_early": early})
                agent = Agent(client, tools, instructions=LOOP_INSTRUCTIONS, runtime=runtime, max_turns=1,
                              max_output_tokens=max_output_tokens,
                              tool_choice_first={"type": "function", "name": SEARCH_TOOL_NAME})
                wait = seconds = None
                hits = embedder.statistics().num_query_hits
                async for event in agent.stream(question):
                    if isinstance(event, ToolCalled) and event.name == SEARCH_TOOL_NAME:
                        wait = event.seconds * 1000
                    elif isinstance(event, ModelCalled):
                        seconds = event.seconds
                await plugin.worker.run(lambda: None)  # an early embed of a turn without a search ends first
                embedder.forget_queries()
                if index == 0:
                    continue
                if wait is None:
                    incomplete[arm] += 1
                else:
                    waits[arm].append(wait)
                    cached[arm] += embedder.statistics().num_query_hits > hits
                if seconds is not None:
                    model_s[arm].append(seconds)
    finally:
        plugin.config = original
        await client.aclose()
    figures: dict[str, float] = {}
    for arm, values in waits.items():
        tag = f"_{arm}.docker_registry"
        figures[f"loop_searches{tag}"] = float(len(values))
        figures[f"loop_incomplete{tag}"] = float(incomplete[arm])
        if values:
            figures[f"loop_query_cached{tag}"] = cached[arm] / len(values)
            ordered = sorted(values)
            figures[f"loop_search_ms_p50{tag}"] = statistics.median(ordered)
            figures[f"loop_search_ms_p90{tag}"] = ordered[int(0.9 * (len(ordered) - 1))]
            figures[f"loop_search_ms_max{tag}"] = ordered[-1]
        if model_s[arm]:
            figures[f"loop_model_call_s_p50{tag}"] = statistics.median(model_s[arm])
    return figures
