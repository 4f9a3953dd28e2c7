"""TypeScript-style declarations of the tools, generated from their JSON Schemas.

The ``exec`` tool's description carries them so a model writes correct calls::

    declare const tools: {
      /** Current weather in a city. */
      get_weather(args: {
        /** city name */
        city: string;
        unit?: "C" | "F";
      }): Promise<any>;
    };

Covered: primitive types, ``enum``/``const`` (literal unions), arrays and tuples
(``prefixItems``), nested objects with required and optional members, maps
(``additionalProperties``), ``anyOf``/``oneOf`` (unions), ``allOf`` (intersections),
type lists (``["string", "null"]``), and ``$ref`` into ``$defs``/``definitions``
(emitted once as named types, so recursive schemas terminate). Anything else is ``any``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from loopstack.tools import ToolInfo

__all__ = ["declare_tools", "schema_to_type"]

_IDENTIFIER = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$]*$")
_PRIMITIVES = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "null": "null"}
_INDENT = "  "


def _key(name: str) -> str:
    return name if _IDENTIFIER.match(name) else json.dumps(name)


def _doc(text: str, indent: str) -> list[str]:
    text = " ".join(text.split()).replace("*/", "*\\/")
    return [f"{indent}/** {text} */"] if text else []


def _type_name(ref: str) -> str:
    tail = ref.rsplit("/", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9_$]", "_", tail) or "Type"
    return name if not name[0].isdigit() else f"T{name}"


class _Writer:
    """Renders schemas of one root, collecting the named types its ``$ref``s need."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.named: dict[str, str] = {}  # type name -> rendered body (filled in order of first use)

    def resolve(self, ref: str) -> str:
        name = _type_name(ref)
        if name in self.named:
            return name
        self.named[name] = "any"  # placeholder first: a recursive reference ends here
        target: Any = self.root
        if ref.startswith("#/"):
            for part in ref[2:].split("/"):
                target = target.get(part.replace("~1", "/").replace("~0", "~"), {}) if isinstance(target, dict) else {}
        else:
            target = {}
        self.named[name] = self.render(target, "")
        return name

    def render(self, schema: Any, indent: str) -> str:
        if schema is True or not isinstance(schema, dict) or not schema:
            return "any"
        if schema is False:
            return "never"
        if "$ref" in schema:
            return self.resolve(str(schema["$ref"]))
        if "const" in schema:
            return json.dumps(schema["const"])
        if "enum" in schema and isinstance(schema["enum"], list):
            return " | ".join(json.dumps(value) for value in schema["enum"]) or "never"
        for key, joiner in (("anyOf", " | "), ("oneOf", " | "), ("allOf", " & ")):
            if isinstance(schema.get(key), list) and schema[key]:
                parts = dict.fromkeys(self._wrap(self.render(sub, indent)) for sub in schema[key])
                return joiner.join(parts)
        kind = schema.get("type")
        if isinstance(kind, list):
            return " | ".join(dict.fromkeys(self._wrap(self.render({**schema, "type": k}, indent)) for k in kind))
        if kind == "array" or "items" in schema or "prefixItems" in schema:
            return self._array(schema, indent)
        if kind == "object" or "properties" in schema:
            return self._object(schema, indent)
        return _PRIMITIVES.get(str(kind), "any")

    @staticmethod
    def _wrap(text: str) -> str:
        return f"({text})" if (" | " in text or " & " in text) and not text.startswith("{") else text

    def _array(self, schema: dict[str, Any], indent: str) -> str:
        if isinstance(schema.get("prefixItems"), list):
            return "[" + ", ".join(self.render(item, indent) for item in schema["prefixItems"]) + "]"
        return f"{self._wrap(self.render(schema.get('items', {}), indent))}[]"

    def _object(self, schema: dict[str, Any], indent: str) -> str:
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        if not properties:
            value = self.render(extra, indent) if isinstance(extra, dict) else "any"
            return f"{{ [key: string]: {value} }}"
        required = set(schema.get("required") or [])
        inner = indent + _INDENT
        lines = ["{"]
        for name, sub in properties.items():
            sub = sub if isinstance(sub, dict) else {}
            doc = str(sub.get("description", ""))
            if "default" in sub:
                doc = f"{doc} (default: {json.dumps(sub['default'])})".strip()
            lines += _doc(doc, inner)
            optional = "" if name in required else "?"
            lines.append(f"{inner}{_key(name)}{optional}: {self.render(sub, inner)};")
        if isinstance(extra, dict) and extra:
            lines.append(f"{inner}[key: string]: {self.render(extra, inner)};")
        lines.append(f"{indent}}}")
        return "\n".join(lines)


def schema_to_type(schema: dict[str, Any]) -> str:
    """One JSON Schema as a TypeScript type (named ``$ref`` types inlined as ``type`` lines first)."""
    writer = _Writer(schema)
    body = writer.render(schema, "")
    named = [f"type {name} = {text};" for name, text in writer.named.items()]
    return "\n".join([*named, body])


def declare_tools(tools: Iterable[ToolInfo]) -> str:
    """``declare const tools: {...}`` for ``tools``: one async method per tool.

    Each method has the tool's description as a doc comment and its parameters schema as
    the type of its one argument; it returns the tool's output parsed as JSON (or the raw
    text when it is not JSON). ``$ref`` types of every tool are declared once, before.

    Example:
        >>> print(declare_tools([ToolInfo("ping", "Ping a host.", {"type": "object",
        ...     "properties": {"host": {"type": "string"}}, "required": ["host"]})]))
        declare const tools: {
          /** Ping a host. */
          ping(args: {
            host: string;
          }): Promise<any>;
        };
    """
    named: dict[str, str] = {}
    lines = ["declare const tools: {"]
    for info in tools:
        writer = _Writer(info.parameters)
        argument = writer.render(info.parameters or {}, _INDENT)
        if argument in ("any", "{ [key: string]: any }"):
            argument = "{}"
        optional = "" if (info.parameters or {}).get("required") else "?"
        lines += _doc(info.description, _INDENT)
        lines.append(f"{_INDENT}{_key(info.name)}(args{optional}: {argument}): Promise<any>;")
        named.update(writer.named)
    lines.append("};")
    preamble = [f"type {name} = {text};" for name, text in named.items()]
    return "\n".join([*preamble, *lines])
