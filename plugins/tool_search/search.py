"""The ``tool_search`` tool and :func:`search_tools`, the search it runs.

:func:`search_tools` is the whole behaviour: it takes the request context, so Code Mode
programs can call the same search as a function. Found tools the session has not loaded
yet come back in ``ToolResult.loaded_tools``; the agent appends them at the end of the
conversation as a ``tool_search_output`` item, never into the up-front tool list.
"""

from __future__ import annotations

from typing import Any

import pydantic

from loopstack.context import RequestContext
from loopstack.harness.tools.tool import ToolResult
from loopstack.plugins.tool_search.docs import function_tool
from loopstack.plugins.tool_search.namespaces import namespace_lines
from loopstack.plugins.tool_search.retrieval.index import Hit
from loopstack.plugins.tool_search.state import REQUEST_TOOLS, SESSION_TOOLS, RequestTools
from loopstack.plugins.tool_search.worker import SearchWorker
from loopstack.tools import ToolInfo

__all__ = ["SEARCH_TOOL_NAME", "SearchArguments", "ToolSearchTool", "search_text", "search_tools", "search_tools_async"]

SEARCH_TOOL_NAME = "tool_search"
MAX_LIMIT = 50
_SUMMARY_CHARS = 160

SEARCH_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "description": "what you want to do, or a tool name"},
        "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "description": "how many tools to load"},
    },
    "required": ["query"],
    "additionalProperties": False,
}


class SearchArguments(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    query: str
    limit: int | None = pydantic.Field(None, ge=1, le=MAX_LIMIT)


def _summary(info: ToolInfo) -> str:
    first = (info.description or "").strip().split("\n", 1)[0]
    return first if len(first) <= _SUMMARY_CHARS else first[: _SUMMARY_CHARS - 3] + "..."


def _namespaces_text(tools: RequestTools) -> str:
    return "\n".join(namespace_lines(list(tools.deferred.values()), max_hinted=0))


def search_text(query: str, max_query_chars: int) -> str:
    """The text a search embeds and scores for ``query``: stripped, cut at ``max_query_chars``
    (the early embedding of :mod:`.early` must produce the same text, or its vector is never used)."""
    return query.strip()[:max_query_chars]


def _check(ctx: RequestContext, query: str) -> ToolResult | None:
    """The error result for a query that cannot be searched, or None."""
    tools = ctx.state(REQUEST_TOOLS)
    if not query:
        return ToolResult("tool_search needs a non-empty query: describe the task or name a tool. "
                          f"Namespaces:\n{_namespaces_text(tools)}", is_error=True)
    if tools.catalog is None or not tools.deferred:
        return ToolResult("no tools are available through search in this request", is_error=True)
    return None


def _find(tools: RequestTools, query: str, limit: int) -> list[Hit]:
    """The catalog's best ``limit`` hits, after syncing it with the request's deferred
    tools once; safe on any thread (the catalog locks).

    Sessions share a catalog. When another request synced it to a different tool list
    since (a server changed its list between two conversations), it is synced back to
    this request's list first: only the tools that differ are touched, and their vectors
    come from the embedder's caches.
    """
    catalog = tools.catalog
    assert catalog is not None  # checked by _check
    with catalog.lock:
        if not tools.is_synced or catalog.version != tools.synced_version:
            tools.sync()
        return catalog.search(query, limit)


def _load(ctx: RequestContext, query: str, hits: list[Hit]) -> ToolResult:
    """Load ``hits`` into the session and say what was found (on the event loop, with no
    await inside, so concurrent searches of one turn never load a tool twice)."""
    tools = ctx.state(REQUEST_TOOLS)
    session = ctx.session.state(SESSION_TOOLS)
    session.num_searches += 1
    ctx.count("tool_search_searches_total", help="tool_search calls")
    if not hits:
        return ToolResult(f"No tools match {query[:200]!r}. Try other words or a namespace. "
                          f"Namespaces:\n{_namespaces_text(tools)}")
    infos = [tools.deferred[hit.key] for hit in hits]
    for info in infos:  # a call of one of them teaches the catalog this query (usage_weight)
        session.found_by[info.name] = query
    new = [info for info in infos if info.name not in session.loaded]
    for info in new:
        session.loaded[info.name] = function_tool(info)
    if new:
        ctx.count("tool_search_loaded_tools_total", len(new), help="tools loaded into a conversation")
    lines = [f"Loaded {len(new)} tool(s); call them by name:" if new else "No new tools loaded."]
    lines += [f"- {info.name} ({info.namespace or 'local'}): {_summary(info)}" for info in new]
    old = [info.name for info in infos if info not in new]
    if old:
        lines.append(f"Already loaded: {', '.join(old)}")
    return ToolResult("\n".join(lines), loaded_tools=tuple(session.loaded[info.name] for info in new))


def search_tools(ctx: RequestContext, query: str, *, limit: int, max_query_chars: int = 2000) -> ToolResult:
    """Search this request's deferred tools and load the best ``limit`` into the session.

    Runs on the calling thread; the ``tool_search`` tool itself awaits
    :func:`search_tools_async`, which keeps the index work off the event loop.

    Args:
        ctx: the request (its deferred tools come from ``loopstack_visible_tools``).
        query: what the model wants to do, or a tool name; longer than ``max_query_chars``
            is cut (a pasted document still finds something, in bounded time).
        limit: at most this many tools.

    Returns:
        A result listing what was found; ``loaded_tools`` holds the schemas of the tools
        this session had not loaded yet (empty when every hit was already loaded). An empty
        query is an error; no match is not (it says so and lists the namespaces).
    """
    query = search_text(query, max_query_chars)
    error = _check(ctx, query)
    if error is not None:
        return error
    return _load(ctx, query, _find(ctx.state(REQUEST_TOOLS), query, limit))


async def search_tools_async(ctx: RequestContext, query: str, *, limit: int, max_query_chars: int = 2000,
                             worker: SearchWorker | None = None) -> ToolResult:
    """:func:`search_tools` with the catalog work (a catalog's sync, the hybrid's query
    forward) on ``worker``'s thread instead of the event loop; inline when None, and for
    BM25 once the catalog is built (its first sync indexes every tool)."""
    query = search_text(query, max_query_chars)
    error = _check(ctx, query)
    if error is not None:
        return error
    tools = ctx.state(REQUEST_TOOLS)
    assert tools.catalog is not None  # checked by _check
    # BM25 over a built catalog (a sync then checks what changed, a search scores postings)
    # takes a millisecond or two: the hop to the worker would cost about as much
    inline = worker is None or (tools.catalog.is_built and tools.catalog.retriever == "bm25")
    hits = _find(tools, query, limit) if inline else await worker.run(_find, tools, query, limit)
    return _load(ctx, query, hits)


class ToolSearchTool:
    """The ``tool_search`` tool of one request (see :func:`search_tools`)."""

    is_concurrency_safe = True  # loading happens on the event loop with no await inside (_load)

    def __init__(self, ctx: RequestContext, *, top_k: int, max_query_chars: int,
                 worker: SearchWorker | None = None) -> None:
        self.info = ToolInfo(name=SEARCH_TOOL_NAME, description="", parameters=SEARCH_PARAMETERS)
        self._ctx = ctx
        self._top_k = top_k
        self._max_query_chars = max_query_chars
        self._worker = worker

    def __repr__(self) -> str:
        return f"ToolSearchTool(top_k={self._top_k})"

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        try:
            args = SearchArguments.model_validate(arguments)
        except pydantic.ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}"
                                 for e in error.errors(include_url=False))
            return ToolResult(f"invalid arguments for tool 'tool_search': {problems}", is_error=True)
        return await search_tools_async(self._ctx, args.query, limit=args.limit or self._top_k,
                                        max_query_chars=self._max_query_chars, worker=self._worker)
