"""Helpers for the parallel_safety tests: scripted guards, a scripted response service,
a tiny real engine, and a runtime whose guards come through the ``loopstack_guards`` hook."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, ClassVar

from loopstack import Layer, Plugin, PluginCatalog, StackLoader, StackRuntime, hookimpl
from loopstack.api.auth import ANONYMOUS
from loopstack.api.pipeline import ResponseJob, run_response
from loopstack.api.response_builder import ResponseBuilder, usage_of
from loopstack.api.schemas import ResponsesRequest
from loopstack.api.service import Prepared
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.text.tokenizer import Tokenizer
from loopstack.plugins.parallel_safety.guard import Verdict
from loopstack.testing.tiny_model import byte_tokenizer


class ScriptedGuard:
    """Blocks when ``trigger`` occurs in the text; waits ``delay_s`` first; records each
    check as (stage, text, finished_at). ``fail`` raises instead of answering."""

    def __init__(self, name: str = "scripted", *, trigger: str | None = None, delay_s: float = 0.0,
                 stages: tuple[str, ...] = ("input", "output"), category: str = "test_category",
                 fail: bool = False) -> None:
        self.name, self.trigger, self.delay_s, self.stages = name, trigger, delay_s, stages
        self.category, self.fail = category, fail
        self.checks: list[tuple[str, str, float]] = []

    async def check(self, text: str, *, stage: str) -> Verdict:
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("guard backend unavailable")
        self.checks.append((stage, text, time.perf_counter()))
        if self.trigger is not None and self.trigger in text:
            return Verdict.block(self.name, self.category, 0.99)
        return Verdict.allow(self.name, 0.01)


class GuardProvider(Plugin):
    """A third-party plugin that supplies guards through the hook."""

    name = "guard_provider"
    layers = (Layer.API,)
    guards: ClassVar[list[Any]] = []

    @hookimpl
    def loopstack_guards(self, ctx):
        return list(GuardProvider.guards)


def make_runtime(tmp_path: Path, safety_toml: str, guards: list[Any], extra: str = "") -> StackRuntime:
    """A runtime with parallel_safety (config ``safety_toml``, built-in guards off unless
    set) and ``guards`` from a third-party plugin."""
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    catalog.add_plugin(GuardProvider, source="tests")
    GuardProvider.guards = guards
    if "builtin_guards" not in safety_toml:
        safety_toml += "\nbuiltin_guards = []"
    path = tmp_path / "safety.toml"
    path.write_text(f"[plugins.guard_provider]\nenabled = true\n\n[plugins.parallel_safety]\nenabled = true\n"
                    f"{safety_toml}\n{extra}")
    return StackRuntime(StackLoader(catalog).load(path), catalog)


class ScriptedService:
    """Stands in for ResponsesService: streams ``deltas`` as Responses events, one every
    ``interval_s``; records when it started, how many deltas it produced, and whether it
    was cancelled."""

    model_name = "scripted-model"

    def __init__(self, deltas: list[str], interval_s: float = 0.01) -> None:
        self.deltas, self.interval_s = deltas, interval_s
        self.engine = type("Engine", (), {"tokenizer": byte_tokenizer()})()
        self.started_at: float | None = None
        self.num_produced = 0
        self.cancelled = False

    def echo(self, request: ResponsesRequest) -> dict[str, Any]:
        return {"model": self.model_name}

    def response_echo(self, prepared: Prepared) -> dict[str, Any]:
        return self.echo(prepared.request)

    def hidden_state_model(self) -> None:
        return None  # no model: fused checks run standalone

    async def remember(self, prepared: Prepared, response: dict[str, Any], local: Any = None) -> None:
        self.stored = response  # what run_response stores once every middleware passed it

    async def run(self, prepared: Prepared, ctx=None):
        self.started_at = time.perf_counter()
        builder = ResponseBuilder(prepared.response_id, self.echo(prepared.request))
        for event in builder.start():
            yield event
        try:
            for delta in self.deltas:
                await asyncio.sleep(self.interval_s)
                self.num_produced += 1
                for event in builder.text(delta):
                    yield event
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled = True
            raise
        events, _ = builder.finish(usage_of(1, 0, len(self.deltas)), truncated=False)
        for event in events:
            yield event


def prepared_for(text: str, prompt_ids: list[int] | None = None, params: SamplingParams | None = None,
                 model: str | None = None) -> Prepared:
    request = ResponsesRequest(input=text, model=model)
    return Prepared(request, ANONYMOUS, f"resp_{time.perf_counter_ns()}",
                    request.input_items(), prompt_ids or [1, 2, 3], params or SamplingParams(max_tokens=8), set())


async def collect(runtime: StackRuntime, service: Any, prepared: Prepared, ctx: Any = None) -> list[tuple[float, dict]]:
    """Every event of the response with the time it was released."""
    ctx = ctx or runtime.context()
    out = []
    async for event in run_response(ResponseJob(service, prepared), ctx):
        out.append((time.perf_counter(), event))
    return out


def released_text(events: list[tuple[float, dict]]) -> str:
    return "".join(e["delta"] for _, e in events if e["type"] == "response.output_text.delta")


def tiny_async_engine(num_kv_blocks: int = 128) -> Any:
    from loopstack.engine import AsyncEngine
    from loopstack.engine.llm_engine import EngineOptions, LLMEngine
    from tests.engine.support import build_tiny_model

    options = EngineOptions(num_kv_blocks=num_kv_blocks, block_size=4, max_num_batched_tokens=64)
    return AsyncEngine(LLMEngine(build_tiny_model(tie_word_embeddings=False), byte_tokenizer(), options))




class FusedGuard(ScriptedGuard):
    """A ScriptedGuard that also runs fused: ``check_hidden`` gets the captured hidden state,
    records ``(vector, arrived_at)``, waits ``hidden_delay_s`` and blocks when ``block_hidden``."""

    def __init__(self, name: str = "fused", *, block_hidden: bool = False, hidden_delay_s: float = 0.0,
                 num_layers: int = 1, max_tokens: int = 256, **kwargs: Any) -> None:
        super().__init__(name, **{"stages": ("input",), **kwargs})
        self.block_hidden, self.hidden_delay_s = block_hidden, hidden_delay_s
        self.num_layers, self.max_tokens = num_layers, max_tokens
        self.hidden_checks: list[tuple[Any, float]] = []
        self.verdicts_at: list[float] = []

    def hidden_capture(self, model: Any) -> tuple[int, int] | None:
        return self.num_layers, self.max_tokens

    async def check_hidden(self, hidden: Any, *, stage: str, pieces: Any = ()) -> Verdict:
        vector = await hidden
        self.hidden_checks.append((vector, time.perf_counter()))
        await asyncio.sleep(self.hidden_delay_s)
        self.verdicts_at.append(time.perf_counter())
        if self.block_hidden:
            return Verdict.block(self.name, self.category, 0.99)
        return Verdict.allow(self.name, 0.01)


async def engine_released(engine: Any) -> dict[str, Any]:
    """The engine's block statistics once an aborted request is gone (the abort reaches the
    engine thread within a step or two; gives up after 2 s and returns what it sees)."""
    for _ in range(200):
        blocks = engine.statistics()["blocks"]
        if blocks["num_used_blocks"] == 0 and blocks["num_sequences"] == 0:
            break
        await asyncio.sleep(0.01)
    return blocks


def chat_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Prompt ids of ``text`` inside a chat-like frame (the tiny engine has no chat template)."""
    return tokenizer.encode(f"<sys>be kind</sys>\n<user>{text}</user>\n<assistant>")


def counter(runtime: StackRuntime, name: str) -> dict[str, float]:
    """A counter's values by its ``outcome`` label (summed over the other labels)."""
    out: dict[str, float] = {}
    for metric in runtime.metrics.snapshot()["metrics"]:
        if metric["name"] == name:
            for series in metric["series"]:
                key = series["labels"].get("outcome", "")
                out[key] = out.get(key, 0) + series["value"]
    return out
