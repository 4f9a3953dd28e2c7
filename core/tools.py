"""Tool descriptions as the kernel sees them, and the mutable set plugins shape.

The harness (a later layer) owns tool execution; here is only what the
``loopstack_visible_tools`` hook needs: which tools exist, which are deferred (found
through search instead of listed up front), hidden, and in which order they are sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class ToolInfo:
    """A tool's schema as sent to a model.

    Attributes:
        name: the function name the model calls.
        description: what the tool does, for the model.
        parameters: JSON Schema of the arguments.
        namespace: the MCP server or package the tool comes from ("" for local tools).
        defer_loading: the tool asks to be found through search rather than listed.
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    namespace: str = ""
    defer_loading: bool = False


class ToolSet:
    """The tools of one request, in send order, with per-tool visibility.

    Plugins mutate it inside ``loopstack_visible_tools``; the harness then reads
    :meth:`visible` (listed up front) and :meth:`deferred` (reachable through search).
    """

    def __init__(self, tools: list[ToolInfo]) -> None:
        index: dict[str, int] = {}
        duplicates: set[str] = set()
        for position, tool in enumerate(tools):
            if tool.name in index:
                duplicates.add(tool.name)
            index[tool.name] = position
        if duplicates:
            raise ValueError(f"duplicate tool names: {', '.join(sorted(duplicates))}")
        self._tools = list(tools)
        self._index = index  # name -> position in _tools (O(1) lookups at registry sizes)
        self._deferred = {t.name for t in tools if t.defer_loading}
        self._hidden: set[str] = set()

    def __iter__(self) -> Iterator[ToolInfo]:
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    def names(self) -> list[str]:
        return [t.name for t in self._tools]

    def _require(self, name: str) -> None:
        if name not in self._index:
            known = ", ".join(self.names()[:50]) + (" ..." if len(self._tools) > 50 else "")
            raise KeyError(f"unknown tool {name!r}; known tools: {known or '(none)'}")

    def defer(self, name: str) -> None:
        """Keep ``name`` out of the up-front list; it stays reachable through search."""
        self._require(name)
        self._deferred.add(name)

    def load(self, name: str) -> None:
        """Undo :meth:`defer` (an always-loaded tool)."""
        self._require(name)
        self._deferred.discard(name)

    def hide(self, name: str) -> None:
        """Remove ``name`` from what the model sees, listed or searched."""
        self._require(name)
        self._hidden.add(name)

    def update(self, name: str, **changes: Any) -> None:
        """Replace fields of ``name``'s :class:`ToolInfo` (for example a description a plugin
        generates from the other tools, as Code Mode does for ``exec``)."""
        self._require(name)
        if "name" in changes and changes["name"] != name:
            raise ValueError(f"tool {name!r}: update() cannot rename a tool")
        position = self._index[name]
        self._tools[position] = replace(self._tools[position], **changes)

    def get(self, name: str) -> ToolInfo:
        """The :class:`ToolInfo` of ``name`` (``KeyError`` names the known tools)."""
        self._require(name)
        return self._tools[self._index[name]]

    def is_hidden(self, name: str) -> bool:
        return name in self._hidden

    def is_deferred(self, name: str) -> bool:
        return name in self._deferred

    def pin_order(self, key: Callable[[ToolInfo], Any]) -> None:
        """Sort the tools by ``key`` (stable), for a byte-stable request prefix."""
        self._tools.sort(key=key)
        self._index = {t.name: position for position, t in enumerate(self._tools)}

    def visible(self) -> list[ToolInfo]:
        return [t for t in self._tools if t.name not in self._hidden and t.name not in self._deferred]

    def deferred(self) -> list[ToolInfo]:
        return [t for t in self._tools if t.name not in self._hidden and t.name in self._deferred]
