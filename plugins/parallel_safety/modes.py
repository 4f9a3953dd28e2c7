"""How guards and inference overlap: one :class:`GuardedResponse` per request.

Modes, per guard:

* ``sequential``: the guard's input check finishes before inference starts (the
  baseline); its output checks gate release like ``hold_until_pass``.
* ``stream_then_cut``: inference starts at once and events are released at once; a
  trip cuts the stream with a ``response.failed`` event naming the guard and category.
* ``hold_until_pass``: inference starts at once; nothing is released until the input
  check has passed and every output chunk covering the released text has passed.

Whatever the mode, the terminal event (``response.completed`` ...) waits for every
check, and a trip cancels the generation: the inner handler runs in a producer task
that is cancelled, which aborts the engine request and frees its KV blocks.

Output chunks are windows over the generated tokens: the first ends after
``first_chunk_tokens``, then every ``chunk_tokens - overlap_tokens``, each window
``chunk_tokens`` long, so consecutive windows share ``overlap_tokens`` tokens and a
phrase of up to ``overlap_tokens + 1`` tokens split by a boundary lies whole in one.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from loopstack.api.response_builder import ResponseBuilder

from .guard import Guard, Stage, Verdict, guard_stages, run_check

Mode = Literal["sequential", "stream_then_cut", "hold_until_pass"]
MODES: tuple[Mode, ...] = ("sequential", "stream_then_cut", "hold_until_pass")
TEXT_DELTAS = ("response.output_text.delta", "response.function_call_arguments.delta")
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


@dataclass(frozen=True)
class GuardPlan:
    """One guard as it runs for one request."""

    guard: Guard
    mode: Mode
    timeout_s: float
    fail_open: bool

    @property
    def gates(self) -> bool:
        return self.mode != "stream_then_cut"

    def applies(self, stage: Stage) -> bool:
        return stage in guard_stages(self.guard)


@dataclass(frozen=True)
class Chunking:
    chunk_tokens: int = 32
    overlap_tokens: int = 8
    first_chunk_tokens: int = 8


def input_text(items: list[dict[str, Any]]) -> str:
    """The new user and tool content of a request: what input guards check."""
    parts: list[str] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message" and item.get("role", "user") == "user":
            content = item.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts += [p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        elif kind in ("function_call_output", "tool_search_output"):
            output = item.get("output")
            parts.append(output if isinstance(output, str) else str(output))
            # tools a search loaded: their descriptions come from (possibly untrusted) servers
            parts += [f"{t.get('name', '')}: {t.get('description', '')}" for t in item.get("tools") or []
                      if isinstance(t, dict)]
    return "\n".join(p for p in parts if p)


class _Tripped(Exception):
    def __init__(self, verdict: Verdict, stage: Stage) -> None:
        super().__init__(verdict.category)
        self.verdict = verdict
        self.stage = stage


class GuardedResponse:
    """The events of one response with its guards run around it (see the module doc)."""

    def __init__(self, job: Any, ctx: Any, plans: list[GuardPlan], inner: Callable[..., AsyncIterator[dict]],
                 *, chunking: Chunking, tokenizer: Any) -> None:
        self.job, self.ctx, self.plans, self.inner = job, ctx, plans, inner
        self.chunking = chunking
        self.tokenizer = tokenizer
        self.started = time.perf_counter()
        self.token_ids: list[int] = []
        self.finished = False
        self.grew = asyncio.Condition()
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.input_passed: dict[int, bool] = {}
        self.covered: dict[int, int] = {}  # plan index -> generated tokens its output checks passed
        self.done: set[tuple[int, str]] = set()  # (plan index, stage) with every check finished
        self.tasks: list[asyncio.Task] = []
        self.released_tokens = 0
        self.last_sequence = -1
        self.first_token_at: float | None = None

    # -- the stream ----------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        text = input_text(self.job.prepared.new_items)
        try:
            try:
                await self._sequential_inputs(text)
                self._start(text)
                async for event in self._pump():
                    yield event
            except _Tripped as trip:
                await self._stop()
                for event in self._fail(trip):
                    yield event
        finally:
            await self._stop()

    async def _sequential_inputs(self, text: str) -> None:
        first = [(i, p) for i, p in enumerate(self.plans) if p.mode == "sequential" and p.applies("input") and text]
        verdicts = await asyncio.gather(*(self._check(p, text, "input") for _, p in first))
        for (i, _), verdict in zip(first, verdicts):
            if not verdict.passed:
                raise _Tripped(verdict, "input")
            self.input_passed[i] = True
            self.done.add((i, "input"))

    def _start(self, text: str) -> None:
        self.tasks.append(asyncio.create_task(self._produce()))
        for i, plan in enumerate(self.plans):
            if (i, "input") not in self.done:
                if plan.applies("input") and text:
                    self.tasks.append(asyncio.create_task(self._input_check(i, plan, text)))
                else:
                    self.input_passed[i] = True
                    self.done.add((i, "input"))
            if plan.applies("output"):
                self.covered[i] = 0
                self.tasks.append(asyncio.create_task(self._output_checks(i, plan)))
            else:
                self.done.add((i, "output"))

    async def _pump(self) -> AsyncIterator[dict[str, Any]]:
        held: deque[tuple[int, dict[str, Any], int]] = deque()  # (token end, event, tokens in it)
        ended = False
        while not (ended and not held):
            kind, value = await self.queue.get()
            if kind == "trip":
                raise value
            if kind == "error":
                raise value
            if kind == "event":
                num = 0
                if value.get("type") in TEXT_DELTAS and value.get("delta"):
                    ids = self.tokenizer.encode(value["delta"])
                    num = len(ids)
                    self.token_ids.extend(ids)
                    async with self.grew:
                        self.grew.notify_all()
                held.append((len(self.token_ids), value, num))
            elif kind == "end":
                ended = self.finished = True
                async with self.grew:
                    self.grew.notify_all()
            while held and self._releasable(held[0][1], held[0][0]):
                _, event, num = held.popleft()
                self._released(event, num)
                yield event

    def _releasable(self, event: dict[str, Any], token_end: int) -> bool:
        if event.get("type") in TERMINAL:
            return len(self.done) == 2 * len(self.plans)
        for i, plan in enumerate(self.plans):
            if plan.gates and (not self.input_passed.get(i) or self.covered.get(i, token_end) < token_end):
                return False
        return True

    def _released(self, event: dict[str, Any], num_tokens: int) -> None:
        self.last_sequence = event.get("sequence_number", self.last_sequence + 1)
        if num_tokens and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            self.ctx.observe("parallel_safety_first_token_seconds", self.first_token_at - self.started,
                             help="time from request to first released token")
        self.released_tokens += num_tokens

    # -- background work -----------------------------------------------------------------------

    async def _produce(self) -> None:
        inner = self.inner(self.job, self.ctx)
        try:
            async for event in inner:
                self.queue.put_nowait(("event", event))
            self.queue.put_nowait(("end", None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised unchanged by the consumer
            self.queue.put_nowait(("error", exc))
        finally:
            await inner.aclose()

    async def _check(self, plan: GuardPlan, text: str, stage: Stage) -> Verdict:
        return await run_check(plan.guard, text, stage, timeout_s=plan.timeout_s, fail_open=plan.fail_open,
                               ctx=self.ctx)

    async def _input_check(self, i: int, plan: GuardPlan, text: str) -> None:
        verdict = await self._check(plan, text, "input")
        if not verdict.passed:
            self.queue.put_nowait(("trip", _Tripped(verdict, "input")))
            return
        self.input_passed[i] = True
        self.done.add((i, "input"))
        self.queue.put_nowait(("progress", None))

    async def _output_checks(self, i: int, plan: GuardPlan) -> None:
        c = self.chunking
        end = c.first_chunk_tokens
        while True:
            async with self.grew:
                await self.grew.wait_for(lambda end=end: len(self.token_ids) >= end or self.finished)
            stop = min(end, len(self.token_ids))
            if stop > self.covered[i]:
                text = self.tokenizer.decode(self.token_ids[max(0, end - c.chunk_tokens):stop])
                verdict = await self._check(plan, text, "output")
                if not verdict.passed:
                    self.queue.put_nowait(("trip", _Tripped(verdict, "output")))
                    return
                self.covered[i] = stop
                self.queue.put_nowait(("progress", None))
            if stop < end:  # the stream ended inside this window: every token is checked
                break
            end += c.chunk_tokens - c.overlap_tokens
        self.done.add((i, "output"))
        self.queue.put_nowait(("progress", None))

    async def _stop(self) -> None:
        tasks, self.tasks = self.tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the failure event ---------------------------------------------------------------------

    def _fail(self, trip: _Tripped) -> list[dict[str, Any]]:
        v = trip.verdict
        self.ctx.count("parallel_safety_trips_total", help="guard trips by guard and category", guard=v.guard,
                       category=v.category or "")
        self.ctx.observe("parallel_safety_released_before_cut_tokens", self.released_tokens,
                         help="generated tokens released before a trip cut the stream")
        prepared = self.job.prepared
        builder = ResponseBuilder(prepared.response_id, self.job.service.echo(prepared.request))
        events = builder.start() if self.last_sequence < 0 else []
        sequence = events[-1]["sequence_number"] + 1 if events else self.last_sequence + 1
        error = {
            "code": "guard_tripped",
            "message": f"guard {v.guard!r} blocked the {trip.stage} ({v.category}, score {v.score:.2f})",
            "guard": v.guard,
            "category": v.category,
            "stage": trip.stage,
            "score": v.score,
        }
        response = builder.snapshot("failed", error=error)
        return events + [{"type": "response.failed", "sequence_number": sequence, "response": response}]
