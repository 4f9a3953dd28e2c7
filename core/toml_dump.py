"""Write plain data back as TOML (for ``loopstack stacks show``). None values are left out."""

from __future__ import annotations

import json
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
