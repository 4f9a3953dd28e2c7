"""The main job of ``loopstack demo``: one agent session through all three layers.

The API server runs on loopback over the embedded engine (the default stack, the real
SmolLM2 model); an :class:`~loopstack.harness.agent.Agent` talks to it over the Responses
API with two real tools — a Python function and the MCP notes server in ``examples/``
(stdio) — and two tasks in one session. Then it prints what each layer did:

* harness: turns, tool calls and their time, request bytes;
* API server: responses, and the model calls' time beyond the engine (HTTP, parsing,
  prompt rendering, grammar compilation);
* inference: prompt, cached and generated tokens, engine busy time, prefix-cache hit rate.

SmolLM2-135M picks tools poorly on its own, so each task forces its first call with
``tool_choice`` (the demo says which); the model writes the arguments and the answer.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from loopstack.harness.agent import Agent
from loopstack.harness.clients.http import ResponsesHTTPClient
from loopstack.harness.events import AgentEvent, Compacted, FinalAnswer, ModelCalled, ToolCalled
from loopstack.harness.tools.mcp import MCPServer
from loopstack.harness.tools.tool import Tool, python_tool

if TYPE_CHECKING:
    from loopstack.runtime import StackRuntime

NOTES_SERVER = Path(__file__).resolve().parents[2] / "examples" / "mcp_notes_server.py"
TASKS = (
    ("What's the weather in Paris right now?", "get_weather"),
    ("Save a note titled 'Paris' whose body is 'sunny, 18 C'.", "add_note"),
)


@python_tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"{city}: 18 degrees Celsius and sunny"


@dataclass
class _Totals:
    turns: int = 0
    model_seconds: float = 0.0
    request_bytes: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    tool_seconds: float = 0.0
    tool_calls: list[str] = field(default_factory=list)
    compactions: int = 0
    mcp_start_seconds: float = 0.0

    def add(self, event: AgentEvent) -> None:
        if isinstance(event, ModelCalled):
            self.turns += 1
            self.model_seconds += event.seconds
            self.request_bytes += event.request_bytes
            self.input_tokens += event.usage.input_tokens
            self.cached_tokens += event.usage.cached_tokens
            self.output_tokens += event.usage.output_tokens
        elif isinstance(event, ToolCalled):
            self.tool_seconds += event.seconds
            self.tool_calls.append(event.name)
        elif isinstance(event, Compacted):
            self.compactions += 1


def _describe(event: AgentEvent) -> str | None:
    if isinstance(event, ModelCalled):
        u = event.usage
        return (f"    model  <- {event.request_bytes:,} request bytes; {u.input_tokens} prompt tokens "
                f"({u.cached_tokens} cached), {u.output_tokens} generated, {event.seconds:.2f} s")
    if isinstance(event, ToolCalled):
        mark = "error" if event.is_error else "ok"
        return f"    tool   {event.name}({event.arguments}) -> {event.result_text[:70]!r} [{mark}, {event.seconds * 1000:.0f} ms]"
    if isinstance(event, FinalAnswer):
        return f"    answer {event.text[:160]!r}"
    return None


async def _session(base_url: str, say: Callable[[str], None], runtime: StackRuntime) -> _Totals:
    totals = _Totals()
    started = time.perf_counter()
    async with MCPServer.stdio(sys.executable, [str(NOTES_SERVER)], name="notes") as notes, \
            ResponsesHTTPClient(f"{base_url}/v1") as client:
        tools: list[Tool] = [get_weather, *await notes.list_tools()]
        totals.mcp_start_seconds = time.perf_counter() - started
        say(f"  tools: {', '.join(t.info.name for t in tools)} (get_weather: Python; the rest: MCP over stdio)")
        agent = Agent(client, tools, instructions="You are a helpful assistant. Use the tools.", max_turns=3,
                      max_output_tokens=64, context_window=8192, runtime=runtime)  # the server's stack: built once
        for task, first_tool in TASKS:
            say(f"\n  task: {task!r}  (first call forced: tool_choice={first_tool})")
            agent.tool_choice_first = {"type": "function", "name": first_tool}
            async for event in agent.stream(task):
                totals.add(event)
                line = _describe(event)
                if line:
                    say(line)
    return totals


def run_agent_demo(say: Callable[[str], None], stack_ref: str = "baseline") -> int:
    """Serve ``stack_ref``, run the session, print the per-layer report; 0 when it worked."""
    from loopstack.api.server import ServerThread, build_state, close_state
    from loopstack.engine import AsyncEngine

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        state = build_state(stack_ref, store_path=f"{folder}/responses.sqlite3")
        say(f"  engine: {state.model_name} loaded in {time.perf_counter() - started:.1f} s")
        engine = state.engine
        assert isinstance(engine, AsyncEngine)  # build_state serves the embedded engine
        server = ServerThread(state).start()
        try:
            say(f"  API server: {server.url} (Responses API over HTTP/SSE and WebSocket)")
            before = engine.statistics()
            session_started = time.perf_counter()
            totals = anyio.run(_session, server.url, say, state.live.current)
            wall = time.perf_counter() - session_started
            after = engine.statistics()
        finally:
            server.stop()
            close_state(state)
    engine_s = after["busy_s"] - before["busy_s"]
    queried = after["blocks"]["num_queried_tokens"] - before["blocks"]["num_queried_tokens"]
    hit = after["blocks"]["num_hit_tokens"] - before["blocks"]["num_hit_tokens"]
    say("\n  what each layer did")
    say(f"    harness    {totals.turns} model calls, {len(totals.tool_calls)} tool calls "
        f"({', '.join(totals.tool_calls) or 'none'}), {totals.compactions} compactions; "
        f"{totals.request_bytes:,} request bytes; tools {totals.tool_seconds:.2f} s, MCP server start-up "
        f"{totals.mcp_start_seconds:.2f} s, the loop itself "
        f"{max(wall - totals.model_seconds - totals.tool_seconds - totals.mcp_start_seconds, 0):.2f} s")
    say(f"    API        {totals.turns} responses; {max(totals.model_seconds - engine_s, 0):.2f} s beyond the engine "
        "(HTTP, request parsing, prompt rendering, grammar compile, streaming)")
    hit_rate = f"; block manager: {hit}/{queried} prompt tokens hit the prefix cache" if queried else ""
    say(f"    inference  {totals.input_tokens} prompt tokens, {totals.cached_tokens} from the prefix cache "
        f"({totals.cached_tokens / max(totals.input_tokens, 1):.0%}), {totals.output_tokens} generated; "
        f"engine busy {engine_s:.2f} s over {after['steps'] - before['steps']} steps{hit_rate}")
    say(f"    total      {wall:.1f} s for the session")
    return 0 if totals.tool_calls else 1
