"""The tool-search bench: its data sets load as published, and a quick run reports every
metric the issue names, side by side (plugin off, plugin on)."""

from __future__ import annotations

import anyio
import pytest

from loopstack import PluginCatalog, StackLoader
from loopstack.bench.registry import workloads
from loopstack.bench.runner import run_bench
from loopstack.bench.workload import BenchOptions
from loopstack.plugins.tool_search.bench.datasets import (
    CATALOGS,
    RETRIEVAL_SETS,
    load_catalog,
    load_retrieval_set,
)
from loopstack.plugins.tool_search.bench.workload import ToolSearchWorkload
from tests.plugins.tool_search.support import HAS_DEFAULT_MODEL
from tests.support import REPO, SHARED_DATA

pytestmark = [
    pytest.mark.needs_data,
    pytest.mark.skipif(not (SHARED_DATA / "metatool").is_dir(), reason=f"needs ../shared/data ({SHARED_DATA} is absent)"),
]

SETS = ("metatool", "metatool_multi", "bfcl_multiple", "bfcl_live_multiple", "gorilla_hf", "gorilla_tf", "gorilla_torch")


def test_data_sets_load_as_published():
    sizes = {name: load_retrieval_set(name, SHARED_DATA) for name in RETRIEVAL_SETS}
    assert tuple(sizes) == SETS
    assert (len(sizes["metatool"].docs), len(sizes["metatool"].queries)) == (199, 20614)
    assert (len(sizes["metatool_multi"].docs), len(sizes["metatool_multi"].queries)) == (47, 497)
    assert len(sizes["bfcl_multiple"].queries) == 200 and len(sizes["bfcl_live_multiple"].queries) == 1053
    for dataset in sizes.values():  # every gold tool is in the searched catalog
        keys = {doc.key for doc in dataset.docs}
        assert all(query.gold <= keys and query.text for query in dataset.queries), dataset.name
    catalogs = {name: load_catalog(name, SHARED_DATA) for name in CATALOGS}
    assert {name: len(infos) for name, infos in catalogs.items()} == {
        "github_mcp": 117, "docker_registry": 4938, "metatool": 199}
    assert len({info.namespace for info in catalogs["docker_registry"]}) == 240


def test_the_workload_is_registered():
    assert isinstance(workloads(PluginCatalog.discover())["tool-search"], ToolSearchWorkload)


@pytest.mark.slow
@pytest.mark.timeout(900)  # embeds the 4,938-tool registry from a cold cache: minutes on 2 busy cores
def test_a_quick_run_reports_every_metric_off_and_on():
    loader = StackLoader(PluginCatalog.discover())
    stacks = [loader.load("baseline"), *(loader.load(REPO / "plugins" / "tool_search" / "stacks" / f"{name}.toml")
                                         for name in ("tool-search", "tool-search-learning"))]
    result = anyio.run(lambda: run_bench(ToolSearchWorkload(), stacks, BenchOptions(quick=True), progress=False))
    off, on, learning = result.columns
    for name in SETS:
        for metric in (f"recall@1.{name}", f"recall@5.{name}", f"ndcg@10.{name}"):
            assert 0.0 < result.metrics[metric][on] <= 1.0 and off not in result.metrics[metric]
        assert result.metrics[f"recall@5.{name}"][on] >= result.metrics[f"recall@1.{name}"][on]
    assert result.metrics["recall@5.bfcl_multiple"][on] > 0.8
    for catalog, fewer in (("github_mcp", 20), ("docker_registry", 200), ("metatool", 20)):
        tokens = result.metrics[f"schema_tokens.{catalog}"]
        assert tokens[off] / tokens[on] >= fewer, catalog
    p50, p99 = (result.metrics[f"search_ms_{p}.docker_registry"][on] for p in ("p50", "p99"))
    assert 0 < p50 <= p99
    assert result.metrics["index_build_s.docker_registry"][on] > 0
    plugin = result.config["tool_search"]["tool-search"]
    assert plugin["top_k"] == 5 and plugin["retriever"] == "hybrid"
    # the other retriever beside the configured one, under its own suffix
    other = "bm25" if plugin["retriever_used"] == "hybrid" else "hybrid"
    if other in plugin["measured"]:
        for name in SETS:
            assert 0.0 < result.metrics[f"recall@5_{other}.{name}"][on] <= 1.0
        assert result.metrics[f"search_ms_p99_{other}.docker_registry"][on] > 0
    if plugin["retriever_used"] == "hybrid":
        assert result.metrics["recall@5.metatool"][on] > result.metrics["recall@5_bm25.metatool"][on]
        assert result.config["embedding_model"]["weights_sha256"]
        # a restarted process reads the vectors an earlier one stored instead of embedding them
        restart = result.metrics["index_restart_s.docker_registry"][on]
        assert 0 < restart < result.metrics["index_build_s.docker_registry"][on] / 3
        # learning from use (its stack only): half of each set's questions remembered, the
        # other half searched without and with them
        for name in SETS:
            for metric in (f"recall@5_heldout.{name}", f"recall@5_learned.{name}"):
                assert 0.0 < result.metrics[metric][learning] <= 1.0 and on not in result.metrics[metric]
        # 100 remembered questions (quick) lift few of the other 100; on MetaTool, never fewer
        learned, heldout = (result.metrics[f"recall@5_{m}.metatool"][learning] for m in ("learned", "heldout"))
        assert learned >= heldout
        # the search's wait in the real loop (SmolLM2), embed_early on and off: measured once,
        # in the first hybrid column; every counted question is a search or a turn without one
        if HAS_DEFAULT_MODEL:
            for arm in ("early", "late"):
                searches, incomplete = (result.metrics[f"loop_{m}_{arm}.docker_registry"][on]
                                        for m in ("searches", "incomplete"))
                assert searches + incomplete == 3 and learning not in result.metrics[f"loop_searches_{arm}.docker_registry"]
                if searches:
                    assert 0 < result.metrics[f"loop_search_ms_p50_{arm}.docker_registry"][on]
                    # early: every search found its query embedded while the model wrote the call
                    cached = result.metrics[f"loop_query_cached_{arm}.docker_registry"][on]
                    assert cached == (1.0 if arm == "early" else 0.0)
