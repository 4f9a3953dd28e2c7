"""Prefill admission: the router holds requests for a replica and releases the shortest prefill first.

A replica serves its queue first come, first served: in a burst, a 60-token turn waits behind every
600-token prompt that arrived before it. The router knows each request's uncached prefill before
it sends it (the prompt, and what the policy believes cached there), so it can keep a replica's
queue short and decide the order itself: a request is sent once the uncached prefill already sent
to that replica and not yet answered (no first output) is under ``budget_tokens``, and among the
requests waiting for the same replica the one with the fewest uncached tokens goes first
(shortest job first: the order that minimizes the mean and median wait of a queue). A request
waiting longer than ``max_wait_s`` goes before every shorter one (no request starves), and a
request larger than the budget goes alone when nothing is outstanding.

Sans-I/O apart from one ``asyncio.Future`` per held request: :meth:`wait` returns when the
request may be sent, :meth:`prefilled` (first output) and :meth:`finished` (end, error or
cancellation; always called) give its tokens back.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["AdmissionStatistics", "PrefillAdmission"]


@dataclass(order=True)
class _Held:
    num_tokens: int
    seq: int
    key: object = field(compare=False)
    held_at: float = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)


class AdmissionStatistics(NamedTuple):
    num_held: tuple[int, ...]  # requests waiting per replica now
    num_outstanding_tokens: tuple[int, ...]  # uncached prefill sent and not yet answered, per replica
    num_admitted_at_once: int  # requests that never waited
    num_admitted_after_wait: int
    num_aged: int  # released ahead of shorter ones because they waited max_wait_s
    total_wait_s: float


class PrefillAdmission:
    """Per-replica prefill budgets with shortest-first release.

    Args:
        num_replicas: replicas indexed 0..n-1.
        budget_tokens: uncached prefill tokens a replica may have outstanding (sent, no first output).
        max_wait_s: a request held this long is released before shorter ones (None: never).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, num_replicas: int, *, budget_tokens: int, max_wait_s: float | None = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if budget_tokens < 1:
            raise ValueError(f"budget_tokens must be at least 1, got {budget_tokens}")
        self.budget_tokens = budget_tokens
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._outstanding = [0] * num_replicas
        self._held: list[list[_Held]] = [[] for _ in range(num_replicas)]
        self._sent: dict[object, tuple[int, int]] = {}  # key -> (replica, tokens still counted)
        self._seq = itertools.count()
        self._counts = {"at_once": 0, "after_wait": 0, "aged": 0}
        self._total_wait_s = 0.0

    async def wait(self, key: object, index: int, num_tokens: int) -> None:
        """Return when ``key`` (``num_tokens`` uncached prefill tokens) may be sent to ``index``."""
        num_tokens = max(0, num_tokens)
        if not self._held[index] and self._fits(index, num_tokens):
            self._counts["at_once"] += 1
            self._send(key, index, num_tokens)
            return
        held = _Held(num_tokens, next(self._seq), key, self._clock(), asyncio.get_running_loop().create_future())
        heapq.heappush(self._held[index], held)
        try:
            while True:
                timeout = self._until_aged(index)
                try:
                    await asyncio.wait_for(asyncio.shield(held.future), timeout)
                    return
                except TimeoutError:
                    self._release(index)  # someone (maybe this one) aged: re-run the release
        except BaseException:
            if held.future.done() and not held.future.cancelled():
                self.finished(key)  # released while being cancelled: give its tokens back
            else:
                held.future.cancel()
                self._drop(index, held)
            raise

    def sent_now(self, key: object, index: int, num_tokens: int) -> None:
        """``key`` goes to ``index`` without waiting (a request this admission does not order); its
        tokens count against the budget all the same."""
        self._send(key, index, max(0, num_tokens))

    def prefilled(self, key: object) -> None:
        """``key``'s first output arrived: its prefill no longer holds the replica's budget."""
        index, tokens = self._sent.get(key, (None, 0))
        if index is None or not tokens:
            return
        self._outstanding[index] -= tokens
        self._sent[key] = (index, 0)
        self._release(index)

    def finished(self, key: object) -> None:
        """``key`` ended (finished, failed or cancelled); safe to call for a key never sent."""
        index, tokens = self._sent.pop(key, (None, 0))
        if index is None:
            return
        self._outstanding[index] -= tokens
        self._release(index)

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(
            num_held=tuple(len(held) for held in self._held),
            num_outstanding_tokens=tuple(self._outstanding),
            num_admitted_at_once=self._counts["at_once"], num_admitted_after_wait=self._counts["after_wait"],
            num_aged=self._counts["aged"], total_wait_s=self._total_wait_s,
        )

    # -- internals ---------------------------------------------------------------------------------

    def _fits(self, index: int, num_tokens: int) -> bool:
        outstanding = self._outstanding[index]
        return outstanding == 0 or outstanding + num_tokens <= self.budget_tokens

    def _send(self, key: object, index: int, num_tokens: int) -> None:
        self._outstanding[index] += num_tokens
        self._sent[key] = (index, num_tokens)

    def _release(self, index: int) -> None:
        held = self._held[index]
        while held:
            aged = self._oldest_aged(index)
            candidate = aged if aged is not None else held[0]
            if not self._fits(index, candidate.num_tokens):
                return  # the shortest (or the aged one) does not fit: wait for budget
            if aged is not None:
                held.remove(aged)
                heapq.heapify(held)
                self._counts["aged"] += 1
            else:
                heapq.heappop(held)
            self._counts["after_wait"] += 1
            self._total_wait_s += self._clock() - candidate.held_at
            self._send(candidate.key, index, candidate.num_tokens)
            candidate.future.set_result(None)

    def _oldest_aged(self, index: int) -> _Held | None:
        if self.max_wait_s is None:
            return None
        now = self._clock()
        aged = [held for held in self._held[index] if now - held.held_at >= self.max_wait_s]
        return min(aged, key=lambda held: held.seq) if aged else None

    def _until_aged(self, index: int) -> float | None:
        if self.max_wait_s is None:
            return None
        now = self._clock()
        young = [held.held_at for held in self._held[index] if now - held.held_at < self.max_wait_s]
        # an aged request needs no timer: it goes first at the next prefilled/finished
        return min(young) + self.max_wait_s - now + 1e-3 if young else None

    def _drop(self, index: int, held: _Held) -> None:
        with_out = [h for h in self._held[index] if h is not held]
        heapq.heapify(with_out)
        self._held[index] = with_out
        self._release(index)  # a shorter one behind it may fit now
