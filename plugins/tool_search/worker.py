"""The thread tool searches run on, off the event loop.

A search can take a while: the first one over a large catalog indexes (and, with the
hybrid retriever, embeds) every tool, and a hybrid search runs a MiniLM forward for its
query. On the event loop that time would stall every other conversation the process
serves. :class:`SearchWorker` runs them on one dedicated thread instead, one at a time
(the catalogs are shared by sessions; :class:`.catalog.CatalogIndex` also locks).

That thread's torch uses ``torch_threads`` intra-op threads (1 by default; torch's thread
count is per calling thread, so the engine's threads are untouched). On a machine whose
cores are busy, for instance with the engine decoding, a forward split over 2 threads
waits at every parallel region for a descheduled peer: measured here with two busy
processes on 2 cores, a query's forward took p50 16 ms and p99 166 ms on 2 threads
against 11 ms and 33 ms on one (on an idle machine 2 threads are faster: 6 against 10 ms).
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import sniffio

__all__ = ["SearchWorker"]

T = TypeVar("T")


class SearchWorker:
    """One daemon thread for searches, started on first use.

    Args:
        torch_threads: torch intra-op threads on the worker thread (applied once torch is
            imported, which the hybrid retriever does on its first catalog).
    """

    def __init__(self, *, torch_threads: int = 1) -> None:
        if torch_threads < 1:
            raise ValueError(f"torch_threads must be at least 1, got {torch_threads}")
        self.torch_threads = torch_threads
        self._executor: ThreadPoolExecutor | None = None
        self._start_lock = threading.Lock()
        self._local = threading.local()
        self.num_runs = 0

    def _call(self, fn: Callable[[], T]) -> T:
        if not getattr(self._local, "has_torch_threads", False) and "torch" in sys.modules:
            import torch

            torch.set_num_threads(self.torch_threads)  # this thread only
            self._local.has_torch_threads = True
        self.num_runs += 1
        return fn()

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the worker thread. Under an event loop other than asyncio's it
        runs inline."""
        call = functools.partial(fn, *args)
        if sniffio.current_async_library() != "asyncio":
            return call()
        with self._start_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tool-search")
            executor = self._executor
        return await asyncio.get_running_loop().run_in_executor(executor, self._call, call)

    def close(self) -> None:
        """Stop the thread once its current search ends; queued searches are dropped."""
        with self._start_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
