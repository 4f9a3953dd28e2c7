"""Deferred tool discovery: a BM25 ``tool_search`` tool instead of every schema up front.

Not implemented yet (issue 6): the config is declared so stacks can set it today.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loopstack.plugin import Layer, Plugin, PluginConfig


class ToolSearchConfig(PluginConfig):
    top_k: int = Field(5, ge=1, le=50, description="schemas returned per search")
    defer: Literal["mcp", "all", "marked"] = Field(
        "mcp", description="which tools are deferred: all MCP tools, every tool, or only those marked defer_loading"
    )
    always_loaded: list[str] = Field(default_factory=list, description="tool names never deferred")


class ToolSearch(Plugin):
    name = "tool_search"
    layers = (Layer.HARNESS,)
    Config = ToolSearchConfig
    summary = "Defer tool schemas behind a BM25 tool_search tool; discovered schemas are appended."
    implemented = False
