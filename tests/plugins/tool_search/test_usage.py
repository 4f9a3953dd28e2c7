"""tool_search learning from use: the usage memory, its place in the hybrid score, and the
plugin remembering a search whose tool the model then called."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from loopstack.harness.agent import Agent
from loopstack.plugins.tool_search.retrieval.hybrid import HybridIndex
from loopstack.plugins.tool_search.retrieval.index import ToolDoc
from loopstack.plugins.tool_search.retrieval.usage import UsageMemory
from loopstack.plugins.tool_search.search import SEARCH_TOOL_NAME
from tests.plugins.tool_search.support import (
    ON,
    ScriptedModel,
    answer,
    call,
    github_tools,
    minilm_embedder,
    needs_minilm,
    runtime_with,
)

# no disk store: what one test learns must not reach the next (the restart test has its own file)
LEARN = ON + 'usage_weight = 1.0\nvector_cache = ""\n'


def _unit(*values: float) -> np.ndarray:
    vector = np.array(values, dtype=np.float32)
    return vector / np.linalg.norm(vector)


# -- the memory -------------------------------------------------------------------------


def test_each_tool_gets_its_best_remembered_similarity_from_the_floor_up():
    memory = UsageMemory(3, floor=0.5)
    assert memory.add("book a room", _unit(1, 0, 0), "hotel")
    assert memory.add("a bed for tonight", _unit(1, 1, 0), "hotel")
    assert memory.add("weather", _unit(0, 1, 0), "forecast")
    assert not memory.add("book a room", _unit(1, 0, 0), "hotel")  # known pair: nothing new
    assert memory.add("gone", _unit(0, 0, 1), "removed_tool")  # not in the catalog below
    slots = {"hotel": 0, "forecast": 2}
    got = memory.similarities(_unit(1, 0.1, 0), slots, 4, slots_version=1)
    assert got[0] == pytest.approx(float(_unit(1, 0.1, 0) @ _unit(1, 0, 0)))  # the better of its two
    assert got[1] == 0 and got[3] == 0  # slots without a remembered query
    assert got[2] == 0  # cosine 0.0995 to "weather": under the floor
    assert len(memory) == 4


def test_the_memory_is_bounded_and_checks_shapes():
    memory = UsageMemory(2, max_entries=2, floor=0.0)
    for i, tool in enumerate(["a", "b", "c"]):
        memory.add(f"query {i}", _unit(1, i), tool)
    slots = {"a": 0, "b": 1, "c": 2}
    got = memory.similarities(_unit(1, 1), slots, 3, slots_version=0)
    assert len(memory) == 2 and got[0] == 0 and got[1] > 0 and got[2] > 0  # "a" went first
    # a slot change with the same memory is picked up through the version
    moved = memory.similarities(_unit(1, 1), {"b": 2, "c": 0}, 3, slots_version=1)
    assert moved[2] == pytest.approx(got[1]) and moved[0] == pytest.approx(got[2])
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        memory.add("bad", np.zeros(3, dtype=np.float32), "a")
    with pytest.raises(ValueError, match="max_entries"):
        UsageMemory(2, max_entries=0)


# -- in the hybrid score ----------------------------------------------------------------

TOOLS = [
    ToolDoc("search_flights", "search_flights", "travel", description="Find flights between two airports",
            parameters="origin destination date"),
    ToolDoc("book_hotel", "book_hotel", "travel", description="Reserve a room at a hotel for the given dates",
            parameters="city check_in check_out"),
    ToolDoc("get_forecast", "get_forecast", "weather", description="Weather forecast for a city",
            parameters="city days"),
    ToolDoc("internet_search", "internet_search", "web", description="Search the web for anything",
            parameters="query"),
]


@pytest.fixture(scope="module")
def embedder():
    return minilm_embedder()


def _index(embedder, usage_weight: float) -> HybridIndex:
    index = HybridIndex(embedder, usage_weight=usage_weight)
    for doc in TOOLS:
        index.upsert(doc)
    index.flush()
    return index


@needs_minilm
def test_a_remembered_use_lifts_the_tool_for_like_queries_only(embedder):
    learned, off = _index(embedder, 0.5), _index(embedder, 0.0)
    query = "what are the latest NFT prices on OpenSea"  # like the remembered one, not like any tool's text
    before = [hit.key for hit in learned.search(query, 4)]
    assert "internet_search" not in before
    for index in (learned, off):
        assert index.remember("NFT prices on OpenSea today", "internet_search")
        assert not index.remember("NFT prices on OpenSea today", "no_such_tool")  # not in the catalog
    assert learned.search(query, 1)[0].key == "internet_search"
    assert [hit.key for hit in off.search(query, 4)] == before  # weight 0: learning changes nothing
    unrelated = "quantum teleportation of cats"
    assert [hit.key for hit in learned.search(unrelated, 4)] == [hit.key for hit in off.search(unrelated, 4)]
    learned.remove("internet_search")  # a tool that left the catalog is never a hit
    assert "internet_search" not in [hit.key for hit in learned.search(query, 4)]


# -- the plugin -------------------------------------------------------------------------


def _run(tmp_path, body: str, outputs, name: str = "s"):
    runtime = runtime_with(tmp_path, body, name=name)
    agent = Agent(ScriptedModel(outputs), github_tools(), instructions="", runtime=runtime)
    anyio.run(agent.run, "go")
    plugin = runtime.instance("tool_search")
    [catalog] = plugin.catalogs.catalogs()
    return catalog, runtime


def _remembered(catalog) -> list[tuple[str, str]]:
    return catalog.index.usage.pairs() if isinstance(catalog.index, HybridIndex) else []


@needs_minilm
def test_a_search_whose_tool_is_then_called_is_remembered_once(tmp_path):
    search = call(SEARCH_TOOL_NAME, {"query": "open a new issue", "limit": 2}, "c1")
    create = call("create_issue", {"owner": "o", "repo": "r", "title": "t"}, "c2")
    again = call("create_issue", {"owner": "o", "repo": "r", "title": "u"}, "c3")
    catalog, runtime = _run(tmp_path, LEARN, [[search], [create], [again], [answer("ok")]])
    assert _remembered(catalog) == [("open a new issue", "create_issue")]  # the second call adds nothing
    metrics = {m["name"]: m for m in runtime.metrics.snapshot()["metrics"]}
    assert sum(s["value"] for s in metrics["tool_search_learned_uses_total"]["series"]) == 1


@needs_minilm
def test_failed_calls_unsearched_calls_and_the_default_usage_weight_teach_nothing(tmp_path):
    search = call(SEARCH_TOOL_NAME, {"query": "open a new issue", "limit": 2}, "c1")
    bad = call("create_issue", {"owner": "o"}, "c2")  # missing arguments: an error result
    catalog, _ = _run(tmp_path, LEARN, [[search], [bad], [answer("ok")]], name="bad")
    assert _remembered(catalog) == []
    direct = call("list_issues", {"owner": "o", "repo": "r"}, "c1")  # called by name, never searched
    catalog, _ = _run(tmp_path, LEARN, [[direct], [answer("ok")]], name="direct")
    assert _remembered(catalog) == []
    create = call("create_issue", {"owner": "o", "repo": "r", "title": "t"}, "c2")
    catalog, _ = _run(tmp_path, ON, [[search], [create], [answer("ok")]], name="off")  # usage_weight = 0
    assert _remembered(catalog) == []


@needs_minilm
def test_learned_uses_survive_a_restart_in_the_disk_store(tmp_path):
    stack = ON + f'usage_weight = 1.0\nvector_cache = "{tmp_path / "vectors.sqlite3"}"\n'
    search = call(SEARCH_TOOL_NAME, {"query": "open a new issue", "limit": 2}, "c1")
    create = call("create_issue", {"owner": "o", "repo": "r", "title": "t"}, "c2")
    catalog, _ = _run(tmp_path, stack, [[search], [create], [answer("ok")]], name="first")
    assert _remembered(catalog) == [("open a new issue", "create_issue")] and catalog.num_restored_uses == 0
    # a restarted agent: a new plugin, so new catalogs with empty memories; the first search
    # syncs the catalog, which reads back what the first one learned
    again = call(SEARCH_TOOL_NAME, {"query": "file a bug report", "limit": 2}, "c1")
    catalog, _ = _run(tmp_path, stack, [[again], [answer("ok")]], name="second")
    assert catalog.num_restored_uses == 1 and _remembered(catalog) == [("open a new issue", "create_issue")]
    # learning off: nothing is read back (nor written)
    catalog, _ = _run(tmp_path, ON + f'vector_cache = "{tmp_path / "vectors.sqlite3"}"\n', [[again], [answer("ok")]],
                      name="off")
    assert catalog.num_restored_uses == 0 and _remembered(catalog) == []
