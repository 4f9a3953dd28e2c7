"""The ``exec`` tool: one JavaScript program over the request's tools."""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass, field
from typing import Any

import anyio

from loopstack.context import RequestContext
from loopstack.harness.agent import dispatch_tool_call, turn_tools
from loopstack.harness.tools.tool import ToolResult
from loopstack.plugins.code_mode.config import CodeModeConfig
from loopstack.plugins.code_mode.declarations import declare_tools
from loopstack.plugins.code_mode.result import outcome_to_result
from loopstack.plugins.code_mode.sandbox import ProgramOutcome, V8Sandbox
from loopstack.plugins.code_mode.spare import SpareContexts
from loopstack.tools import ToolInfo
from loopstack.types import StateKey

__all__ = ["EXEC_TOOL_NAME", "SESSION_CONTEXTS", "ExecTool", "SessionContexts", "exec_description"]

EXEC_TOOL_NAME = "exec"
TOOL_SEARCH_NAME = "tool_search"
EXEC_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "JavaScript: the body of an async function"}},
    "required": ["code"],
    "additionalProperties": False,
}


def exec_description(
    declared: list[ToolInfo], config: CodeModeConfig, *, has_search: bool = False, undeclared: list[str] | None = None
) -> str:
    """The ``exec`` description: how programs run, then TypeScript declarations of ``declared``."""
    lines = [
        (
            "Run a JavaScript program in a sandbox (V8) and get its result. The program is the body of an async "
            "function: call tools with `await tools.NAME(args)`, run independent calls at once with `Promise.all`, "
            "filter and combine results in code, and `return` only what is needed (as JSON, at most "
            f"{config.max_result_bytes} bytes). console.log output comes back too. A failed tool call throws "
            f"(use try/catch). No network, files, require, import or timers; time limit {config.timeout_s:g} s."
        ),
    ]
    if config.context == "session":
        lines.append("`store(key, value)` and `load(key)` keep JSON values between programs of this conversation.")
    if has_search:
        lines.append(
            "More tools exist: `tools.tool_search({query})` finds them and answers with their names and "
            "declarations (return that text to read it); then call them as `tools[name](args)`."
        )
    elif undeclared:
        lines.append(f"Also callable (schemas not shown): {', '.join(undeclared)}.")
    lines += ["```ts", declare_tools(declared), "```"]
    return "\n".join(lines)


def _dispose(sandbox: V8Sandbox) -> None:
    """Close ``sandbox`` on its own event loop (a finalizer may run on any thread), or here
    when that loop is gone."""
    try:
        sandbox.loop.call_soon_threadsafe(sandbox.close)
    except RuntimeError:  # the loop is closed
        sandbox.close()


@dataclass
class SessionContexts:
    """Code Mode's session state: the V8 context of ``context = "session"``.

    The context is disposed by :meth:`close` (``Session.close()``), or when the session is
    garbage-collected: a server makes a ``Session`` per request, and nothing else would
    ever release the V8 isolate behind it.
    """

    sandbox: V8Sandbox | None = None
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    _finalizer: weakref.finalize | None = None

    def adopt(self, sandbox: V8Sandbox, session: object) -> None:
        """Make ``sandbox`` the session's context, disposed with ``session`` at the latest."""
        if sandbox is self.sandbox:
            return
        if self._finalizer is not None:
            self._finalizer.detach()
        self.sandbox = sandbox
        self._finalizer = weakref.finalize(session, _dispose, sandbox)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self.sandbox is not None:
            _dispose(self.sandbox)
            self.sandbox = None


SESSION_CONTEXTS = StateKey("code_mode", SessionContexts)
"""Per session: the V8 context of ``context = "session"`` (:class:`SessionContexts`)."""


class ExecTool:
    """The ``exec`` tool of one request; calls from its programs go through ``ctx``'s tool chain.

    Args:
        ctx: the request (its tools, middleware chain, session and metrics).
        config: the plugin's config for the request's arm.
        spares: where fresh V8 contexts come from (the plugin shares one across requests).
    """

    is_concurrency_safe = False  # programs may call tools that are not

    def __init__(self, ctx: RequestContext, config: CodeModeConfig, spares: SpareContexts | None = None) -> None:
        self.ctx = ctx
        self.config = config
        self.spares = spares or SpareContexts(heap_bytes=config.heap_mb << 20, max_log_chars=config.max_log_bytes)
        self.info = ToolInfo(EXEC_TOOL_NAME, exec_description([], config), EXEC_PARAMETERS)
        self._num_calls = 0

    def __repr__(self) -> str:
        return f"ExecTool(request={self.ctx.request_id!r})"

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str) or set(arguments) - {"code"}:
            return ToolResult("exec takes one argument, code: a JavaScript program (string)", is_error=True)
        tools = {name: tool.is_concurrency_safe for name, tool in turn_tools(self.ctx).items() if name != EXEC_TOOL_NAME}
        try:
            if self.config.context == "session":
                state = self.ctx.session.state(SESSION_CONTEXTS)
                async with state.lock:
                    sandbox = await self._reuse(state.sandbox)
                    state.adopt(sandbox, self.ctx.session)
                    outcome = await sandbox.run(code, tools, self._call_tool, timeout_s=self.config.timeout_s)
            else:
                sandbox = await self._start()
                try:
                    outcome = await sandbox.run(code, tools, self._call_tool, timeout_s=self.config.timeout_s)
                finally:
                    # disposing takes a moment: let the result go first (run() already
                    # disposed a context that timed out or ran out of memory)
                    asyncio.get_running_loop().call_soon(sandbox.close)
        except RuntimeError as error:  # no asyncio loop: mini-racer cannot deliver callbacks
            return ToolResult(f"exec is unavailable: {error}", is_error=True)
        finally:
            self.spares.replenish()
        result = outcome_to_result(
            outcome, max_result_bytes=self.config.max_result_bytes, max_log_bytes=self.config.max_log_bytes
        )
        self._record(outcome, result)
        return result

    async def _call_tool(self, name: str, arguments: Any) -> ToolResult:
        self._num_calls += 1
        result = await dispatch_tool_call(self.ctx, name, arguments, call_id=f"exec-{self._num_calls}")
        if name == TOOL_SEARCH_NAME and result.loaded_tools:
            # the schemas a search loads would reach the model as a tool_search_output item;
            # a program gets them as declarations after the text (return them to read them)
            found = [ToolInfo(str(t.get("name")), str(t.get("description") or ""), dict(t.get("parameters") or {}))
                     for t in result.loaded_tools]
            result = ToolResult(f"{result.text}\n{declare_tools(found)}", result.is_error)
        return result

    async def _start(self) -> V8Sandbox:
        sandbox = await self.spares.take()
        self.ctx.observe("code_mode_v8_startup_seconds", sandbox.statistics().startup_seconds,
                         help="time to create a V8 context and install the prelude")
        return sandbox

    async def _reuse(self, sandbox: V8Sandbox | None) -> V8Sandbox:
        if sandbox is not None and sandbox.is_usable_here():
            return sandbox
        if sandbox is not None:
            sandbox.close()
        return await self._start()

    def _record(self, outcome: ProgramOutcome, result: ToolResult) -> None:
        ctx = self.ctx
        ctx.count("code_mode_programs_total", help="Code Mode programs run, by outcome", outcome=outcome.status)
        ctx.observe("code_mode_tool_calls_per_program", outcome.num_tool_calls, help="tool calls made by one program")
        ctx.observe("code_mode_exec_seconds", outcome.seconds, help="wall time of one program, tool calls included")
        kept = max(0, outcome.tool_output_bytes - len(result.text.encode()))
        ctx.count("code_mode_intermediate_bytes_total", kept,
                  help="tool output bytes a program consumed that did not enter the context")
