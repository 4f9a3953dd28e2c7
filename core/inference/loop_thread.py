"""An event loop on its own thread: where the router, its replicas and their event feeds live.

The router serves callers on any event loop (uvicorn's, a test's, the harness's); the replica pool
belongs to one loop. Keeping the pool, the routing decisions and the KV events on this one thread
means the index a policy reads is never changed under it, and no caller's loop owns the replicas.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """``run(coro)`` from any thread; ``submit(coro)`` for a future; ``close()`` stops the loop."""

    def __init__(self, name: str = "loopstack-router") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it (never from the loop's own thread)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.run called from its own loop: await the coroutine instead")
        return self.submit(coro).result(timeout)

    def call_soon(self, callback: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(callback, *args)

    def close(self, timeout: float = 10.0) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
