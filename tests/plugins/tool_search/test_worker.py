"""tool_search runs its index work on a worker thread: the event loop keeps serving while a
catalog syncs or a query is embedded, and concurrent searches still load a tool once."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import anyio
import pytest
import torch

from loopstack.harness.agent import Agent
from loopstack.plugins.tool_search.catalog import CatalogIndex
from loopstack.plugins.tool_search.search import SEARCH_TOOL_NAME
from loopstack.plugins.tool_search.worker import SearchWorker
from tests.plugins.tool_search.support import (
    ON,
    ScriptedModel,
    answer,
    call,
    github_tools,
    runtime_with,
)

BM25 = ON + 'retriever = "bm25"\n'


def _agent(tmp_path, outputs, stack=BM25):
    model = ScriptedModel(outputs)
    return Agent(model, github_tools(), instructions="Use tools.", runtime=runtime_with(tmp_path, stack), max_turns=6)


def test_a_slow_catalog_sync_does_not_stall_the_event_loop(tmp_path, monkeypatch):
    real_sync = CatalogIndex.sync

    def slow_sync(self, infos):  # a cold catalog: the registry's first hybrid sync takes ~30 s
        time.sleep(0.4)
        return real_sync(self, infos)

    monkeypatch.setattr(CatalogIndex, "sync", slow_sync)
    agent = _agent(tmp_path, [[call(SEARCH_TOOL_NAME, {"query": "open a new issue"}, "c1")], [answer("ok")]])
    beats = 0

    async def main():
        nonlocal beats

        async def heartbeat():
            nonlocal beats
            while True:
                await asyncio.sleep(0.01)
                beats += 1

        beat = asyncio.ensure_future(heartbeat())
        started = time.perf_counter()
        result = await agent.run("task")
        elapsed = time.perf_counter() - started
        beat.cancel()
        return result, elapsed

    result, elapsed = asyncio.run(main())
    assert result.final_text == "ok" and elapsed >= 0.4
    found = next(i for i in agent.items if i.get("call_id") == "c1" and i["type"] != "function_call")
    assert next(t["name"] for t in found["tools"]) == "create_issue"
    assert beats >= 20  # ~40 beats of 10 ms fit in the sync; on the loop there would be ~0


def test_concurrent_searches_of_one_turn_load_a_tool_once(tmp_path):
    outputs = [
        [call(SEARCH_TOOL_NAME, {"query": "open a new issue", "limit": 1}, "c1"),
         call(SEARCH_TOOL_NAME, {"query": "create_issue", "limit": 1}, "c2")],
        [answer("ok")],
    ]
    agent = _agent(tmp_path, outputs)
    anyio.run(agent.run, "task")
    results = [next(i for i in agent.items if i.get("call_id") == c and i["type"] != "function_call")
               for c in ("c1", "c2")]
    loaded = [t["name"] for item in results for t in item.get("tools", [])]
    assert loaded == ["create_issue"]  # one of the two loaded it, the other says it is loaded
    assert any("Already loaded: create_issue" in str(item.get("output")) for item in results)


def test_the_worker_sets_torch_threads_on_its_own_thread_only():
    before = torch.get_num_threads()
    worker = SearchWorker(torch_threads=1)

    async def main():
        return await worker.run(torch.get_num_threads), await worker.run(lambda: threading.current_thread().name)

    try:
        threads, name = asyncio.run(main())
    finally:
        worker.close()
    assert threads == 1 and name.startswith("tool-search")
    assert torch.get_num_threads() == before
    assert worker.num_runs == 2
    started_later = []  # the process-wide count new threads begin with is put back
    thread = threading.Thread(target=lambda: started_later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert started_later == [before]


def test_the_worker_rejects_a_bad_thread_count():
    with pytest.raises(ValueError, match="torch_threads must be 0"):
        SearchWorker(torch_threads=-1)


def test_automatic_threads_follow_the_load_average():
    load = {"now": 0.0}
    worker = SearchWorker(load_average=lambda: load["now"])
    cores = os.cpu_count() or 1

    async def threads():
        return await worker.run(torch.get_num_threads)

    try:
        idle = asyncio.run(threads())
        load["now"] = float(cores)  # every core taken
        busy = asyncio.run(threads())
        load["now"] = 0.0
        again = asyncio.run(threads())
    finally:
        worker.close()
    assert busy == 1 and idle == again == torch.get_num_threads()  # the caller's count is the default
    assert worker.num_single_threaded == (3 if idle == 1 else 1)
    # a thread started after a single-threaded search begins with the default, not with 1
    started_later = []
    thread = threading.Thread(target=lambda: started_later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert started_later == [torch.get_num_threads()]


def test_bm25_searches_of_a_built_catalog_skip_the_hop(tmp_path):
    outputs = [
        [call(SEARCH_TOOL_NAME, {"query": "open a new issue", "limit": 1}, "c1")],
        [call(SEARCH_TOOL_NAME, {"query": "merge a pull request", "limit": 1}, "c2")],
        [answer("ok")],
    ]
    agent = _agent(tmp_path, outputs)
    anyio.run(agent.run, "task")
    plugin = agent.runtime.instance("tool_search")
    assert plugin.worker.num_runs == 1  # the first search built the catalog there; the second ran inline
    assert plugin.retriever == "bm25"
