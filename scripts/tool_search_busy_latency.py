"""Hybrid tool-search latency at 4,938 tools with the cores idle and with them taken.

For each ``search_threads`` setting (1, 2 and 0 = automatic), the same searches as the
``tool-search`` bench's latency loop run through ``search_tools_async`` on the plugin's
worker, first on an idle machine, then while ``--busy`` processes spin (one per core by
default). Prints p50 and p99 in ms. Usage::

    .venv/bin/python scripts/tool_search_busy_latency.py [--queries 300] [--busy 2]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import statistics
import time
from pathlib import Path

from loopstack import PluginCatalog, StackLoader
from loopstack.context import Session
from loopstack.plugins.tool_search.bench.datasets import load_catalog, load_retrieval_set
from loopstack.plugins.tool_search.catalog import CatalogIndex
from loopstack.plugins.tool_search.retrieval.embedder import load_embedder
from loopstack.plugins.tool_search.search import search_tools_async
from loopstack.plugins.tool_search.state import STATE_KEY, RequestTools
from loopstack.plugins.tool_search.worker import SearchWorker
from loopstack.runtime import StackRuntime

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


async def _measure(runtime: StackRuntime, tools: RequestTools, queries: list[str],
                   threads: int) -> tuple[float, float]:
    worker = SearchWorker(torch_threads=threads)
    try:
        for query in queries[:3]:
            await worker.run(tools.catalog.search, query, 5)  # type: ignore[union-attr]
        times = []
        for query in queries:
            ctx = runtime.context(session=Session())  # a fresh session: every hit loads
            ctx.state(STATE_KEY, lambda: tools)
            started = time.perf_counter()
            await search_tools_async(ctx, query, limit=5, worker=worker)
            times.append((time.perf_counter() - started) * 1000)
    finally:
        worker.close()
    cuts = statistics.quantiles(times, n=100, method="inclusive")
    return cuts[49], cuts[98]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="spinning processes")
    parser.add_argument("--settle", type=float, default=30.0, help="seconds of spinning before measuring")
    args = parser.parse_args()
    catalog = PluginCatalog.discover()
    runtime = StackRuntime(StackLoader(catalog).load("baseline"), catalog)
    infos = load_catalog("docker_registry", DATA)
    rng = random.Random(0)
    prose = [q.text for name in ("metatool", "bfcl_live_multiple") for q in load_retrieval_set(name, DATA).queries]
    # a distinct sample per run: the embedder caches the vectors of recent queries
    samples = iter([rng.sample(prose, args.queries) for _ in range(6)])
    tools = RequestTools(deferred={info.name: info for info in infos},
                         catalog=CatalogIndex(embedder=load_embedder()))
    tools.sync()
    for label in ("idle", "busy"):
        spinners = []
        if label == "busy":
            spinners = [multiprocessing.Process(target=_spin, args=(3600,), daemon=True) for _ in range(args.busy)]
            for process in spinners:
                process.start()
            time.sleep(args.settle)  # the load average lags: let it see the spinners
        try:
            for threads in (1, 2, 0):
                p50, p99 = asyncio.run(_measure(runtime, tools, next(samples), threads))
                name = "auto" if threads == 0 else str(threads)
                print(f"{label:4s} search_threads={name:4s} p50 {p50:6.2f} ms  p99 {p99:7.2f} ms  "
                      f"(load average {os.getloadavg()[0]:.1f})", flush=True)
        finally:
            for process in spinners:
                process.terminate()


if __name__ == "__main__":
    main()
