"""TOML text beside ``tomllib``: write plain data back (for ``loopstack stacks show``; None values are left out),
and find the line of a key path (for error messages).

``key_lines``:
``tomllib`` reports lines only for syntax errors. Validation errors name a key path
(``plugins.tool_search.top_k``); this scanner maps each table header and ``key =``
line to its dotted path so an error can point at the line that set the value. It is
deliberately approximate (inline tables resolve to the line of their key), which is
what a person needs to find the spot.
"""

from __future__ import annotations

import json
import re
from typing import Any


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None) + " }"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def dumps(data: dict[str, Any], _prefix: tuple[str, ...] = ()) -> str:
    """TOML text for nested dicts: scalars first, then sub-tables as [a.b] headers."""
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict) and v is not None}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    out = []
    if scalars:
        if _prefix:
            out.append(f"[{'.'.join(_key(p) for p in _prefix)}]")
        out.extend(f"{_key(k)} = {_value(v)}" for k, v in scalars.items())
        out.append("")
    for key, table in tables.items():
        out.append(dumps(table, (*_prefix, key)))
    return "\n".join(out)

_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"""^\s*((?:"[^"]*"|'[^']*'|[A-Za-z0-9_-]+)(?:\s*\.\s*(?:"[^"]*"|'[^']*'|[A-Za-z0-9_-]+))*)\s*=""")


def _split_dotted(text: str) -> tuple[str, ...]:
    parts = re.findall(r'"([^"]*)"|\'([^\']*)\'|([A-Za-z0-9_-]+)', text)
    return tuple(next(p for p in groups if p != "") if any(groups) else "" for groups in parts)


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Map every table header and key path in ``text`` to its 1-based line number."""
    lines: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    in_multiline = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.count('"""') % 2 == 1 or line.count("'''") % 2 == 1:
            in_multiline = not in_multiline
            if not in_multiline:
                continue
        elif in_multiline:
            continue
        header = _HEADER.match(line)
        if header:
            table = _split_dotted(header.group(1))
            lines.setdefault(table, number)
            continue
        key = _KEY.match(line)
        if key:
            lines.setdefault(table + _split_dotted(key.group(1)), number)
    return lines


def find_line(lines: dict[tuple[str, ...], int], path: tuple[str, ...]) -> int | None:
    """Line of ``path``, or of its longest prefix that has one."""
    for end in range(len(path), 0, -1):
        if path[:end] in lines:
            return lines[path[:end]]
    return None
