"""Which tool calls of one program may overlap: concurrency-safe ones share, others run alone."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio


class ConcurrencyGate:
    """A shared/exclusive gate over the tool calls of one program.

    Calls of concurrency-safe tools (read-only lookups) run together; a call of a tool
    that is not concurrency-safe waits for every running call to end and runs alone.

    Example::

        gate = ConcurrencyGate()
        async with gate.hold(is_concurrency_safe=tool.is_concurrency_safe):
            result = await tool.call(arguments)
    """

    def __init__(self) -> None:
        self._condition = anyio.Condition()
        self._num_shared = 0
        self._is_exclusive = False

    @asynccontextmanager
    async def hold(self, *, is_concurrency_safe: bool) -> AsyncIterator[None]:
        async with self._condition:
            while self._is_exclusive or (not is_concurrency_safe and self._num_shared):
                await self._condition.wait()
            if is_concurrency_safe:
                self._num_shared += 1
            else:
                self._is_exclusive = True
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled call must still release the gate
                async with self._condition:
                    if is_concurrency_safe:
                        self._num_shared -= 1
                    else:
                        self._is_exclusive = False
                    self._condition.notify_all()
