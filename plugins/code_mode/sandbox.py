"""One V8 context that runs Code Mode programs, with their tool calls served from Python.

Protocol (see prelude.py): the program queues ``call`` and ``done`` messages and rings a
doorbell; the host drains the queue with a cancelable evaluation, runs each call in an
anyio task group (through a :class:`ConcurrencyGate`) and settles the calls' promises
with another cancelable evaluation (one for every call that ended meanwhile). ``Promise.all`` over several calls therefore runs
them concurrently here.

Why not ``MiniRacer.wrap_py_function``: it unpacks arguments and resolves promises with
*synchronous* isolate calls made on the event loop thread. A program that busy-loops
after a call (``await tools.x(); while (true) {}``) would then block the harness's event
loop inside that call, where no timeout can fire. Here every isolate call the host
makes while a program runs is cancelable, and a timeout disposes the context, which
terminates whatever JavaScript is still running.

Limits: ``timeout_s`` bounds a program's wall time (tool calls included); the heap limit
is V8's hard limit (the isolate stops running JavaScript once it is reached). Either
ends the program with a clear outcome and disposes the context.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, cast

import anyio
import anyio.abc
import sniffio
from py_mini_racer import JSEvalException, JSFunction, JSOOMException, MiniRacer

from loopstack.harness.tools.tool import ToolResult
from loopstack.plugins.code_mode.gate import ConcurrencyGate
from loopstack.plugins.code_mode.prelude import PRELUDE

__all__ = ["CallTool", "ProgramOutcome", "SandboxStatistics", "V8Sandbox"]

CallTool = Callable[[str, Any], Awaitable[ToolResult]]
Status = Literal["ok", "error", "timeout", "heap_limit"]
_HEAP_POLL_S = 0.02  # how often a waiting program checks the isolate's heap-limit flag


@dataclass
class ProgramOutcome:
    """How one program ended.

    Attributes:
        status: ``ok``, ``error`` (thrown error, rejected promise, syntax error),
            ``timeout`` or ``heap_limit``.
        result_json: the returned value as JSON (``ok`` only).
        error: the JavaScript stack or the reason (every other status).
        logs: captured ``console`` lines; num_logs_dropped: lines over the cap.
        num_tool_calls: tool calls the program made.
        tool_output_bytes: bytes of tool output the program received.
        seconds: wall time of the program.
    """

    status: Status
    result_json: str | None = None
    error: str | None = None
    logs: list[str] = field(default_factory=list)
    num_logs_dropped: int = 0
    num_tool_calls: int = 0
    tool_output_bytes: int = 0
    settled: list[str] = field(default_factory=list)  # settle statements not yet evaluated
    is_settling: bool = False
    seconds: float = 0.0


class SandboxStatistics(NamedTuple):
    startup_seconds: float
    num_programs: int
    num_tool_calls: int
    is_closed: bool


class _HeapLimitReached(Exception):
    pass


@dataclass
class _Run:
    tools: Mapping[str, bool]  # name -> is_concurrency_safe
    call_tool: CallTool
    gate: ConcurrencyGate = field(default_factory=ConcurrencyGate)
    done: dict[str, Any] | None = None
    failure: BaseException | None = None
    num_tool_calls: int = 0
    tool_output_bytes: int = 0
    settled: list[str] = field(default_factory=list)  # settle statements not yet evaluated
    is_settling: bool = False


class V8Sandbox:
    """A V8 context holding only the prelude: no network, filesystem, timers or host objects.

    Create it with :meth:`start` inside the asyncio event loop that will run its programs.

    Example::

        sandbox = await V8Sandbox.start(heap_bytes=64 << 20)
        try:
            outcome = await sandbox.run("return 1 + 1", {}, call_tool, timeout_s=5)
        finally:
            sandbox.close()
    """

    def __init__(self, racer: MiniRacer, exits: ExitStack, startup_seconds: float) -> None:
        self._racer = racer
        self._exits = exits
        self._bell = anyio.Event()
        self._loop = asyncio.get_running_loop()
        self._startup_seconds = startup_seconds
        self._num_programs = 0
        self._num_tool_calls = 0
        self._is_closed = False

    @classmethod
    async def start(cls, *, heap_bytes: int, max_log_chars: int = 4096) -> V8Sandbox:
        """A fresh context with ``heap_bytes`` as V8's hard heap limit.

        Raises:
            RuntimeError: not running under asyncio (mini-racer's callbacks need it).
        """
        if sniffio.current_async_library() != "asyncio":
            raise RuntimeError("Code Mode needs the asyncio event loop (mini-racer delivers callbacks to it)")
        started = time.perf_counter()
        racer = MiniRacer()
        exits = ExitStack()
        exits.callback(racer.close)
        sandbox = cls(racer, exits, 0.0)
        try:
            racer.set_hard_memory_limit(heap_bytes)
            context = racer._ctx  # the one-way notification (a doorbell) has no public API
            if context is None:
                raise RuntimeError("mini-racer gave a closed context")
            ring = exits.enter_context(context._register_js_notification(sandbox._on_ring))
            install = cast("JSFunction", await racer.eval_cancelable(PRELUDE))
            await context.call_function_cancelable(install, ring, max_log_chars)
        except BaseException:
            exits.close()
            raise
        sandbox._startup_seconds = time.perf_counter() - started
        return sandbox

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this context delivers its callbacks to."""
        return self._loop

    def is_usable_here(self) -> bool:
        """Open, and bound to the running event loop (a context serves one loop)."""
        return not self._is_closed and asyncio.get_running_loop() is self._loop

    def close(self) -> None:
        """Dispose the context; any JavaScript still running is terminated."""
        if not self._is_closed:
            self._is_closed = True
            self._exits.close()

    def statistics(self) -> SandboxStatistics:
        return SandboxStatistics(self._startup_seconds, self._num_programs, self._num_tool_calls, self._is_closed)

    def _on_ring(self, _handle: Any) -> None:
        # runs on the event loop (mini-racer hands notifications over with call_soon_threadsafe)
        self._bell.set()

    async def run(
        self, code: str, tools: Mapping[str, bool], call_tool: CallTool, *, timeout_s: float
    ) -> ProgramOutcome:
        """Run ``code`` (an async function body) with ``tools.<name>`` for each name in ``tools``.

        Args:
            code: the program; ``return`` gives its result.
            tools: tool name -> whether it is concurrency-safe.
            call_tool: runs one call (the plugin sends it through the request's tool chain).
            timeout_s: wall-clock limit, tool calls included.

        Returns:
            The outcome. After ``timeout`` or ``heap_limit`` the context is closed.
        """
        if not self.is_usable_here():
            raise RuntimeError("this V8 context is closed or belongs to another event loop")
        self._num_programs += 1
        run = _Run(tools, call_tool)
        started = time.perf_counter()
        outcome = await self._run(code, run, timeout_s)
        outcome.num_tool_calls, outcome.tool_output_bytes = run.num_tool_calls, run.tool_output_bytes
        outcome.seconds = time.perf_counter() - started
        self._num_tool_calls += run.num_tool_calls
        if outcome.status in ("timeout", "heap_limit"):
            self.close()
        return outcome

    async def _run(self, code: str, run: _Run, timeout_s: float) -> ProgramOutcome:
        outcome: ProgramOutcome | None = None
        with anyio.move_on_after(timeout_s):
            async with anyio.create_task_group() as group:
                outcome = await self._pump(code, run, group)
                group.cancel_scope.cancel()  # calls the program did not await end with it
        if outcome is None:
            return ProgramOutcome("timeout", error=f"the program ran past its {timeout_s:g} s limit and was stopped")
        return outcome

    async def _pump(self, code: str, run: _Run, group: anyio.abc.TaskGroup) -> ProgramOutcome:
        names = json.dumps(sorted(run.tools))
        try:
            queued = await self._eval(f"__loopstack_run({json.dumps(code)}, {names})")
            while True:
                for message in self._drain(queued):
                    self._handle(message, run, group)
                    if run.done is not None:
                        break  # a call queued after the end is never served
                if run.done is not None:
                    break
                await self._wait_for_messages(run)
                queued = await self._eval("__loopstack_drain()")
        except (_HeapLimitReached, JSOOMException):
            return ProgramOutcome("heap_limit", error=self._heap_message())
        except JSEvalException as error:
            return ProgramOutcome("error", error=str(error))
        logs = [str(line) for line in run.done.get("logs") or []]
        dropped = int(run.done.get("logsDropped") or 0)
        if run.done.get("ok"):
            return ProgramOutcome("ok", result_json=str(run.done.get("result")), logs=logs, num_logs_dropped=dropped)
        return ProgramOutcome("error", error=str(run.done.get("error")), logs=logs, num_logs_dropped=dropped)

    def _heap_message(self) -> str:
        return "the program reached the V8 heap limit and was stopped"

    async def _eval(self, code: str) -> Any:
        return await self._racer.eval_cancelable(code)

    async def _wait_for_messages(self, run: _Run) -> None:
        while True:
            if run.failure is not None:
                raise run.failure
            if self._racer.was_hard_memory_limit_reached():
                raise _HeapLimitReached
            with anyio.move_on_after(_HEAP_POLL_S):
                await self._bell.wait()
            if self._bell.is_set():
                self._bell = anyio.Event()  # a ring after this point sets the new event
                return

    @staticmethod
    def _drain(raw: Any) -> list[dict[str, Any]]:
        try:
            messages = json.loads(raw) if isinstance(raw, str) else None
        except ValueError:
            messages = None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise JSEvalException(f"Code Mode protocol error: the context sent {str(raw)[:200]!r}")
        return messages

    def _handle(self, message: dict[str, Any], run: _Run, group: anyio.abc.TaskGroup) -> None:
        if message.get("kind") == "done":
            run.done = message
        elif message.get("kind") == "call" and isinstance(message.get("id"), int):
            run.num_tool_calls += 1
            group.start_soon(self._serve_call, message, run)

    async def _serve_call(self, message: dict[str, Any], run: _Run) -> None:
        name = str(message.get("name"))
        try:
            arguments: Any = json.loads(str(message.get("args")))
        except ValueError:
            arguments = str(message.get("args"))
        if name not in run.tools:
            result = ToolResult(f"unknown tool {name!r}", is_error=True)
        else:
            async with run.gate.hold(is_concurrency_safe=run.tools[name]):
                try:
                    result = await run.call_tool(name, arguments)
                except Exception as error:  # a failing middleware fails this call, not the program
                    result = ToolResult(f"{type(error).__name__}: {error}", is_error=True)
        run.tool_output_bytes += len(result.text.encode())
        ok = "false" if result.is_error else "true"
        run.settled.append(f"__loopstack_settle({message['id']}, {ok}, {json.dumps(result.text)});")
        if not run.is_settling:
            await self._settle(run)

    async def _settle(self, run: _Run) -> None:
        # calls of a fan-out end together: one evaluation settles every call that has ended,
        # including those that end while it runs (the next loop turn takes them)
        run.is_settling = True
        try:
            while run.settled:
                batch, run.settled = run.settled, []
                await self._eval("".join(batch))
        except JSEvalException as error:  # the heap limit, most likely: end the program
            run.failure = error
            self._bell.set()
        finally:
            run.is_settling = False
