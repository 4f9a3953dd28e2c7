"""Workload ``tool-search``: retrieval quality, schema tokens and search latency.

Columns are stacks. In a stack with the plugin off every tool schema is sent up front:
the column reports ``schema_tokens.<catalog>`` only. With the plugin on, the same
catalogs go through the plugin's own ``loopstack_visible_tools`` (what is left up front
is counted), retrieval is measured on every (query, gold tool) set with the stack's
index settings, and search latency on the 4,938-tool Docker MCP registry.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from loopstack.bench.workload import BenchOptions, Workload
from loopstack.context import Session
from loopstack.plugin_manager import PluginCatalog
from loopstack.runtime import StackRuntime
from loopstack.stack_schema import ResolvedStack
from loopstack.tools import ToolInfo, ToolSet
from tqdm import tqdm

from .catalog import CatalogIndex
from .datasets import CATALOGS, RETRIEVAL_SETS, load_catalog, load_retrieval_set
from .docs import function_tool
from .plugin import ToolSearch
from .retrieval import build_index, evaluate, lexical_overlap
from .schema_tokens import schema_tokens
from .search import ToolSearchTool, search_tools
from .state import STATE_KEY, RequestTools
from .terms import STEMMER

__all__ = ["ToolSearchWorkload"]

QUICK_QUERIES = 200
LATENCY_QUERIES = 2000
LATENCY_CATALOG = "docker_registry"


class _Column:
    def __init__(self, runtime: StackRuntime) -> None:
        self.runtime = runtime
        plugin = runtime.instance("tool_search")
        self.plugin = plugin if isinstance(plugin, ToolSearch) else None
        self.retrieval: dict[str, float] | None = None  # deterministic: measured once


class ToolSearchWorkload(Workload):
    name = "tool-search"
    description = "deferred tools: retrieval recall/nDCG, schema tokens up front, search latency (plugin off vs on)"
    default_steps = 1

    def __init__(self) -> None:
        self._columns: dict[str, _Column] = {}
        self._root = Path()
        self._limit: int | None = None
        self._seed = 0
        self._catalogs: dict[str, list[ToolInfo]] = {}
        self._sizes: dict[str, Any] = {}
        self._load_average: float | None = None

    async def setup(self, columns: list[str], stacks: list[ResolvedStack], options: BenchOptions) -> None:
        self._root = options.data_dir
        if not (self._root / "metatool").is_dir():
            raise FileNotFoundError(f"the tool-search workload reads ../shared/data; {self._root} has no metatool/")
        self._limit = QUICK_QUERIES if options.quick else None
        self._seed = options.seed
        catalog = PluginCatalog.discover()
        for column, stack in zip(columns, stacks):
            self._columns[column] = _Column(StackRuntime(stack, catalog))
        self._catalogs = {name: load_catalog(name, self._root) for name in CATALOGS}

    async def step(self, column: str, index: int) -> dict[str, float]:
        state = self._columns[column]
        metrics = {f"schema_tokens.{name}": float(self._schema_tokens(state, infos))
                   for name, infos in self._catalogs.items()}
        if state.plugin is None:
            return metrics
        if state.retrieval is None:
            state.retrieval = self._retrieval(state.plugin)
        metrics.update(state.retrieval)
        metrics.update(self._latency(state))
        return metrics

    # -- tokens ------------------------------------------------------------------------

    def _schema_tokens(self, state: _Column, infos: list[ToolInfo]) -> int:
        """Schema tokens the request carries up front, through the stack's own hooks."""
        ctx = state.runtime.context(session=Session())
        extra = ctx.hooks.extra_tools(ctx)
        tools = ToolSet([*infos, *(tool.info for tool in extra)])
        ctx.hooks.visible_tools(tools=tools, ctx=ctx)
        return schema_tokens(function_tool(info) for info in tools.visible())

    # -- retrieval ---------------------------------------------------------------------

    def _retrieval(self, plugin: ToolSearch) -> dict[str, float]:
        out: dict[str, float] = {}
        cfg = plugin.config
        for name in RETRIEVAL_SETS:
            dataset = load_retrieval_set(name, self._root)
            queries = dataset.queries
            if self._limit is not None and len(queries) > self._limit:
                queries = random.Random(self._seed).sample(queries, self._limit)
            index = build_index(dataset, plugin.weights, k1=cfg.k1, b=cfg.b)
            scores = evaluate(index, queries, lambda q, n=name: tqdm(q, desc=f"  {n}", leave=False, unit="q"))
            out[f"recall@1.{name}"] = scores.recall_at_1
            out[f"recall@5.{name}"] = scores.recall_at_5
            out[f"ndcg@10.{name}"] = scores.ndcg_at_10
            out[f"lexical_overlap.{name}"] = lexical_overlap(dataset)  # the ceiling of term matching
            self._sizes[name] = {"tools": scores.num_tools, "queries": scores.num_queries}
        return out

    # -- latency -----------------------------------------------------------------------

    def _latency_queries(self) -> list[str]:
        rng = random.Random(self._seed)
        prose = [q.text for q in load_retrieval_set("metatool", self._root).queries]
        prose += [q.text for q in load_retrieval_set("bfcl_live_multiple", self._root).queries]
        names = [info.name for info in self._catalogs[LATENCY_CATALOG]]
        count = self._limit or LATENCY_QUERIES
        return rng.sample(prose, count) + rng.sample(names, max(count // 10, 1))

    def _latency(self, state: _Column) -> dict[str, float]:
        assert state.plugin is not None
        cfg = state.plugin.config
        infos = self._catalogs[LATENCY_CATALOG]
        catalog = CatalogIndex(state.plugin.weights, k1=cfg.k1, b=cfg.b)
        build = catalog.sync(infos)
        # one server changes its list: a tool goes, one is edited
        server = infos[0].namespace
        changed = [i for i in infos if i.namespace != server or i is not infos[0]]
        changed = [ToolInfo(i.name, i.description + " (v2)", i.parameters, i.namespace)
                   if i.namespace == server else i for i in changed]
        update = catalog.sync(changed)
        catalog.sync(infos)
        ctx = state.runtime.context(session=Session())
        tools = ToolSet([*infos, ToolSearchTool(ctx, top_k=cfg.top_k, max_query_chars=cfg.max_query_chars).info])
        state.plugin.loopstack_visible_tools(tools=tools, ctx=ctx)
        request_tools = ctx.state(STATE_KEY, RequestTools)  # what a turn's visible_tools leaves
        assert request_tools.catalog is not None
        request_tools.catalog.sync(infos)  # built on a request's first search; not timed here
        request_tools.is_synced = True
        self._load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        wall: list[float] = []
        cpu: list[float] = []
        for query in tqdm(self._latency_queries(), desc="  search latency", leave=False, unit="q"):
            ctx = state.runtime.context(session=Session())  # a fresh session: every hit loads
            ctx.state(STATE_KEY, lambda: request_tools)
            started, started_cpu = time.perf_counter(), time.process_time()
            search_tools(ctx, query, limit=cfg.top_k, max_query_chars=cfg.max_query_chars)
            cpu.append((time.process_time() - started_cpu) * 1000)
            wall.append((time.perf_counter() - started) * 1000)
        cuts = statistics.quantiles(wall, n=100, method="inclusive")
        cpu_cuts = statistics.quantiles(cpu, n=100, method="inclusive")
        return {
            f"search_ms_p50.{LATENCY_CATALOG}": cuts[49],
            f"search_ms_p99.{LATENCY_CATALOG}": cuts[98],
            # CPU time of the same searches: what the search costs without other processes'
            # turns on a shared machine
            f"search_cpu_ms_p50.{LATENCY_CATALOG}": cpu_cuts[49],
            f"search_cpu_ms_p99.{LATENCY_CATALOG}": cpu_cuts[98],
            f"index_build_s.{LATENCY_CATALOG}": build.seconds,
            f"index_update_ms.{LATENCY_CATALOG}": update.seconds * 1000,
        }

    async def teardown(self) -> None:
        for column in self._columns.values():
            column.runtime.close()

    def config(self) -> dict[str, Any]:
        plugins = {
            name: {**col.plugin.config.model_dump(), "stemmer": STEMMER}
            for name, col in self._columns.items() if col.plugin is not None
        }
        return {
            "tool_search": plugins,
            "retrieval_sets": self._sizes,
            "catalog_tools": {name: len(infos) for name, infos in self._catalogs.items()},
            "latency_queries": "MetaTool and BFCL live_multiple questions plus 1 in 10 tool names, sampled",
            "schema_tokens": "SmolLM2 tokenizer over the up-front tools, one Hermes JSON line each",
            "load_average_1m_at_latency": self._load_average,  # wall-clock p99 depends on it; CPU time less
        }
