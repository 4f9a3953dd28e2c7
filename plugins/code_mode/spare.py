"""A fresh V8 context kept ready, so an ``exec`` does not wait for one to start.

Creating a context (a V8 isolate plus the prelude) takes a few milliseconds, most of an
exec's own cost. :class:`SpareContexts` hands out a context that was started in the
background after the previous program ended, while the model was thinking. A spare
never ran a program, so "a fresh context per exec" still holds.

The refill is a plain asyncio task rather than one in a task group: the spare outlives
the request that asked for it by design. It belongs to one event loop; a spare of
another (finished) loop is discarded, and ``asyncio.run`` cancels a refill still running
when its loop ends.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from loopstack.plugins.code_mode.sandbox import V8Sandbox


class SpareStatistics(NamedTuple):
    num_taken: int
    num_ready_when_taken: int
    has_spare: bool


class SpareContexts:
    """Fresh :class:`V8Sandbox` contexts, one kept ready per event loop.

    Args:
        heap_bytes, max_log_chars: passed to :meth:`V8Sandbox.start`.
    """

    def __init__(self, *, heap_bytes: int, max_log_chars: int) -> None:
        self._heap_bytes = heap_bytes
        self._max_log_chars = max_log_chars
        self._spare: V8Sandbox | None = None
        self._refill: asyncio.Task[None] | None = None
        self._num_taken = 0
        self._num_ready = 0

    async def take(self) -> V8Sandbox:
        """A context that never ran a program: the spare when one is ready, else a new one."""
        self._num_taken += 1
        sandbox, self._spare = self._spare, None
        if sandbox is not None and sandbox.is_usable_here():
            self._num_ready += 1
            return sandbox
        if sandbox is not None:
            sandbox.close()
        return await self._start()

    def replenish(self) -> None:
        """Start the next spare in the background, unless one is ready or on its way.

        Call it once a program has finished: creating a context blocks the event loop for
        a few milliseconds (mini-racer creates the isolate synchronously), which should
        fall while the model thinks, not while a program runs.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not under asyncio: there is nothing to start a context on
            return
        if self._spare is None and (self._refill is None or self._refill.done()):
            self._refill = loop.create_task(self._fill())

    async def _start(self) -> V8Sandbox:
        return await V8Sandbox.start(heap_bytes=self._heap_bytes, max_log_chars=self._max_log_chars)

    async def _fill(self) -> None:
        sandbox = await self._start()
        if self._spare is not None:
            self._spare.close()
        self._spare = sandbox

    def close(self) -> None:
        """Dispose the spare and stop a refill in progress."""
        if self._refill is not None and not self._refill.done():
            self._refill.cancel()
        if self._spare is not None:
            self._spare.close()
            self._spare = None

    def statistics(self) -> SpareStatistics:
        return SpareStatistics(self._num_taken, self._num_ready, self._spare is not None)
