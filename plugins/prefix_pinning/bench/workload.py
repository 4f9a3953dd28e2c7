"""Workload ``prefix``: real agent sessions replayed through harness, API and engine, unpinned vs pinned.

Each step replays one recorded SWE-bench session (``bench/data.py``) twice, once per column,
through :class:`~loopstack.harness.agent.Agent` -> :class:`~loopstack.harness.clients.replay.ReplayClient`
-> :class:`~loopstack.harness.clients.embedded.EmbeddedClient` (the API layer and the engine in
process, ``max_output_tokens=1``: the recording plays the model, the engine measures the
prompt). Both columns run the harness the way real bugs happen (``unstable_harness``: MCP
tools re-ordered every turn, the current time in the instructions); ``pinned`` adds
``prefix_pinning``. The engine's prefix cache is emptied before each session.

Sessions longer than the engine's context are cut append-only: the first N turns whose
requests all fit (``max_model_len`` minus a margin) are kept, so every kept request is the
one the full session would have sent. ``max_hit_rate`` is the theoretical best for the
kept turns, computed from the pinned requests (the ideal: each repeats the previous one
but its generation prompt, then appends): for each call, the longest common
token prefix with the previous call's prompt, in whole KV blocks (the last prompt token is
always computed), over all prompt tokens; the first call of a session is all misses.

Options: ``--steps N`` replays N sessions (default 1; the 5 recordings in turn);
``-o turns=N`` (or ``LOOPSTACK_BENCH_PREFIX_TURNS``) caps the turns per session (default 5;
``--quick``: 3).
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loopstack.bench.workload import BenchOptions, Workload
from loopstack.context import Session
from loopstack.harness.prefix_detector import CAUSES, detector_for
from loopstack.stack.schema import ResolvedStack

__all__ = ["PrefixWorkload", "reset_prefix_cache"]

COLUMNS = ("unpinned", "pinned")
DEFAULT_TURNS = 5
QUICK_TURNS = 3
CONTEXT_MARGIN = 64  # tokens kept free: the two columns' prompts differ by a few tokens
TURNS_ENV = "LOOPSTACK_BENCH_PREFIX_TURNS"

_STACK = """[stack]
name = "prefix-{column}"
extends = "{base}"

[plugins.prefix_pinning]
enabled = {enabled}

[plugins.unstable_harness]
enabled = true
"""


@dataclass
class _SessionPlan:
    trajectory: Any
    num_turns: int
    cut_reason: str
    prompt_tokens: list[int] = field(default_factory=list)
    max_cached: list[int] = field(default_factory=list)


class _Capture:
    """A forward target that only records requests (for planning; no engine)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    async def create(self, request: dict[str, Any], ctx: Any, **_: Any) -> dict[str, Any]:
        self.requests.append(request)
        return {"usage": {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0}}


class _Timed:
    """Forwards to the embedded client and times each call (one output token: ~TTFT)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.seconds: list[float] = []

    async def create(self, request: dict[str, Any], ctx: Any, **_: Any) -> dict[str, Any]:
        started = time.perf_counter()
        response = await self.client.create(request, ctx)
        self.seconds.append(time.perf_counter() - started)
        return response


def reset_prefix_cache(engine: Any) -> None:
    """Empty an :class:`~loopstack.engine.AsyncEngine`'s prefix cache between sessions (each
    starts cold); the engine does it on its loop thread, between two steps."""
    engine.reset_prefix_cache()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class PrefixWorkload(Workload):
    name = "prefix"
    description = "replayed SWE-bench sessions via harness+API+engine: prefix-cache hit rate, unpinned vs pinned"
    default_steps = 1

    def __init__(self) -> None:
        self._clients: dict[str, Any] = {}
        self._plans: list[_SessionPlan] = []
        self._tools: list[Any] = []
        self._engine: Any = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._config: dict[str, Any] = {}
        self._log_level = logging.NOTSET

    def columns(self, stacks: list[ResolvedStack]) -> list[str]:
        return list(COLUMNS)

    async def setup(self, columns: list[str], stacks: list[ResolvedStack], options: BenchOptions) -> None:
        from loopstack.api.server import build_state, engine_from_table
        from loopstack.catalog import PluginCatalog
        from loopstack.engine import AsyncEngine
        from loopstack.harness.clients.embedded import EmbeddedClient
        from loopstack.harness.trajectory import load_trajectory
        from loopstack.plugins.prefix_pinning.bench.data import bench_tools, trajectory_paths
        from loopstack.runtime import StackRuntime
        from loopstack.stack.loader import StackLoader
        from loopstack.testing.faults import UnstableHarness

        # breaks are counted in the metrics; one warning line per break would bury the table
        self._log_level = logging.getLogger("loopstack.prefix").level
        logging.getLogger("loopstack.prefix").setLevel(logging.ERROR)
        paths = trajectory_paths(options.data_dir)
        if not paths:
            raise RuntimeError(f"the prefix bench replays real sessions from {options.data_dir}/trajectories "
                               "(../shared/data is absent)")
        catalog = PluginCatalog.discover()
        catalog.add_plugin(UnstableHarness, source="loopstack.testing.faults")
        self._tmp = tempfile.TemporaryDirectory(prefix="loopstack-prefix-bench-")
        base = stacks[0].path if stacks[0].path else "baseline"
        stack_paths = {}
        for column in columns:
            path = Path(self._tmp.name) / f"{column}.toml"
            path.write_text(_STACK.format(column=column, base=base, enabled=str(column == "pinned").lower()))
            stack_paths[column] = path
        self._engine = AsyncEngine(engine_from_table(stacks[0].engine))
        for column in columns:
            self._clients[column] = EmbeddedClient(build_state(stack_paths[column], catalog=catalog,
                                                               engine=self._engine, store_path=":memory:"))
        self._tools = bench_tools(options.data_dir)
        default = QUICK_TURNS if options.quick else DEFAULT_TURNS
        max_turns = int(options.extra.get("turns") or os.environ.get(TURNS_ENV, default))
        planner = StackRuntime(StackLoader(catalog).load(stack_paths["pinned"]), catalog)
        num_sessions = options.steps or (1 if options.quick else self.default_steps)
        for path in paths[:num_sessions]:
            self._plans.append(await self._plan(load_trajectory(path), planner, max_turns, stacks[0]))
        planner.close()
        self._config = self._describe(stacks[0], max_turns)

    async def _plan(self, trajectory: Any, runtime: Any, max_turns: int, stack: ResolvedStack) -> _SessionPlan:
        from loopstack.api.conversation import items_to_messages, render_prompt
        from loopstack.harness.agent import Agent
        from loopstack.harness.clients.replay import ReplayClient

        capture = _Capture()
        replay = ReplayClient(trajectory, forward=capture)
        turns = min(max_turns, len(trajectory.turns))
        agent = Agent(replay, [*replay.tools(), *self._tools], instructions=trajectory.instructions, runtime=runtime,
                      max_turns=turns, session=Session())
        async for _ in agent.stream(trajectory.task):
            pass
        tokenizer, limit = self._engine.tokenizer, self._engine.max_model_len - CONTEXT_MARGIN

        def tokens(request: dict[str, Any]) -> list[int]:
            messages = items_to_messages(request.get("instructions"), request.get("input") or [])
            prompt = render_prompt(tokenizer, messages, request.get("tools"))
            return tokenizer.encode(prompt)

        prompts = [tokens(r) for r in capture.requests]
        fit = next((i for i, ids in enumerate(prompts) if len(ids) > limit), len(prompts))
        reason = (f"first {fit} of {len(trajectory.turns)} turns: turn {fit + 1} needs {len(prompts[fit])} tokens "
                  f"(> {limit})" if fit < len(prompts) else
                  f"first {fit} of {len(trajectory.turns)} turns (turn limit {max_turns})"
                  if fit < len(trajectory.turns) else f"all {fit} turns")
        plan = _SessionPlan(trajectory, fit, reason, [len(p) for p in prompts[:fit]])
        block_size = stack.engine.block_size
        for k in range(fit):
            if k == 0:
                plan.max_cached.append(0)
                continue
            shared = _common_prefix(prompts[k], prompts[k - 1]) // block_size * block_size
            plan.max_cached.append(min(shared, len(prompts[k]) - 1))
        return plan

    async def step(self, column: str, index: int) -> dict[str, float]:
        from loopstack.harness.agent import Agent
        from loopstack.harness.clients.replay import ReplayClient

        plan = self._plans[index % len(self._plans)]
        client = self._clients[column]
        reset_prefix_cache(self._engine)
        timed = _Timed(client)
        replay = ReplayClient(plan.trajectory, forward=timed)
        session = Session(id=f"{column}-{index}-{plan.trajectory.id}")
        agent = Agent(replay, [*replay.tools(), *self._tools], instructions=plan.trajectory.instructions,
                      runtime=client.state.live.current, max_turns=plan.num_turns, session=session)
        async for _ in agent.stream(plan.trajectory.task):
            pass
        return self._metrics(plan, replay.rows, timed.seconds, detector_for(session))

    def _metrics(self, plan: _SessionPlan, rows: list[Any], seconds: list[float], detector: Any) -> dict[str, float]:
        prompt = sum(r.input_tokens for r in rows)
        cached = sum(r.cached_tokens for r in rows)
        block_size = self._config["block_size"]
        broken = {b.request_index for b in detector.breaks}
        misses = [k for k, r in enumerate(rows) if r.cached_tokens < plan.max_cached[k] - block_size]
        out = {
            "cache_hit_rate": cached / prompt,
            "max_hit_rate": sum(plan.max_cached) / sum(plan.prompt_tokens),
            "prefill_tokens": float(prompt - cached),
            "prompt_tokens": float(prompt),
            "ttft_s_mean": statistics.fmean(seconds),
            "calls": float(len(rows)),
            "prefix_breaks": float(len(detector.breaks)),
            "cache_misses": float(len(misses)),
            "cache_misses_explained": float(sum(1 for k in misses if k + 1 in broken)),
        }
        out["hit_rate_of_max"] = cached / sum(plan.max_cached)  # the share of the theoretical maximum reached
        by_cause = detector.statistics().breaks_by_cause
        out.update({f"prefix_breaks.{cause}": float(by_cause.get(cause, 0)) for cause in CAUSES})
        # a break has one cause (the first difference); also counts what differed further on
        seen = [cause for b in detector.breaks for cause in {b.cause, *b.also}]
        out.update({f"causes_seen.{cause}": float(seen.count(cause)) for cause in sorted(set(seen))})
        return out

    def _describe(self, stack: ResolvedStack, max_turns: int) -> dict[str, Any]:
        return {
            "model": stack.engine.model,
            "max_model_len": self._engine.max_model_len,
            "block_size": stack.engine.block_size,
            "max_turns_per_session": max_turns,
            "sessions": [{"id": p.trajectory.id, "turns_kept": p.num_turns, "cut": p.cut_reason,
                          "prompt_tokens": p.prompt_tokens, "max_cached_tokens": p.max_cached} for p in self._plans],
            "tools": [f"{t.info.namespace}/{t.info.name}" for t in self._tools] + ["bash (replayed)"],
            "harness_faults": "unstable_harness: tools shuffled every request, 'Current date and time' in the "
                              "instructions (session clock +37 s per request)",
            "forward": "EmbeddedClient (API layer + engine in process), max_output_tokens=1; ttft = that call's time",
        }

    async def teardown(self) -> None:
        logging.getLogger("loopstack.prefix").setLevel(self._log_level)
        for client in self._clients.values():
            client.state.store.close()
            client.state.live.close()
        self._clients.clear()
        if self._engine is not None:
            self._engine.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()

    def config(self) -> dict[str, Any]:
        return self._config
