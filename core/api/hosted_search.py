"""The Responses API's hosted ``tool_search``, run by the server over a request's ``defer_loading`` tools.

A request that lists ``{"type": "tool_search"}`` (executed by the server, the API's default) and
marks functions or namespaces ``defer_loading: true`` gets deferred tool discovery from any
client: the model sees the tools that are not deferred plus one ``tool_search`` function; when
it calls that, the server ranks the deferred tools (the ``loopstack_search_deferred_tools`` hook,
which the ``tool_search`` plugin implements with its index), adds a ``tool_search_call`` and a
``tool_search_output`` item (the loaded definitions, namespaces kept) to the response, and the
model goes on in the same response with those tools callable. Later turns send both items back;
their tools stay callable, and the prefix before them never changes (prefix caching holds).

:func:`plan` makes the model-facing tool list; :func:`loaded_definitions` the output item's tools.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loopstack.api.conversation import FunctionTool, normalize_tools, qualified_name
from loopstack.items import SEARCH_CALL_NAME

__all__ = ["MAX_SEARCHES", "SEARCH_TOOL_TYPE", "HostedSearch", "loaded_definitions", "plan", "search_tool_of"]

SEARCH_TOOL_TYPE = "tool_search"
MAX_SEARCHES = 4  # per response; a fifth round's tool_search call is not intercepted (it reaches the client)
DEFAULT_LIMIT = 5
_PARAMETERS = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "description": "what you want to do, or a tool name"},
        "limit": {"type": "integer", "minimum": 1, "maximum": 20, "description": "how many tools to load"},
    },
    "required": ["query"],
}


@dataclass(frozen=True)
class HostedSearch:
    """What the server keeps of a request with a server-run ``tool_search``.

    ``request_tools`` are the client's tools as sent (the response echoes them), ``deferred``
    the functions only a search loads (flat, ``namespace.function`` names)."""

    request_tools: list[dict[str, Any]]
    deferred: list[FunctionTool]
    items: list[dict[str, Any]] = field(default_factory=list)  # the conversation so far, for continuing

    def deferred_dicts(self) -> list[dict[str, Any]]:
        """The deferred functions as the search hook takes them."""
        return [{"type": "function", "name": t.name, "namespace": t.namespace, "description": t.description,
                 "parameters": t.parameters} for t in self.deferred]


def search_tool_of(tools: Sequence[Any]) -> Mapping[str, Any] | None:
    """The request's ``tool_search`` tool, if it lists one."""
    for tool in tools:
        if isinstance(tool, Mapping) and tool.get("type") == SEARCH_TOOL_TYPE:
            return tool
    return None


def _search_function(deferred: Sequence[FunctionTool], description: str | None) -> dict[str, Any]:
    namespaces = sorted({t.namespace for t in deferred if t.namespace})
    plain = sum(1 for t in deferred if not t.namespace)
    where = ", ".join(namespaces) + (f" and {plain} other tool(s)" if plain else "") if namespaces else f"{plain} tool(s)"
    text = description or (f"Find and load more tools by describing what you need. {len(deferred)} tools are "
                           f"available through search, in: {where}.")
    return {"type": "function", "name": SEARCH_CALL_NAME, "description": text, "parameters": _PARAMETERS}


def plan(tools: Sequence[Any]) -> tuple[list[Any], list[FunctionTool]]:
    """The model-facing tools of a request with a server-run search: its tools without the
    deferred ones and the ``tool_search`` entry, plus a ``tool_search`` function; and the
    deferred functions.

    Raises:
        InvalidToolError: from :func:`normalize_tools` (a malformed tool).
    """
    search = search_tool_of(tools)
    others = [t for t in tools if t is not search]
    deferred = [t for t in normalize_tools(others) if t.defer_loading]
    deferred_names = {t.name for t in deferred}
    kept: list[Any] = []
    for tool in others:
        if tool.get("type") == "namespace":
            members = [m for m in tool.get("tools") or () if qualified_name(tool["name"], m.get("name")) not in deferred_names]
            if members:
                kept.append({**tool, "defer_loading": False, "tools": members})
        elif tool.get("name") not in deferred_names:
            kept.append(tool)
    description = search.get("description") if search is not None else None
    return [*kept, _search_function(deferred, description if isinstance(description, str) else None)], deferred


def loaded_definitions(request_tools: Sequence[Any], names: Sequence[str]) -> list[dict[str, Any]]:
    """The request's own definitions of the functions ``names`` (model-facing names), in the
    request's order, a namespace's functions grouped under their namespace as the API does."""
    wanted = set(names)
    found: list[dict[str, Any]] = []
    for tool in request_tools:
        if not isinstance(tool, Mapping):
            continue
        if tool.get("type") == "namespace":
            members = [dict(m) for m in tool.get("tools") or () if qualified_name(tool.get("name"), m.get("name")) in wanted]
            if members:
                found.append({"type": "namespace", "name": tool["name"], "description": tool.get("description", ""),
                              "tools": members})
        elif tool.get("type") == "function" and tool.get("name") in wanted:
            found.append(dict(tool))
    return found
