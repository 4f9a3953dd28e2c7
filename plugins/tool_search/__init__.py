"""Deferred tool discovery: a ``tool_search`` tool (BM25, fused with MiniLM sentence
embeddings by default) instead of every schema up front.

DESIGN.md technique 1; docs/techniques/tool-search.md. The plugin class lives in
:mod:`.plugin`; this module is what the plugin catalog and the bench registry load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loopstack.hookspecs import hookimpl
from loopstack.plugins.tool_search.plugin import ToolSearch, ToolSearchConfig
from loopstack.plugins.tool_search.search import search_tools

if TYPE_CHECKING:
    from loopstack.bench.workload import Workload

__all__ = ["PLUGIN", "ToolSearch", "ToolSearchConfig", "search_tools"]

PLUGIN = ToolSearch


@hookimpl
def loopstack_bench_workloads() -> list[Workload]:
    from loopstack.plugins.tool_search.bench.workload import ToolSearchWorkload

    return [ToolSearchWorkload()]
