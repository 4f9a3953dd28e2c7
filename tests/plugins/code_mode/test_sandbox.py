"""The V8 sandbox: concurrency of tool calls, limits, containment, escape attempts, output caps."""

from __future__ import annotations

import itertools
import json
import time

import anyio
import pytest
from py_mini_racer import MiniRacer

from loopstack.harness.tools.tool import ToolResult
from loopstack.plugins.code_mode.result import cap_text, outcome_to_result
from loopstack.plugins.code_mode.sandbox import V8Sandbox
from tests.plugins.code_mode.support import run

HEAP = 64 << 20


async def run_program(code: str, tools=None, call_tool=None, *, timeout_s: float = 5, heap_bytes: int = HEAP):
    async def no_tools(name, arguments):
        return ToolResult(f"unexpected call {name}", is_error=True)

    sandbox = await V8Sandbox.start(heap_bytes=heap_bytes)
    try:
        return await sandbox.run(code, tools or {}, call_tool or no_tools, timeout_s=timeout_s), sandbox
    finally:
        sandbox.close()


class Recorder:
    """Tools that record (start, end) of every call; a barrier proves overlap without sleeps."""

    def __init__(self, expected: int) -> None:
        self.intervals: list[tuple[str, float, float]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.expected = expected
        self.all_started = anyio.Event()
        self.num_started = 0

    async def call(self, name: str, arguments):
        start = time.perf_counter()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.num_started += 1
        if self.num_started == self.expected:
            self.all_started.set()
        if name == "safe":
            await self.all_started.wait()  # returns only once every call of the fan-out is running
        else:
            for _ in range(5):
                await anyio.lowlevel.checkpoint()  # let a (wrongly) concurrent sibling start here
        self.in_flight -= 1
        self.intervals.append((arguments["key"], start, time.perf_counter()))
        return ToolResult(json.dumps({"key": arguments["key"], "payload": "x" * 1000}))


def test_promise_all_runs_concurrency_safe_calls_at_the_same_time():
    recorder = Recorder(expected=8)
    code = "return (await Promise.all([...Array(8).keys()].map(i => tools.safe({key: 'k' + i})))).map(r => r.key)"

    async def main():
        return await run_program(code, {"safe": True}, recorder.call)

    outcome, _ = run(main, timeout_s=10)
    assert outcome.status == "ok" and json.loads(outcome.result_json) == [f"k{i}" for i in range(8)]
    starts = [start for _, start, _ in recorder.intervals]
    ends = [end for _, _, end in recorder.intervals]
    assert max(starts) < min(ends)  # every interval overlaps every other one
    assert recorder.max_in_flight == 8
    assert outcome.num_tool_calls == 8 and outcome.tool_output_bytes > 8000


def test_unsafe_tools_run_one_at_a_time_even_under_promise_all():
    recorder = Recorder(expected=4)
    code = "await Promise.all([0, 1, 2, 3].map(i => tools.unsafe({key: 'k' + i}))); return 'ok'"

    outcome, _ = run(lambda: run_program(code, {"unsafe": False}, recorder.call))
    assert outcome.status == "ok"
    assert recorder.max_in_flight == 1
    ordered = sorted(recorder.intervals, key=lambda interval: interval[1])
    assert all(prev[2] <= nxt[1] for prev, nxt in itertools.pairwise(ordered))  # no two intervals overlap


def test_an_unsafe_call_waits_for_running_safe_calls():
    log: list[str] = []
    gate_open = anyio.Event()

    async def call(name, arguments):
        log.append(f"start {name}")
        if name == "safe":
            gate_open.set()
            for _ in range(5):
                await anyio.lowlevel.checkpoint()
        log.append(f"end {name}")
        return ToolResult("null")

    code = "await Promise.all([tools.safe({}), tools.unsafe({}), tools.safe({})]); return 1"
    outcome, _ = run(lambda: run_program(code, {"safe": True, "unsafe": False}, call))
    assert outcome.status == "ok"
    unsafe_start = log.index("start unsafe")
    assert log[unsafe_start + 1] == "end unsafe"  # nothing ran while the unsafe call did


def test_console_output_is_captured_and_capped():
    code = "console.log('a', 1, {b: 2}); console.error('bad'); for (let i = 0; i < 500; i++) console.log('x'.repeat(50)); return 0"

    async def main():
        sandbox = await V8Sandbox.start(heap_bytes=HEAP, max_log_chars=300)
        try:
            return await sandbox.run(code, {}, None, timeout_s=5)
        finally:
            sandbox.close()

    outcome = run(main)
    assert outcome.logs[:2] == ['a 1 {"b":2}', "[error] bad"]
    assert sum(len(line) + 1 for line in outcome.logs) <= 300
    assert outcome.num_logs_dropped > 400
    text = outcome_to_result(outcome, max_result_bytes=1024, max_log_bytes=4096).text
    assert text.startswith('0\n--- console ---\na 1 {"b":2}\n[error] bad\n')
    assert text.endswith(f"[{outcome.num_logs_dropped} more console lines dropped]")


def test_a_large_result_is_truncated_with_a_marker():
    outcome, _ = run(lambda: run_program("return 'é'.repeat(5000)"))
    result = outcome_to_result(outcome, max_result_bytes=1000, max_log_bytes=100)
    assert not result.is_error
    assert result.text.endswith("... [truncated: 999 of 10002 bytes shown]")  # cut on a character boundary
    assert len(result.text.encode()) < 1100
    assert cap_text("short", 10) == "short"


def test_a_thrown_error_and_a_syntax_error_give_the_js_stack():
    thrown, _ = run(lambda: run_program("function inner() { throw new RangeError('boom'); }\ninner();"))
    assert thrown.status == "error"
    assert thrown.error.startswith("RangeError: boom\n    at inner (")
    rejected, _ = run(lambda: run_program("await Promise.reject(new Error('nope'))"))
    assert rejected.status == "error" and rejected.error.startswith("Error: nope\n    at ")
    syntax, _ = run(lambda: run_program("return 1 +"))
    assert syntax.status == "error" and syntax.error.startswith("SyntaxError:")
    weird, _ = run(lambda: run_program("throw {toString() { throw 1 }}"))
    assert weird.status == "error" and weird.error.startswith("Uncaught")


@pytest.mark.parametrize("code", [
    "while (true) {}",
    "await tools.t({}); while (true) {}",
    "await new Promise(() => {})",
])
def test_timeout_is_contained_and_the_harness_keeps_running(code):
    beats: list[float] = []

    async def call(name, arguments):
        return ToolResult("{}")

    async def main():
        async def heartbeat():
            while True:
                beats.append(time.perf_counter())
                await anyio.sleep(0.01)

        async with anyio.create_task_group() as group:
            group.start_soon(heartbeat)
            outcome, sandbox = await run_program(code, {"t": True}, call, timeout_s=0.3)
            again, _ = await run_program("return 2", timeout_s=1)
            group.cancel_scope.cancel()
        return outcome, sandbox, again

    outcome, sandbox, again = run(main)
    assert outcome.status == "timeout" and "0.3 s" in outcome.error
    assert sandbox.is_closed
    assert again.status == "ok" and again.result_json == "2"
    assert max(b - a for a, b in itertools.pairwise(beats)) < 0.25  # the event loop was never blocked
    result = outcome_to_result(outcome, max_result_bytes=1000, max_log_bytes=100)
    assert result.is_error and "timed out" in result.text


@pytest.mark.parametrize("code", [
    "const a = []; while (true) a.push(new Array(10000).fill(1));",
    "await tools.t({}); const a = []; while (true) a.push('x'.repeat(100000) + a.length);",
])
def test_heap_limit_is_contained(code):
    async def call(name, arguments):
        return ToolResult("{}")

    async def main():
        outcome, sandbox = await run_program(code, {"t": True}, call, timeout_s=10, heap_bytes=16 << 20)
        again, _ = await run_program("return 3")
        return outcome, sandbox, again

    outcome, sandbox, again = run(main, timeout_s=30)
    assert outcome.status == "heap_limit" and outcome.seconds < 5
    assert sandbox.is_closed and again.result_json == "3"
    assert "ran out of memory" in outcome_to_result(outcome, max_result_bytes=1000, max_log_bytes=100).text


ESCAPES = {
    "require": "return typeof require",
    "process": "return typeof process",
    "fetch": "return typeof fetch + typeof XMLHttpRequest + typeof WebSocket",
    "timers": "return typeof setTimeout + typeof setInterval + typeof globalThis.queueMicrotask",
    "wasm_atomics": "return typeof WebAssembly + typeof Atomics + typeof SharedArrayBuffer",
    "function_constructor": "return tools.t.constructor.constructor('return typeof process + typeof require')()",
    "global_this_via_function": "const g = Function('return this')(); return typeof g.process + typeof g.require",
    "prototype_of_tools": "return [Object.getPrototypeOf(tools) === Object.prototype, Object.isFrozen(tools)]",
    "overwrite_tools": "'use strict'; try { tools.t = () => 1; return 'overwritten'; } catch (e) { return e.name; }",
    "overwrite_glue": "try { globalThis.__loopstack_settle = null; } catch (e) {} return typeof __loopstack_settle",
    "console_constructor": "return console.log.constructor.constructor('return typeof process')()",
}
ESCAPE_EXPECTED = {
    "require": "undefined",
    "process": "undefined",
    "fetch": "undefinedundefinedundefined",
    "timers": "undefinedundefinedundefined",
    "wasm_atomics": "undefinedundefinedundefined",
    "function_constructor": "undefinedundefined",
    "global_this_via_function": "undefinedundefined",
    "prototype_of_tools": [True, True],
    "overwrite_tools": "TypeError",
    "overwrite_glue": "function",
    "console_constructor": "undefined",
}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_escape_attempts_find_nothing(name):
    outcome, _ = run(lambda: run_program(ESCAPES[name], {"t": True}))
    assert outcome.status == "ok", outcome.error
    assert json.loads(outcome.result_json) == ESCAPE_EXPECTED[name]


def test_stack_frames_of_the_glue_expose_no_functions_or_receivers():
    code = """
        Error.prepareStackTrace = (e, frames) =>
            frames.map(f => [String(f.getFunctionName()), typeof f.getFunction(), typeof f.getThis()]);
        const before = new Error().stack;
        await tools.t({});
        const after = new Error().stack;
        let caller; try { caller = typeof __loopstack_run.caller; } catch (e) { caller = e.name; }
        return {before, after, caller};
    """

    async def call(name, arguments):
        return ToolResult("{}")

    outcome, _ = run(lambda: run_program(code, {"t": True}, call))
    frames = json.loads(outcome.result_json)
    program, *glue = frames["before"]
    assert program[1] == "function"  # the program's own frame
    assert glue and all(kinds == ["undefined", "undefined"] for _, *kinds in glue)
    assert len(frames["after"]) == 1  # after an await, only the program's frame is on the stack
    assert frames["caller"] == "TypeError"


def test_dynamic_import_is_refused():
    outcome, _ = run(lambda: run_program("return await import('fs')"))
    assert outcome.status == "error" and outcome.error.startswith("Error: Not supported")


def test_globals_are_plain_ecmascript_plus_the_glue():
    async def main():
        outcome, _ = await run_program("return Object.getOwnPropertyNames(globalThis)")
        with MiniRacer() as bare:
            standard = set(bare.execute("Object.getOwnPropertyNames(globalThis)"))
        return set(json.loads(outcome.result_json)), standard

    names, standard = run(main)
    glue = {"__loopstack_run", "__loopstack_settle", "__loopstack_drain", "console"}
    assert names - standard <= glue
    # what is left of mini-racer's own additions is neutralised
    assert {"setTimeout", "Atomics", "WebAssembly"} & (names - {"setTimeout", "clearTimeout", "__timer_manager"}) == set()


def test_forged_or_unknown_calls_never_reach_the_host():
    calls: list[str] = []

    async def call(name, arguments):
        calls.append(name)
        return ToolResult("{}")

    code = "__loopstack_settle(0, true, '1'); return [typeof tools.exec, typeof tools.other]"
    outcome, _ = run(lambda: run_program(code, {"t": True}, call))
    assert json.loads(outcome.result_json) == ["undefined", "undefined"] and calls == []


def test_calls_the_program_did_not_await_are_cancelled_when_it_returns():
    finished: list[str] = []

    async def call(name, arguments):
        await anyio.sleep(5)
        finished.append(name)
        return ToolResult("{}")

    async def main():
        started = time.perf_counter()
        outcome, _ = await run_program("tools.slow({}); return 'early'", {"slow": True}, call)
        return outcome, time.perf_counter() - started

    outcome, seconds = run(main)
    assert outcome.result_json == '"early"' and seconds < 2 and finished == []


def test_spare_contexts_are_fresh_and_ready_after_the_first():
    from loopstack.plugins.code_mode.spare import SpareContexts

    async def main():
        spares = SpareContexts(heap_bytes=HEAP, max_log_chars=100)
        first = await spares.take()
        await first.run("globalThis.leak = 1; return 0", {}, None, timeout_s=5)
        first.close()
        spares.replenish()
        for _ in range(200):  # the refill runs in the background; wait for it without a fixed sleep
            if spares.statistics().has_spare:
                break
            await anyio.sleep(0.01)
        second = await spares.take()
        outcome = await second.run("return typeof leak", {}, None, timeout_s=5)
        second.close()
        stats = spares.statistics()
        spares.close()
        return outcome, stats, first is second

    outcome, stats, same = run(main)
    assert outcome.result_json == '"undefined"' and not same
    assert stats.num_taken == 2 and stats.num_ready_when_taken == 1


def test_calls_queued_after_the_program_returned_are_never_served():
    calls: list[str] = []

    async def call(name, arguments):
        calls.append(arguments["tag"])
        return ToolResult("{}")

    async def main():
        sandbox = await V8Sandbox.start(heap_bytes=HEAP)
        try:
            first = await sandbox.run(
                "Promise.resolve().then(() => Promise.resolve()).then(() => tools.t({tag: 'late'}).catch(() => {}));"
                "return 1", {"t": True}, call, timeout_s=5)
            second = await sandbox.run("return (await tools.t({tag: 'second'})) && 2", {"t": True}, call, timeout_s=5)
        finally:
            sandbox.close()
        return first, second

    first, second = run(main)
    assert first.result_json == "1" and second.result_json == "2"
    assert calls == ["second"]
