"""The agent loop: model call, tool calls, repeat until the model answers in text.

The conversation is a list of Responses API items, append-only: the user's task, the
model's output items, one ``function_call_output`` per call. Each turn builds a
Responses request from it, lets plugins shape the request (``loopstack_visible_tools``,
``loopstack_extra_tools``, ``loopstack_prepare_request``), and sends it through the
``model`` middleware chain; every tool call goes through the ``tool`` chain.

Middleware contracts (the agent holds its model chain, a :class:`loopstack.middleware.Chain`
around its own client; tool calls, its own and plugins' (:func:`dispatch_tool_call`), share
one tool chain):

* model: ``handler(request: dict, ctx)`` is an async generator; its last final event
  (:data:`loopstack.items.FINAL_EVENT_TYPES`: ``{"type": "response.completed", "response":
  {...}}``) carries the response. Middlewares may yield other events; the loop ignores them.
* tool: ``await handler(call: ToolCall, ctx) -> ToolResult``.

Example::

    async with ResponsesHTTPClient("http://127.0.0.1:8321/v1") as client:
        agent = Agent(client, [get_weather], instructions="Use tools.", tool_choice_first="required")
        result = await agent.run("What's the weather in Paris?")
        print(result.final_text)
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast, runtime_checkable

import anyio

from loopstack.catalog import PluginCatalog
from loopstack.context import RequestContext, Session
from loopstack.harness.clients.base import (
    ModelClient,
    TextCallback,
    last_request_bytes,
    serialize_request,
)
from loopstack.harness.compaction import TokenCounter, compact, estimate_tokens
from loopstack.harness.events import (
    AgentEvent,
    Compacted,
    FinalAnswer,
    ModelCalled,
    ToolCalled,
    TurnLimitReached,
    TurnStarted,
    Usage,
)
from loopstack.harness.prefix_detector import check_request as check_prefix
from loopstack.harness.tools.tool import Tool, ToolResult
from loopstack.items import (
    FINAL_EVENT_TYPES,
    Item,
    function_call_output_item,
    message_item,
    output_text,
    tool_search_output_item,
)
from loopstack.middleware import Chain
from loopstack.runtime import StackRuntime
from loopstack.stack.loader import StackLoader
from loopstack.tools import ToolSet
from loopstack.types import StateKey

__all__ = ["Agent", "AgentResult", "ToolCall", "ToolProvider", "dispatch_tool_call", "turn_tools"]


@runtime_checkable
class ToolProvider(Protocol):
    """A source of tools listed again each turn (an :class:`~loopstack.harness.tools.mcp.MCPServer`)."""

    async def list_tools(self) -> Sequence[Tool]: ...


@dataclass(frozen=True)
class ToolCall:
    """One ``function_call`` the model made, resolved against the request's tools.

    Attributes:
        call_id: the model's id for the call (echoed in the ``function_call_output``).
        name: the tool name the model asked for.
        arguments: parsed arguments, or the raw string when it was not a JSON object.
        tool: the tool to run; None when the name is unknown (the endpoint answers an error).
    """

    call_id: str
    name: str
    arguments: dict[str, Any] | str
    tool: Tool | None


@dataclass
class AgentResult:
    """What :meth:`Agent.run` returns.

    Attributes:
        final_text: the model's last text answer ("" when the turn limit was reached).
        turns: model calls made by this run.
        items: the whole conversation (pass to ``Agent(items=...)`` to resume).
        events: every event the run streamed.
    """

    final_text: str
    turns: int
    items: list[dict[str, Any]]
    events: list[AgentEvent] = field(default_factory=list)


def _baseline_runtime() -> StackRuntime:
    catalog = PluginCatalog.discover()
    return StackRuntime(StackLoader(catalog).load("baseline"), catalog)


def _parse_arguments(raw: Any) -> dict[str, Any] | str:
    if isinstance(raw, dict):
        return raw
    try:
        parsed = json.loads(raw or "{}")
    except (TypeError, ValueError):
        return str(raw)
    return parsed if isinstance(parsed, dict) else str(raw)


@dataclass
class _TurnTools:
    tools: dict[str, Tool] = field(default_factory=dict)  # replaced whole per turn, never edited


_TURN_TOOLS = StateKey("loopstack.harness.turn_tools", _TurnTools)  # per request


def turn_tools(ctx: RequestContext) -> dict[str, Tool]:
    """Every tool callable in this request (the agent's, plugins' extra tools, deferred
    ones), by name. Set before ``loopstack_visible_tools`` runs, so a plugin's hooks and
    middlewares (Code Mode's ``tools.<name>``) can reach the tools themselves."""
    return ctx.state(_TURN_TOOLS).tools


async def dispatch_tool_call(
    ctx: RequestContext, name: str, arguments: dict[str, Any] | str, *, call_id: str = ""
) -> ToolResult:
    """Run one tool call through this request's ``tool`` middleware chain (approval,
    validation, tracing), exactly as a call the model made directly would run.

    For plugins that make tool calls on the model's behalf (Code Mode). An unknown name
    comes back as an error result, like any other failure."""
    call = ToolCall(call_id, name, arguments, turn_tools(ctx).get(name))
    return await ctx.chain("tool", _run_tool)(call, ctx)


async def _run_tool(call: ToolCall, ctx: RequestContext) -> ToolResult:
    # the tool chain's endpoint; module-level: plugins dispatch calls without the agent
    if call.tool is None:
        return ToolResult(f"unknown tool {call.name!r}", is_error=True)
    if not isinstance(call.arguments, dict):
        return ToolResult(f"arguments for tool {call.name!r} must be a JSON object, got {call.arguments!r}", is_error=True)
    return await call.tool.call(call.arguments)


def _output_item(call_id: str, result: ToolResult) -> Item:
    if result.loaded_tools:
        # schemas found by tool search: appended here, at the end of the context, never
        # inserted into the up-front tool list (which would invalidate the cached prefix)
        return tool_search_output_item(call_id, result.text, result.loaded_tools)
    return function_call_output_item(call_id, result.text)


class Agent:
    """A tool-calling loop over a :class:`ModelClient`.

    Args:
        model_client: where model calls go (the caller owns and closes it).
        tools: the tools the model may call (plugins may add more per request), and tool
            providers such as a connected ``MCPServer``: listed again at every turn, so a
            server's ``tools/list_changed`` reaches the model on the next turn.
        instructions: the system prompt.
        runtime: the stack the loop runs under; None builds the shipped "baseline" stack.
        max_turns: model calls per :meth:`run` before :class:`TurnLimitReached`.
        model, temperature, max_output_tokens: copied into every request.
        tool_choice_first: ``tool_choice`` of each run's first turn (``"required"`` forces a
            tool call; small models need it); later turns use ``"auto"``.
        items: a previous conversation (``AgentResult.items``) to continue.
        session: the session plugins key their state on (default: a new one).
        on_text_delta: receives the model's output text as it streams (the client streams).
        context_window: the model's context window in tokens; None never compacts.
        compact_at: compact when a request (plus ``max_output_tokens``) would pass this
            fraction of the window; compaction goes down to ``compact_target``.
        keep_recent_turns: the newest turns compaction never touches.
        count_tokens: the tokenizer's count for a text (default: a chars/3 estimate).
    """

    def __init__(
        self,
        model_client: ModelClient,
        tools: Sequence[Tool | ToolProvider],
        *,
        instructions: str,
        runtime: StackRuntime | None = None,
        max_turns: int = 20,
        model: str = "default",
        temperature: float = 0.0,
        max_output_tokens: int = 256,
        tool_choice_first: str | dict[str, Any] = "auto",
        items: Sequence[dict[str, Any]] | None = None,
        session: Session | None = None,
        on_text_delta: TextCallback | None = None,
        context_window: int | None = None,
        compact_at: float = 0.8,
        compact_target: float = 0.6,
        keep_recent_turns: int = 2,
        count_tokens: TokenCounter | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        if not 0 < compact_target <= compact_at <= 1:
            raise ValueError(f"need 0 < compact_target <= compact_at <= 1, got {compact_target} and {compact_at}")
        self.providers: list[ToolProvider] = [t for t in tools if isinstance(t, ToolProvider) and not isinstance(t, Tool)]
        self.tools: list[Tool] = [cast(Tool, t) for t in tools if t not in self.providers]
        ToolSet([t.info for t in self.tools])  # rejects duplicate names now, not at the first turn
        self.model_client = model_client
        self.instructions = instructions
        self.runtime = runtime if runtime is not None else _baseline_runtime()
        self.max_turns = max_turns
        self.model = model
        self.temperature = temperature
        self.max_output_tokens = max_output_tokens
        self.tool_choice_first = tool_choice_first
        self.items: list[dict[str, Any]] = list(items or [])
        self.session = session or Session()
        self.on_text_delta = on_text_delta
        self.context_window = context_window
        self.compact_at = compact_at
        self.compact_target = compact_target
        self.keep_recent_turns = keep_recent_turns
        self.count_tokens = count_tokens or estimate_tokens
        self.num_compactions = 0
        self._counted_items: list[dict[str, Any]] | None = None  # the list _item_tokens counts
        self._item_tokens: list[int] = []
        # composed once per combination of arms; the endpoint reads the client from self
        self._model_chain = Chain("model", self._call_model)

    async def run(self, task: str) -> AgentResult:
        """Run ``task`` to a final answer or the turn limit; see :meth:`stream`."""
        events = [event async for event in self.stream(task)]
        final = next((e.text for e in reversed(events) if isinstance(e, FinalAnswer)), "")
        turns = sum(isinstance(e, TurnStarted) for e in events)
        return AgentResult(final_text=final, turns=turns, items=list(self.items), events=events)

    async def stream(self, task: str) -> AsyncIterator[AgentEvent]:
        """Append ``task`` as a user message and loop, yielding events as they happen.

        Raises:
            ModelClientError: the model server refused a request (the loop stops).
        """
        self.items.append(message_item("user", task))
        for turn in range(1, self.max_turns + 1):
            yield TurnStarted(turn)
            ctx = self.runtime.context(session=self.session)
            tool_set, tools = self._resolve_tools(ctx, await self._provided_tools())
            request = self._build_request(tool_set, ctx, is_first_turn=turn == 1)
            compacted = self._compact(request, ctx)
            if compacted is not None:
                yield compacted
                request = self._build_request(tool_set, ctx, is_first_turn=turn == 1)
            check_prefix(request, ctx, is_compaction=compacted is not None)  # diagnostic; raises in strict mode
            started = time.perf_counter()
            response = await self._model_response(request, ctx)
            seconds = time.perf_counter() - started
            request_bytes = last_request_bytes(ctx) or len(serialize_request(request, ctx))
            yield ModelCalled(request_bytes, Usage.from_response(response), seconds)
            output = list(response.get("output") or [])
            self.items.extend(output)
            calls = [self._tool_call(item, tools) for item in output if item.get("type") == "function_call"]
            if not calls:
                yield FinalAnswer(output_text(output).strip())
                return
            for event in await self._run_calls(calls, ctx):
                yield event
        yield TurnLimitReached(self.max_turns)

    # -- one turn ------------------------------------------------------------------------

    async def _provided_tools(self) -> list[Tool]:
        # re-listed every turn: an MCP server answers from its cache until it sends
        # tools/list_changed, so a changed list reaches the model on the next turn
        provided: list[Tool] = []
        for provider in self.providers:
            provided.extend(await provider.list_tools())
        return provided

    def _resolve_tools(self, ctx: RequestContext, provided: Sequence[Tool] = ()) -> tuple[ToolSet, dict[str, Tool]]:
        all_tools = [*self.tools, *provided, *ctx.hooks.extra_tools(ctx)]
        tool_set = ToolSet([t.info for t in all_tools])  # a plugin's tool may not shadow one of ours
        by_name = {t.info.name: t for t in all_tools}
        state = ctx.state(_TURN_TOOLS)
        state.tools = dict(by_name)
        ctx.hooks.visible_tools(tools=tool_set, ctx=ctx)
        # deferred tools stay callable by name (found through search); hidden ones do not
        callable_names = {t.name for t in [*tool_set.visible(), *tool_set.deferred()]}
        state.tools = {name: tool for name, tool in by_name.items() if name in callable_names}
        return tool_set, state.tools

    def _build_request(self, tools: ToolSet, ctx: RequestContext, *, is_first_turn: bool) -> dict[str, Any]:
        request: dict[str, Any] = {
            "model": self.model,
            "instructions": self.instructions,
            "input": list(self.items),
            "temperature": self.temperature,
            "max_output_tokens": self.max_output_tokens,
            "prompt_cache_key": self.session.id,  # cache affinity: the API and router key on the session
        }
        visible = tools.visible()
        if visible:
            request["tools"] = [
                {"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters}
                for t in visible
            ]
            request["tool_choice"] = self.tool_choice_first if is_first_turn else "auto"
        ctx.hooks.prepare_request(request=request, ctx=ctx)
        return request

    def _items_tokens(self) -> int:
        # history is append-only between compactions: count each item once, not every turn
        if self._counted_items is not self.items:  # replaced (compaction, or by the caller): count again
            self._counted_items, self._item_tokens = self.items, []
        for item in self.items[len(self._item_tokens):]:
            self._item_tokens.append(self.count_tokens(json.dumps(item, ensure_ascii=False)))
        return sum(self._item_tokens)

    def _compact(self, request: dict[str, Any], ctx: RequestContext) -> Compacted | None:
        if self.context_window is None:
            return None
        fixed = self.count_tokens(request.get("instructions") or "") + self.max_output_tokens
        fixed += self.count_tokens(json.dumps(request.get("tools") or [], ensure_ascii=False))
        items_tokens = self._items_tokens()
        if fixed + items_tokens <= self.compact_at * self.context_window:
            return None
        result = compact(self.items, fixed_tokens=fixed, budget=int(self.compact_target * self.context_window),
                         keep_recent_turns=self.keep_recent_turns, count_tokens=self.count_tokens)
        if not result.changed:
            return None
        self.items = result.items
        self.num_compactions += 1
        ctx.count("loopstack_harness_compactions_total", help="explicit history compactions (context window)")
        return Compacted(result.num_dropped, result.tokens_before, result.tokens_after, result.num_elided)

    async def _call_model(self, request: dict[str, Any], ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        # the model chain's endpoint
        if self.on_text_delta is None:
            response = await self.model_client.create(request, ctx)
        else:
            response = await self.model_client.create(request, ctx, on_text_delta=self.on_text_delta)
        yield {"type": "response.completed", "response": response}

    async def _model_response(self, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        response: dict[str, Any] | None = None
        async for event in self._model_chain.handler(ctx)(request, ctx):
            if isinstance(event, dict) and event.get("type") in FINAL_EVENT_TYPES:
                response = event["response"]
        if response is None:
            raise RuntimeError("the model chain ended without a response.completed event")
        return response

    @staticmethod
    def _tool_call(item: dict[str, Any], tools: dict[str, Tool]) -> ToolCall:
        name = str(item.get("name", ""))
        return ToolCall(str(item.get("call_id", "")), name, _parse_arguments(item.get("arguments")), tools.get(name))

    async def _run_calls(self, calls: list[ToolCall], ctx: RequestContext) -> list[ToolCalled]:
        handler = ctx.chain("tool", _run_tool)
        outcomes: list[tuple[ToolResult, float] | None] = [None] * len(calls)

        async def run_one(index: int) -> None:
            started = time.perf_counter()
            result = await handler(calls[index], ctx)
            outcomes[index] = (result, time.perf_counter() - started)

        if len(calls) > 1 and all(c.tool is None or c.tool.is_concurrency_safe for c in calls):
            async with anyio.create_task_group() as group:
                for index in range(len(calls)):
                    group.start_soon(run_one, index)
        else:
            for index in range(len(calls)):
                await run_one(index)
        events = []
        for call, outcome in zip(calls, outcomes):
            assert outcome is not None  # every run_one finished (the task group waited)
            result, seconds = outcome
            self.items.append(_output_item(call.call_id, result))
            events.append(ToolCalled(call.name, call.arguments, result.text, result.is_error, seconds, call.call_id))
        return events
