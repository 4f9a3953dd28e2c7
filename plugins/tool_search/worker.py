"""The thread tool searches run on, off the event loop.

A search can take a while: the first one over a large catalog indexes (and, with the
hybrid retriever, embeds) every tool, and a hybrid search runs a MiniLM forward for its
query. On the event loop that time would stall every other conversation the process
serves. :class:`SearchWorker` runs them on one dedicated thread instead, one at a time
(the catalogs are shared by sessions; :class:`.catalog.CatalogIndex` also locks).

Torch's thread count is per calling thread, so the worker sets its own without touching
the engine's. ``torch_threads = 0`` (the plugin's default) picks per search: torch's
default (one per core) on an idle machine, one thread when the 1-minute load average says
the cores are taken. A forward split over 2 threads waits at every parallel region for a
descheduled peer. In one check here (two busy processes on 2 cores) a query's forward
took p50 16 ms and p99 166 ms on 2 threads against 11 ms and 33 ms on one; on the idle
machine that hour 2 threads were faster (6 against 10 ms). Later runs of
``scripts/tool_search_busy_latency.py`` found no difference either way (see
docs/techniques/tool-search.md).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import sniffio

__all__ = ["SearchWorker"]

T = TypeVar("T")

log = logging.getLogger(__name__)


class SearchWorker:
    """One thread for searches, started on first use.

    Args:
        torch_threads: torch intra-op threads on the worker thread (applied once torch is
            imported, which the hybrid retriever does on its first catalog); 0 picks per
            search from the load average (:meth:`threads_for_load`).
        load_average: the 1-minute load average (a parameter for tests).
    """

    def __init__(self, *, torch_threads: int = 0,
                 load_average: Callable[[], float] | None = None) -> None:
        if torch_threads < 0:
            raise ValueError(f"torch_threads must be 0 (automatic) or more, got {torch_threads}")
        self.torch_threads = torch_threads
        self._load_average = load_average or _load_average
        self._executor: ThreadPoolExecutor | None = None
        self._start_lock = threading.Lock()
        self._local = threading.local()
        self.num_runs = 0
        self.num_single_threaded = 0  # searches that ran on one torch thread

    def threads_for_load(self, default: int) -> int:
        """One thread when the load average reaches the core count (counting this process's
        own busy thread, the cores are then taken: a split forward would wait on its peers),
        else ``default``."""
        cores = os.cpu_count() or 1
        return 1 if self._load_average() >= cores else default

    def _call(self, fn: Callable[[], T], default_threads: int | None) -> T:
        self.num_runs += 1
        if default_threads is None:  # torch not imported: a BM25 search
            return fn()
        import torch

        wanted = self.torch_threads or self.threads_for_load(default_threads)
        self.num_single_threaded += wanted == 1
        if wanted == default_threads:
            if getattr(self._local, "threads", None) != wanted:
                torch.set_num_threads(wanted)
                self._local.threads = wanted
            return fn()
        # torch.set_num_threads sets the calling thread's OpenMP team size, and also the
        # process-wide count that threads started later begin with: put it back at once
        torch.set_num_threads(wanted)
        try:
            return fn()
        finally:
            torch.set_num_threads(default_threads)
            self._local.threads = default_threads

    def _started(self) -> ThreadPoolExecutor:
        with self._start_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tool-search")
            return self._executor

    @staticmethod
    def _default_threads() -> int | None:
        # the caller's (the event loop thread's) count is the process's default
        return sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the worker thread. Under an event loop other than asyncio's it
        runs inline."""
        call = functools.partial(fn, *args)
        if sniffio.current_async_library() != "asyncio":
            return call()
        executor = self._started()
        return await asyncio.get_running_loop().run_in_executor(executor, self._call, call, self._default_threads())

    def submit(self, fn: Callable[..., object], *args: object) -> Future[object]:
        """``fn(*args)`` on the worker thread, not awaited: a head start (searches queued
        after it run after it). An exception it raises is logged, never raised."""
        future = self._started().submit(self._call, functools.partial(fn, *args), self._default_threads())
        future.add_done_callback(_log_failure)
        return future

    def close(self) -> None:
        """Stop the thread once the searches already queued have run (a stack reload
        closes the old plugin while requests may still be searching); a later
        :meth:`run` starts a new thread."""
        with self._start_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)


def _log_failure(future: Future[object]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("tool_search: a background task on the search thread failed", exc_info=future.exception())


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average (Windows): assume an idle machine
        return 0.0
