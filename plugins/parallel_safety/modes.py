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

Fused input checks (parallel modes, a :class:`~.guard.HiddenStateGuard`, an engine that
captures hidden states): the check waits for the request's own prefill to pass the new
content (:mod:`.fused`), then judges the captured vector; the timeout counts from there.
When no capture can be had, the guard checks the text the standalone way.

Output chunks are windows over the generated tokens: the first ends after
``first_chunk_tokens``, then every ``chunk_tokens - overlap_tokens``, each window
``chunk_tokens`` long, so consecutive windows share ``overlap_tokens`` tokens and a
phrase of up to ``overlap_tokens + 1`` tokens split by a boundary lies whole in one.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from loopstack.api.response_builder import ResponseBuilder
from loopstack.items import TERMINAL_EVENT_TYPES
from loopstack.plugins.parallel_safety.fused import text_capture
from loopstack.plugins.parallel_safety.guard import (
    Guard,
    ItemType,
    Piece,
    Stage,
    Verdict,
    fused_pieces,
    guard_stages,
    is_hidden_state_guard,
    joined,
    run_check,
)

Mode = Literal["sequential", "stream_then_cut", "hold_until_pass"]
MODES: tuple[Mode, ...] = ("sequential", "stream_then_cut", "hold_until_pass")
TEXT_DELTAS = ("response.output_text.delta", "response.function_call_arguments.delta")


@dataclass(frozen=True)
class GuardPlan:
    """One guard as it runs for one request."""

    guard: Guard
    mode: Mode
    timeout_s: float
    fail_open: bool
    item_types: tuple[ItemType, ...] | None = None  # the input item types it sees (None: all)

    @property
    def gates(self) -> bool:
        return self.mode != "stream_then_cut"

    def applies(self, stage: Stage) -> bool:
        return stage in guard_stages(self.guard)

    def inputs(self, pieces: list[Piece]) -> list[Piece]:
        """The pieces of the input this guard checks (none when it has no input stage)."""
        if not self.applies("input"):
            return []
        return [p for p in pieces if self.item_types is None or p.item_type in self.item_types]


@dataclass(frozen=True)
class Chunking:
    chunk_tokens: int = 32
    overlap_tokens: int = 8
    first_chunk_tokens: int = 8

    def window_ends(self) -> Iterator[int]:
        """Where each output window ends, in generated tokens (without end)."""
        end = self.first_chunk_tokens
        while True:
            yield end
            end += self.chunk_tokens - self.overlap_tokens

    def start(self, end: int) -> int:
        return max(0, end - self.chunk_tokens)

    def windows(self, num_tokens: int) -> list[tuple[int, int]]:
        """``[start, stop)`` of every window the output checks of a finished stream of
        ``num_tokens`` tokens judge (what :meth:`GuardedResponse._output_checks` checks)."""
        out: list[tuple[int, int]] = []
        covered = 0
        for end in self.window_ends():
            stop = min(end, num_tokens)
            if stop > covered:
                out.append((self.start(end), stop))
                covered = stop
            if stop < end:
                return out
        return out


def input_text(items: list[dict[str, Any]]) -> str:
    """The new user and tool content of a request: what input guards check."""
    return joined(input_pieces(items))


def input_pieces(items: list[dict[str, Any]]) -> list[Piece]:
    """:func:`input_text` as its parts, in item order, each with its item type: a user
    message text (``message``), a tool output (``function_call_output``), or a tool search's
    output and each loaded tool's ``name: description`` (``tool_search_output``)."""
    parts: list[Piece] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message" and item.get("role", "user") == "user":
            content = item.get("content")
            if isinstance(content, str):
                parts.append(Piece(content, "message"))
            elif isinstance(content, list):
                parts += [Piece(p["text"], "message") for p in content
                          if isinstance(p, dict) and isinstance(p.get("text"), str)]
        elif kind in ("function_call_output", "tool_search_output"):
            output = item.get("output")
            parts.append(Piece(output if isinstance(output, str) else str(output), kind))
            # tools a search loaded: their descriptions come from (possibly untrusted) servers
            parts += [Piece(f"{t.get('name', '')}: {t.get('description', '')}", kind) for t in item.get("tools") or []
                      if isinstance(t, dict)]
    return [p for p in parts if p.text]


def _hidden_need(guard: Any, model: Any) -> tuple[int, int] | None:
    try:
        return guard.hidden_capture(model)
    except Exception:
        return None


def _vector_of(capture: asyncio.Future[Any]) -> asyncio.Future[Any]:
    """A future of the captured vector for one guard: its own, so that cancelling the guard's
    check leaves the capture alone; cancelled when the capture is lost (resolves to None)."""
    vector = capture.get_loop().create_future()

    def relay(done: asyncio.Future[Any]) -> None:
        if vector.done():
            return
        if done.cancelled() or done.result() is None:
            vector.cancel()
        else:
            vector.set_result(done.result())

    capture.add_done_callback(relay)
    return vector


async def _first_block(parts: list[asyncio.Future[Verdict]]) -> Verdict:
    """The fused verdict and the standalone one of the pieces the capture left out (when
    any): the first that blocks, else the fused one."""
    verdicts = await asyncio.gather(*parts)
    return next((v for v in verdicts if not v.passed), verdicts[0])


class _Tripped(Exception):
    def __init__(self, verdict: Verdict, stage: Stage) -> None:
        super().__init__(verdict.category)
        self.verdict = verdict
        self.stage = stage


class GuardedResponse:
    """The events of one response with its guards run around it (see the module doc)."""

    def __init__(self, job: Any, ctx: Any, plans: list[GuardPlan], inner: Callable[..., AsyncIterator[dict]],
                 *, chunking: Chunking, tokenizer: Any, fused_input: bool = True) -> None:
        self.job, self.ctx, self.plans, self.inner = job, ctx, plans, inner
        self.chunking = chunking
        self.tokenizer = tokenizer
        self.fused_input = fused_input
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
        self.first_generated_at: float | None = None  # the inner handler's first token arrived

    # -- the stream ----------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        pieces = input_pieces(self.job.prepared.new_items)
        try:
            try:
                await self._sequential_inputs(pieces)
                self._start(pieces)
                async for event in self._pump():
                    yield event
            except _Tripped as trip:
                await self._stop()
                for event in self._fail(trip):
                    yield event
        finally:
            await self._stop()

    async def _sequential_inputs(self, pieces: list[Piece]) -> None:
        first = [(i, p) for i, p in enumerate(self.plans) if p.mode == "sequential" and p.inputs(pieces)]
        verdicts = await asyncio.gather(*(self._check(p, p.inputs(pieces), "input") for _, p in first))
        for (i, plan), verdict in zip(first, verdicts):
            self._observe_verdict(plan, "standalone")
            if not verdict.passed:
                raise _Tripped(verdict, "input")
            self.input_passed[i] = True
            self.done.add((i, "input"))

    def _start(self, pieces: list[Piece]) -> None:
        capture, covered, fused = self._fuse(pieces)  # before the producer reaches the engine
        self.tasks.append(asyncio.create_task(self._produce()))
        for i, plan in enumerate(self.plans):
            if (i, "input") not in self.done:
                mine = plan.inputs(pieces)
                if capture is not None and i in fused:
                    self.tasks.append(asyncio.create_task(self._fused_input_check(i, plan, mine, covered, capture)))
                elif mine:
                    self.tasks.append(asyncio.create_task(self._input_check(i, plan, mine)))
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
                    if num and self.first_generated_at is None:
                        self.first_generated_at = time.perf_counter()
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
        if event.get("type") in TERMINAL_EVENT_TYPES:
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
            if self.first_generated_at is not None:
                self.ctx.observe("parallel_safety_first_token_held_seconds",
                                 self.first_token_at - self.first_generated_at,
                                 help="time the first generated token waited for the checks")
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
        except Exception as exc:
            self.queue.put_nowait(("error", exc))
        finally:
            await inner.aclose()

    async def _check(self, plan: GuardPlan, pieces: list[Piece], stage: Stage) -> Verdict:
        return await run_check(plan.guard, pieces, stage, timeout_s=plan.timeout_s, fail_open=plan.fail_open,
                               ctx=self.ctx)

    def _fuse(self, pieces: list[Piece]) -> tuple[asyncio.Future[Any] | None, list[Piece], set[int]]:
        """Ask the service for the hidden states the fused input checks need: the capture's
        future, the pieces it covers, and the plans it serves (those that want the first
        guard's layer, length and pieces: one capture per request)."""
        candidates = {i: plan for i, plan in enumerate(self.plans) if plan.mode != "sequential"
                      and plan.inputs(pieces) and is_hidden_state_guard(plan.guard)}
        if not (self.fused_input and candidates):
            return None, [], set()
        service, prepared = self.job.service, self.job.prepared
        model = service.hidden_state_model()
        needs = {}
        if model is not None:
            for i, plan in candidates.items():
                need = _hidden_need(plan.guard, model)
                covered = fused_pieces(plan.guard, plan.inputs(pieces)) if need is not None else []
                needs[i] = (need, tuple(covered)) if covered else None
        spec = next((need for need in needs.values() if need is not None), None)
        capture = None
        if spec is not None:
            (num_layers, max_tokens), covered = spec
            capture = text_capture(self.tokenizer, prepared.prompt_ids, [p.text for p in covered],
                                   num_layers=num_layers, max_tokens=max_tokens)
        future = None
        if capture is not None:
            try:
                future = service.request_hidden_state(prepared, capture)
            except ValueError:  # another middleware captures something else for this request
                future = None
        fused = {i for i, need in needs.items() if need == spec} if future is not None else set()
        for i, plan in candidates.items():
            self._count_fused(plan, "fused" if i in fused else "unfused")
        return future, list(spec[1]) if future is not None and spec else [], fused

    def _count_fused(self, plan: GuardPlan, outcome: str) -> None:
        self.ctx.count("parallel_safety_fused_checks_total", help="input checks of hidden-state guards: fused "
                       "(a capture asked for), unfused (none possible), lost (a fused one checked standalone)",
                       guard=plan.guard.name, outcome=outcome)

    async def _fused_input_check(self, i: int, plan: GuardPlan, pieces: list[Piece], covered: list[Piece],
                                 capture: asyncio.Future[Any]) -> None:
        rest = [p for p in pieces if p not in covered]
        parts = [asyncio.ensure_future(plan.guard.check_hidden(_vector_of(capture), stage="input", pieces=covered))]
        if rest:  # what the capture does not cover is checked the standalone way, alongside
            parts.append(asyncio.ensure_future(run_check(plan.guard, rest, "input", timeout_s=plan.timeout_s,
                                                         fail_open=plan.fail_open, ctx=self.ctx)))
        pending = asyncio.ensure_future(_first_block(parts))
        pending.add_done_callback(lambda done: [part.cancel() for part in parts] if done.cancelled() else None)
        try:
            hidden = await asyncio.shield(capture)  # the prefill passing the text: not the guard's time
        except BaseException:
            pending.cancel()
            raise
        if hidden is None:  # the generation ended first: judge the text the standalone way
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
            self._count_fused(plan, "lost")
            verdict = await self._check(plan, pieces, "input")
        else:
            verdict = await run_check(plan.guard, covered, "input", timeout_s=plan.timeout_s,
                                      fail_open=plan.fail_open, ctx=self.ctx, pending=pending)
        self._input_verdict(i, plan, verdict, "standalone" if hidden is None else "fused")

    async def _input_check(self, i: int, plan: GuardPlan, pieces: list[Piece]) -> None:
        self._input_verdict(i, plan, await self._check(plan, pieces, "input"), "standalone")

    def _observe_verdict(self, plan: GuardPlan, path: str) -> None:
        self.ctx.observe("parallel_safety_input_verdict_seconds", time.perf_counter() - self.started,
                         help="time from the request to its input verdict", guard=plan.guard.name, path=path)

    def _input_verdict(self, i: int, plan: GuardPlan, verdict: Verdict, path: str) -> None:
        self._observe_verdict(plan, path)
        if not verdict.passed:
            self.queue.put_nowait(("trip", _Tripped(verdict, "input")))
            return
        self.input_passed[i] = True
        self.done.add((i, "input"))
        self.queue.put_nowait(("progress", None))

    async def _output_checks(self, i: int, plan: GuardPlan) -> None:
        c = self.chunking
        for end in c.window_ends():
            async with self.grew:
                await self.grew.wait_for(lambda end=end: len(self.token_ids) >= end or self.finished)
            stop = min(end, len(self.token_ids))
            if stop > self.covered[i]:
                text = self.tokenizer.decode(self.token_ids[c.start(end):stop])
                verdict = await self._check(plan, [Piece(text, "output")], "output")
                if not verdict.passed:
                    self.queue.put_nowait(("trip", _Tripped(verdict, "output")))
                    return
                self.covered[i] = stop
                self.queue.put_nowait(("progress", None))
            if stop < end:  # the stream ended inside this window: every token is checked
                break
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
        builder = ResponseBuilder(prepared.response_id, self.job.service.response_echo(prepared), prepared.namespaced)
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
