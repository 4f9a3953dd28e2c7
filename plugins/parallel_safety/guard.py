"""The guard interface: an async classifier over text that returns a :class:`Verdict`.

A guard is any object with a ``name`` and an async ``check(text, *, stage)``; ``stage``
is ``"input"`` (the request's new user and tool content) or ``"output"`` (a chunk of
generated text). Third-party guards come from the ``loopstack_guards(ctx)`` hook.

Example::

    class NoSecrets:
        name = "no_secrets"
        stages = ("output",)

        async def check(self, text: str, *, stage: str) -> Verdict:
            if "BEGIN PRIVATE KEY" in text:
                return Verdict.block(self.name, "secret", 1.0)
            return Verdict.allow(self.name)

What a check sees: the new content of the request joined (``check``), or, for a guard that
judges each kind of content for itself, the content as :class:`Piece` objects that name their
item type (``check_pieces``, :class:`PieceGuard`): a user ``message``, a
``function_call_output``, a ``tool_search_output`` (with the descriptions of the tools it
loaded), or generated ``output``. The stack's ``guards.<name>.item_types`` chooses which
input item types a guard sees at all.

A guard that can also judge the input from the serving model's own hidden states (a
*fused* input check, see :mod:`.fused`) implements :class:`HiddenStateGuard` as well.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

Stage = Literal["input", "output"]
STAGES: tuple[Stage, ...] = ("input", "output")
ItemType = Literal["message", "function_call_output", "tool_search_output", "output"]
INPUT_ITEM_TYPES: tuple[ItemType, ...] = ("message", "function_call_output", "tool_search_output")
ITEM_TYPES: tuple[ItemType, ...] = (*INPUT_ITEM_TYPES, "output")
GUARD_ERROR = "guard_error"
GUARD_TIMEOUT = "guard_timeout"


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check: pass, or block with a category and a score in [0, 1]."""

    passed: bool
    guard: str
    category: str | None = None
    score: float = 0.0
    detail: str = ""

    @classmethod
    def allow(cls, guard: str, score: float = 0.0) -> Verdict:
        return cls(True, guard, None, score)

    @classmethod
    def block(cls, guard: str, category: str, score: float = 1.0, detail: str = "") -> Verdict:
        return cls(False, guard, category, score, detail)


@dataclass(frozen=True)
class Piece:
    """One part of what a check judges: its text and the item type it came from."""

    text: str
    item_type: ItemType


def joined(pieces: Sequence[Piece]) -> str:
    return "\n".join(p.text for p in pieces)


@runtime_checkable
class Guard(Protocol):
    """What a guard provides. ``stages`` (optional, default both) says where it applies."""

    name: str

    async def check(self, text: str, *, stage: Stage) -> Verdict: ...


@runtime_checkable
class PieceGuard(Protocol):
    """A guard that judges each piece by its item type (the built-in classifier is one)."""

    name: str

    async def check_pieces(self, pieces: Sequence[Piece], *, stage: Stage) -> Verdict: ...


@runtime_checkable
class HiddenStateGuard(Protocol):
    """A guard whose input check can run on the engine's hidden states instead of a forward
    of its own (the fused check; the built-in classifier is one).

    ``hidden_capture(model)`` gets the serving model's ``ModelConfig`` and returns
    ``(num_layers, max_tokens)`` — the residual stream after that many decoder layers, averaged
    over the first and last ``max_tokens / 2`` tokens of the text in the prompt — or None when
    it has no weights for that model. ``fused_pieces(pieces)`` (optional; default: all of
    them) picks the pieces the capture covers; the others are checked the standalone way.
    ``check_hidden(hidden, stage=..., pieces=...)`` awaits that ``[hidden]`` float32 tensor
    (it resolves when prefill passes the covered pieces) and returns the verdict on them. Its
    timeout counts from the moment the tensor is there; a guard may start work that does not
    need it (a lookup, a network round trip) before.
    """

    name: str

    def hidden_capture(self, model: Any) -> tuple[int, int] | None: ...

    async def check_hidden(self, hidden: Awaitable[Any], *, stage: Stage, pieces: Sequence[Piece]) -> Verdict: ...


def guard_stages(guard: Any) -> Sequence[str]:
    return tuple(getattr(guard, "stages", STAGES))


def is_hidden_state_guard(guard: Any) -> bool:
    return callable(getattr(guard, "hidden_capture", None)) and callable(getattr(guard, "check_hidden", None))


def is_piece_guard(guard: Any) -> bool:
    return callable(getattr(guard, "check_pieces", None))


def fused_pieces(guard: Any, pieces: Sequence[Piece]) -> list[Piece]:
    """The pieces ``guard``'s fused check covers (all of them unless it says otherwise)."""
    choose = getattr(guard, "fused_pieces", None)
    return list(choose(pieces)) if callable(choose) else list(pieces)


def check_call(guard: Any, pieces: Sequence[Piece], stage: Stage) -> Awaitable[Verdict]:
    """The check of ``pieces``: by piece for a :class:`PieceGuard`, else on the joined text."""
    if is_piece_guard(guard):
        return guard.check_pieces(pieces, stage=stage)
    return guard.check(joined(pieces), stage=stage)


class DelayedGuard:
    """``inner`` plus a fixed delay: the bench's "real guard + N ms".

    A standalone check waits ``delay_s`` after the inner verdict. A fused check
    (:meth:`check_hidden`, when ``inner`` has one) waits for the inner verdict and for
    ``delay_s`` from the check's start, which is the request's start: the extra latency
    runs alongside the prefill, as the standalone check's own delay does in the parallel
    modes, instead of being pushed behind the capture.
    """

    def __init__(self, inner: Guard, delay_s: float, stages: Sequence[str] | None = None) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.name = inner.name
        self.stages = tuple(stages) if stages is not None else guard_stages(inner)

    async def check(self, text: str, *, stage: Stage) -> Verdict:
        verdict = await self.inner.check(text, stage=stage)
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)
        return verdict

    async def check_pieces(self, pieces: Sequence[Piece], *, stage: Stage) -> Verdict:
        verdict = await check_call(self.inner, pieces, stage)
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)
        return verdict

    def fused_pieces(self, pieces: Sequence[Piece]) -> list[Piece]:
        return fused_pieces(self.inner, pieces)

    def hidden_capture(self, model: Any) -> tuple[int, int] | None:
        return self.inner.hidden_capture(model) if is_hidden_state_guard(self.inner) else None

    async def check_hidden(self, hidden: Awaitable[Any], *, stage: Stage, pieces: Sequence[Piece]) -> Verdict:
        verdict, _ = await asyncio.gather(self.inner.check_hidden(hidden, stage=stage, pieces=pieces),
                                          asyncio.sleep(self.delay_s))
        return verdict


async def run_check(guard: Guard, pieces: Sequence[Piece], stage: Stage, *, timeout_s: float, fail_open: bool,
                    ctx: Any = None, pending: Awaitable[Verdict] | None = None) -> Verdict:
    """Run one check of ``pieces`` (:func:`check_call`) under ``timeout_s``. An error or a
    timeout blocks (category ``guard_error`` / ``guard_timeout``) unless ``fail_open``, which
    lets it pass. Records checks, outcomes and latency on ``ctx`` when given. ``pending``: a
    check already under way (a fused one) to wait for instead."""
    started = time.perf_counter()
    outcome = "pass"
    try:
        verdict = await asyncio.wait_for(pending if pending is not None else check_call(guard, pieces, stage),
                                         timeout_s)
        if not isinstance(verdict, Verdict):
            raise TypeError(f"guard {guard.name!r} returned {type(verdict).__name__}, not a Verdict")
        outcome = "pass" if verdict.passed else "block"
    except TimeoutError:
        outcome = "timeout"
        verdict = Verdict.block(guard.name, GUARD_TIMEOUT, 1.0, f"no verdict within {timeout_s} s")
    except Exception as exc:
        outcome = "error"
        verdict = Verdict.block(guard.name, GUARD_ERROR, 1.0, f"{type(exc).__name__}: {exc}")
    if outcome in ("timeout", "error") and fail_open:
        verdict = Verdict(True, guard.name, verdict.category, 0.0, verdict.detail)
    if ctx is not None:
        elapsed = time.perf_counter() - started
        ctx.count("parallel_safety_checks_total", help="guard checks run", guard=guard.name, stage=stage,
                  outcome=outcome)
        ctx.observe("parallel_safety_guard_seconds", elapsed, help="latency of one guard check",
                    guard=guard.name, stage=stage)
    return verdict
