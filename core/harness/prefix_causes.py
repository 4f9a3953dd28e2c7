"""The prefix form of a request and the causes of a prefix break (used by
:mod:`loopstack.harness.prefix_detector`).

The prefix form lists a request's parts in the order the model reads the prompt, one
segment per line: ``model``, ``instructions``, ``tools[i]`` (schema key order kept: it
reaches the prompt), ``input[i]`` (canonical JSON). :func:`classify` names why the
segment at a given index differs between two requests.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loopstack.items import message_item

__all__ = [
    "CAUSES",
    "VOLATILE_PATTERNS",
    "Classified",
    "Segment",
    "classify",
    "common_prefix",
    "excerpt",
    "kind_of",
    "mask_volatile",
    "prefix_form",
    "prefix_segments",
    "secondary_causes",
]

CAUSES = ("tool_order", "tools_changed", "instructions_changed", "history_rewritten", "volatile_value",
          "compaction", "other")

# values that change while a session runs; a change that vanishes once these are masked is
# labelled volatile_value. ISO dates/datetimes, clock times, epoch seconds, turn counters,
# "cwd: ..." lines.
VOLATILE_PATTERNS: tuple[str, ...] = (
    r"\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2}|\s?UTC)?)?",
    r"\b\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\b",
    r"\b1\d{9}(?:\.\d+)?\b",
    r"(?i)\b(?:turn|step|iteration|attempt)\s*#?\s*\d+(?:\s*(?:of|/)\s*\d+)?",
    r"(?im)^\s*(?:cwd|working directory|current directory)\s*[:=].*$",
)
_MASK = "\x00"


def mask_volatile(text: str, patterns: Sequence[str] = VOLATILE_PATTERNS) -> str:
    """``text`` with every volatile value replaced by one mask character."""
    for pattern in patterns:
        text = re.sub(pattern, _MASK, text)
    return text


# -- the prefix form ------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """One line of the prefix form: ``label=<json>\\n``."""

    label: str
    data: bytes

    @property
    def value(self) -> Any:
        """The field as it was when the segment was made (parsed back: callers may mutate
        the request's dicts in place afterwards)."""
        return json.loads(self.data[len(self.label) + 1:])


def _segment(label: str, value: Any, *, sort_keys: bool = True) -> Segment:
    body = json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys)
    return Segment(label, f"{label}={body}\n".encode())


def prefix_segments(request: Mapping[str, Any]) -> list[Segment]:
    """The request's prefix form as segments, in prompt order (see the module docstring)."""
    segments = [_segment("model", request.get("model")), _segment("instructions", request.get("instructions") or "")]
    # tool schemas are rendered as JSON in the prompt: their key order is part of the prefix
    segments += [_segment(f"tools[{i}]", t, sort_keys=False) for i, t in enumerate(request.get("tools") or [])]
    items = request.get("input") or []
    if isinstance(items, str):
        items = [message_item("user", items)]
    segments += [_segment(f"input[{i}]", item) for i, item in enumerate(items)]
    return segments


def prefix_form(request: Mapping[str, Any]) -> bytes:
    """The bytes the detector compares: ``request n+1``'s form must start with ``n``'s."""
    return b"".join(s.data for s in prefix_segments(request))



# -- causes -------------------------------------------------------------------------------


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def excerpt(data: bytes, offset: int, width: int = 40) -> str:
    return data[max(0, offset - width): offset + width].decode("utf-8", errors="replace")


def _same(a: Any, b: Any) -> bool:
    # == on dicts ignores key order; the prompt does not
    return json.dumps(a, ensure_ascii=False) == json.dumps(b, ensure_ascii=False)


def _diff_path(a: Any, b: Any, path: str) -> str:
    """The path of the first field where ``a`` and ``b`` differ (key order counts for dicts)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in a:
            if key not in b:
                return f"{path}.{key} (removed)"
            if not _same(a[key], b[key]):
                return _diff_path(a[key], b[key], f"{path}.{key}")
        added = [k for k in b if k not in a]
        if added:
            return f"{path}.{added[0]} (added)"
        return f"{path} (key order)" if list(a) != list(b) else path
    if isinstance(a, list) and isinstance(b, list):
        for index, (x, y) in enumerate(zip(a, b)):
            if not _same(x, y):
                return _diff_path(x, y, f"{path}[{index}]")
        return f"{path}[{min(len(a), len(b))}] ({'removed' if len(a) > len(b) else 'added'})"
    return path


def _tool_name(tool: Any) -> str:
    if not isinstance(tool, Mapping):
        return "?"
    function = tool.get("function")
    return str((function if isinstance(function, Mapping) else tool).get("name", "?"))


def kind_of(segment: Segment | None) -> str:
    return "" if segment is None else segment.label.split("[", 1)[0]


def _json_masked(value: Any, patterns: Sequence[str], *, sort_keys: bool = True) -> str:
    return mask_volatile(json.dumps(value, ensure_ascii=False, sort_keys=sort_keys), patterns)


@dataclass
class Classified:
    cause: str
    field: str
    detail: str


def _tools_cause(old: list[Segment], new: list[Segment], index: int, patterns: Sequence[str]) -> Classified:
    old_tools = [s.value for s in old if kind_of(s) == "tools"]
    new_tools = [s.value for s in new if kind_of(s) == "tools"]
    old_names, new_names = [_tool_name(t) for t in old_tools], [_tool_name(t) for t in new_tools]
    o = old[index]
    n = new[index] if index < len(new) else None
    field_path = _diff_path(o.value, n.value, o.label) if n is not None and kind_of(o) == kind_of(n) else o.label
    if Counter(old_names) != Counter(new_names):
        added = sorted(set(new_names) - set(old_names))
        removed = sorted(set(old_names) - set(new_names))
        return Classified("tools_changed", field_path,
                           f"tools added {added} removed {removed}; a tool list that changes mid-session invalidates "
                           "everything after it: append new tools at the end ([plugins.prefix_pinning] tool_order = "
                           "\"first_seen\") or load them through tool_search")
    if old_names != new_names:
        position = common_prefix(old_names, new_names)
        return Classified("tool_order", f"tools[{position}].name",
                           f"the same {len(old_names)} tools in another order (tools[{position}] was "
                           f"{old_names[position]!r}, now {new_names[position]!r}); pin the order: "
                           "[plugins.prefix_pinning] tool_order = \"sorted\", or keep the tools in a list, not a set "
                           "or a re-listed MCP response")
    name = _tool_name(o.value) if kind_of(o) == "tools" else "?"
    if (n is not None and kind_of(n) == "tools"
            and _json_masked(o.value, patterns, sort_keys=False) == _json_masked(n.value, patterns, sort_keys=False)):
        return Classified("volatile_value", field_path,
                           f"a volatile value (date, time, counter) changed inside tool {name!r}; keep it out of "
                           "tool descriptions")
    return Classified("tools_changed", field_path,
                       f"tool {name!r} changed ({field_path}); keep tool schemas fixed for a session "
                       "(a schema rebuilt with another key order counts: [plugins.prefix_pinning] sorts keys)")


def classify(old: list[Segment], new: list[Segment], index: int, *, is_compaction: bool,
              patterns: Sequence[str]) -> Classified:
    o = old[index]
    n = new[index] if index < len(new) else None
    if "tools" in (kind_of(o), kind_of(n)):
        return _tools_cause(old, new, index, patterns)
    if n is None or kind_of(o) != kind_of(n):
        field_path = f"{o.label} (removed)"
    else:
        field_path = _diff_path(o.value, n.value, o.label)
    if kind_of(o) == "model":
        return Classified("other", field_path, f"the model changed ({o.value!r} -> {n.value if n else None!r})")
    is_volatile = n is not None and _json_masked(o.value, patterns) == _json_masked(n.value, patterns)
    if kind_of(o) == "instructions":
        if is_volatile:
            return Classified("volatile_value", field_path,
                               "a volatile value (date, time, counter, cwd) changed in the instructions; move it out "
                               "of the prefix ([plugins.prefix_pinning] volatile = \"append\") or round it "
                               "(volatile = \"round\")")
        return Classified("instructions_changed", field_path,
                           "the instructions changed mid-session; keep them fixed and append new guidance as a "
                           "message instead")
    if is_compaction:
        return Classified("compaction", field_path, "an explicit compaction rewrote the history (expected, counted)")
    if is_volatile:
        return Classified("volatile_value", field_path,
                           f"a volatile value changed in {o.label}, an item already sent; items must never be edited "
                           "after they are sent")
    return Classified("history_rewritten", field_path,
                       f"{o.label} was {'removed' if n is None else 'edited'} after it was sent; history must be "
                       "append-only: only an explicit compaction (a Compacted event) may rewrite it")


def secondary_causes(old: list[Segment], new: list[Segment], primary: str, *, is_compaction: bool,
                      patterns: Sequence[str]) -> tuple[str, ...]:
    """Causes of differences in the parts after the first break's (each part compared on its own)."""
    order = ("model", "instructions", "tools", "input")
    found: list[str] = []
    for part in order[order.index(primary) + 1:]:
        old_part = [s for s in old if kind_of(s) == part]
        new_part = [s for s in new if kind_of(s) == part]
        if part == "input":
            new_part = new_part[: len(old_part)]
        differing = next((i for i, o in enumerate(old_part) if i >= len(new_part) or new_part[i].data != o.data),
                         None if len(old_part) == len(new_part) or part == "input" else min(len(old_part),
                                                                                            len(new_part)))
        if differing is None:
            continue
        if part == "tools" and differing >= len(old_part):
            found.append("tools_changed")  # only appended tools
            continue
        cause = classify(old_part, new_part, differing, is_compaction=is_compaction, patterns=patterns).cause
        if cause not in found:
            found.append(cause)
    return tuple(found)
