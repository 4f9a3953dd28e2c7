"""Tool schemas -> searchable documents and the Responses/Hermes shapes a model reads."""

from __future__ import annotations

import json
from typing import Any

from loopstack.plugins.tool_search.retrieval.index import ToolDoc
from loopstack.tools import ToolInfo

__all__ = ["doc_from_info", "function_tool", "parameter_text", "schema_line"]

_MAX_DEPTH = 3


def parameter_text(schema: Any, depth: int = 0) -> str:
    """Names, descriptions and enum values of a JSON Schema's properties, nested ones included."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return ""
    parts: list[str] = []
    properties = schema.get("properties")
    if isinstance(properties, dict):
        for name, sub in properties.items():
            parts.append(str(name))
            if isinstance(sub, dict):
                if isinstance(sub.get("description"), str):
                    parts.append(sub["description"])
                if isinstance(sub.get("enum"), list):
                    parts.extend(str(v) for v in sub["enum"] if isinstance(v, (str, int, float)))
                parts.append(parameter_text(sub, depth + 1))
                parts.append(parameter_text(sub.get("items"), depth + 1))
    return " ".join(p for p in parts if p)


def doc_from_info(info: ToolInfo, *, title: str = "") -> ToolDoc:
    """The searchable text of a tool: its name, namespace, title, description and parameters."""
    return ToolDoc(
        key=info.name,
        name=info.name,
        namespace=info.namespace,
        title=title,
        description=info.description,
        parameters=parameter_text(info.parameters),
    )


def function_tool(info: ToolInfo) -> dict[str, Any]:
    """The Responses function-tool dict of ``info`` (what ``request["tools"]`` holds)."""
    return {"type": "function", "name": info.name, "description": info.description, "parameters": info.parameters}


def schema_line(tool: dict[str, Any]) -> str:
    """One tool as the Hermes system block writes it (one JSON line, chat-completions shape);
    the text whose tokens count as "schema tokens"."""
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return json.dumps({"type": "function", "function": function}, ensure_ascii=False)
