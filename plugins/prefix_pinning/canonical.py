"""Canonical request bytes and pinned tool order."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from loopstack.tools import ToolInfo

__all__ = ["canonical_json", "first_seen_key", "sort_keys_deep", "sorted_key"]


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys, no whitespace, UTF-8 as is: the same value always gives the same bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sort_keys_deep(value: Any) -> Any:
    """``value`` with every dict's keys in sorted order (lists keep their order).

    Tool schemas reach the prompt as JSON, so a schema rebuilt with another key order (an
    MCP server restarted, a dict merged differently) would change the prompt.
    """
    if isinstance(value, dict):
        return {key: sort_keys_deep(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [sort_keys_deep(item) for item in value]
    return value


def sorted_key(tool: ToolInfo) -> tuple[str, str]:
    """Order by namespace (the MCP server), then name: local tools (no namespace) first."""
    return (tool.namespace, tool.name)


def first_seen_key(order: dict[str, int], tools: list[ToolInfo]) -> Callable[[ToolInfo], int]:
    """Order by first appearance in the session; tools new in this request are appended,
    sorted among themselves so the arrival order of one listing does not matter."""
    for tool in sorted(tools, key=sorted_key):
        order.setdefault(tool.name, len(order))
    return lambda tool: order[tool.name]
