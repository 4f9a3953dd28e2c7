"""Traces the advisor replays, read into one type: :class:`AdvisorRequest`.

Three formats, told apart by the fields of a file's first row:

- a loopstack server request log (:mod:`loopstack.engine.request_log`): rows with ``block_size``;
  arrival and finish times, prompt and sequence block ids, pins;
- a Mooncake trace (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` of 512-token
  blocks), the same reader as the log's (the log's rows are a superset);
- mini-swe-agent ``per_turn_usage.jsonl`` trajectories (``instance_id``, ``turn``, ``prompt_tokens``,
  ...), turned into block chains by the routing bench's
  :func:`~loopstack.plugins.cache_routing.bench.trace.load_agent_trace`.

Times become seconds since the first arrival. A bad row raises :class:`TraceFormatError` naming the
file, the line and the field. A last line cut short without its newline (a server that crashed while
writing it) is skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from loopstack.plugins.cache_routing.bench.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest, load_agent_trace

__all__ = [
    "AdvisorRequest",
    "TraceFormatError",
    "detect_format",
    "from_trace_requests",
    "load_requests",
    "load_traces",
]

FORMATS = ("server-log", "mooncake", "agent")


class TraceFormatError(ValueError):
    """A trace file is not one of the formats, or one of its rows is malformed."""


@dataclass(frozen=True, slots=True)
class AdvisorRequest:
    """One request of a trace, whatever the format.

    ``hash_ids``: one per ``block_size``-token block of the prompt (the last may be partial), equal
    ids meaning equal prefixes. ``sequence_hash_ids`` (server logs only): one per full block of the
    computed sequence, prompt and output, as the engine cached it when the request finished.
    """

    arrival_s: float
    finish_s: float | None
    input_length: int
    output_length: int
    block_size: int  # the trace's granularity in tokens
    hash_ids: tuple[int, ...]
    sequence_hash_ids: tuple[int, ...] | None = None
    pin_tokens: int = 0
    pin_ttl_s: float = 0.0
    cached_tokens: int | None = None  # what the live engine served from its cache (server logs)
    final: bool = False  # its output ended its session (BlockManager.free's hint)


def detect_format(path: Path) -> str:
    """``"server-log"``, ``"mooncake"`` or ``"agent"``, from the fields of the first row."""
    for number, line in _lines(path):
        row = _parse(path, number, line)
        if "instance_id" in row and "prompt_tokens" in row:
            return "agent"
        if "block_size" in row:
            return "server-log"
        if "hash_ids" in row:
            return "mooncake"
        raise TraceFormatError(
            f"{path}:{number}: unknown trace format (fields {sorted(row)}); expected a loopstack request log"
            " (block_size, hash_ids, ...), a Mooncake trace (timestamp, hash_ids, ...) or per_turn_usage.jsonl"
            " (instance_id, prompt_tokens, ...)"
        )
    raise TraceFormatError(f"{path}: empty trace")


def load_requests(path: str | Path, *, limit: int | None = None) -> list[AdvisorRequest]:
    """One trace file's requests in arrival order (the first ``limit`` rows of it).

    Raises:
        FileNotFoundError; TraceFormatError naming ``path:line`` and the field.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such trace")
    if detect_format(path) == "agent":
        try:
            requests = from_trace_requests(load_agent_trace(path, limit=limit), MOONCAKE_BLOCK_TOKENS)
        except ValueError as exc:
            _check_agent_rows(path)  # names the field; re-raise what load_agent_trace said otherwise
            raise TraceFormatError(str(exc)) from None
    else:
        requests = _load_log_rows(path, limit)
    return _rebase(requests)


def load_traces(paths: Sequence[str | Path], *, limit: int | None = None) -> list[AdvisorRequest]:
    """Several files as one timeline (rotated server logs, say), in arrival order.

    All must have the same granularity. Server logs share one id space (content hashes); the ids of
    every other file are kept apart, so two Mooncake files never share a block by accident.
    ``limit`` applies to the merged timeline.

    Raises:
        FileNotFoundError, TraceFormatError (also when the granularities differ).
    """
    if not paths:
        raise ValueError("no trace given")
    merged: list[AdvisorRequest] = []
    sizes: dict[int, Path] = {}
    for index, path in enumerate(paths):
        requests = load_requests(path, limit=limit)
        if len(paths) > 1 and detect_format(Path(path)) != "server-log":
            requests = [_namespaced(request, index + 1) for request in requests]
        for request in requests[:1]:
            sizes.setdefault(request.block_size, Path(path))
        merged.extend(requests)
    if len(sizes) > 1:
        raise TraceFormatError(f"traces of different granularities: {', '.join(f'{p}: {s} tokens' for s, p in sizes.items())}")
    merged.sort(key=lambda request: request.arrival_s)
    return _rebase(merged[:limit])


def from_trace_requests(requests: Sequence[TraceRequest], block_size: int) -> list[AdvisorRequest]:
    """The routing bench's trace requests (no finish times, no pins) as advisor requests."""
    return [
        AdvisorRequest(r.arrival_s, None, r.input_length, r.output_length, block_size, r.hash_ids, final=r.final)
        for r in requests
    ]


# -- internals -------------------------------------------------------------------------------------


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                yield number, line


def _parse(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{path}:{number}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise TraceFormatError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
    return row


def _load_log_rows(path: Path, limit: int | None) -> list[AdvisorRequest]:
    requests: list[AdvisorRequest] = []
    granularity: int | None = None
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            if not line.endswith("\n") and not _is_json(line):
                break  # the row a crash cut short
            row = _parse(path, number, line)
            request = _log_row(row, _Where(path, number))
            if granularity is None:
                granularity = request.block_size
            elif request.block_size != granularity:
                raise TraceFormatError(
                    f"{path}:{number}: field 'block_size': {request.block_size}, but earlier rows have {granularity}"
                )
            requests.append(request)
    if not requests:
        raise TraceFormatError(f"{path}: no rows")
    return requests


@dataclass(frozen=True)
class _Where:
    path: Path
    line: int

    def error(self, field: str, problem: str) -> TraceFormatError:
        return TraceFormatError(f"{self.path}:{self.line}: field {field!r}: {problem}")


def _log_row(row: dict[str, Any], where: _Where) -> AdvisorRequest:
    is_server_log = "block_size" in row
    arrival_ms = _number(row, "timestamp", where)
    finish_ms = _number(row, "finish_ms", where) if is_server_log and "finish_ms" in row else None
    if finish_ms is not None and finish_ms < arrival_ms:
        raise where.error("finish_ms", f"{finish_ms} is before the timestamp {arrival_ms}")
    input_length = _integer(row, "input_length", where, minimum=1)
    block_size = _integer(row, "block_size", where, minimum=1) if is_server_log else MOONCAKE_BLOCK_TOKENS
    hash_ids = _ids(row, "hash_ids", where)
    if not hash_ids:
        raise where.error("hash_ids", "empty (a prompt has at least one block)")
    sequence_ids = _ids(row, "sequence_hash_ids", where) if "sequence_hash_ids" in row else None
    pin_tokens = _integer(row, "pin_tokens", where, minimum=0) if "pin_tokens" in row else 0
    pin_ttl_s = _number(row, "pin_ttl_s", where) if "pin_ttl_s" in row else 0.0
    if pin_ttl_s < 0:
        raise where.error("pin_ttl_s", f"must be >= 0, got {pin_ttl_s}")
    cached = _integer(row, "cached_tokens", where, minimum=0) if "cached_tokens" in row else None
    final = row.get("final", False)
    if not isinstance(final, bool):
        raise where.error("final", f"expected true or false, got {final!r}")
    return AdvisorRequest(
        arrival_ms / 1000.0, None if finish_ms is None else finish_ms / 1000.0, input_length,
        _integer(row, "output_length", where, minimum=0), block_size, hash_ids, sequence_ids,
        pin_tokens, float(pin_ttl_s), cached, final,
    )


def _require(row: dict[str, Any], field: str, where: _Where) -> Any:
    if field not in row:
        raise where.error(field, "missing")
    return row[field]


def _number(row: dict[str, Any], field: str, where: _Where) -> float:
    value = _require(row, field, where)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise where.error(field, f"expected a number, got {value!r}")
    return float(value)


def _integer(row: dict[str, Any], field: str, where: _Where, *, minimum: int) -> int:
    value = _require(row, field, where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise where.error(field, f"expected an integer, got {value!r}")
    if value < minimum:
        raise where.error(field, f"must be >= {minimum}, got {value}")
    return value


def _ids(row: dict[str, Any], field: str, where: _Where) -> tuple[int, ...]:
    value = _require(row, field, where)
    if not isinstance(value, list):
        raise where.error(field, f"expected a list of block ids, got {type(value).__name__}")
    for index, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise where.error(field, f"item {index}: expected an unsigned integer id, got {item!r}")
    return tuple(value)


def _check_agent_rows(path: Path) -> None:
    for number, line in _lines(path):
        row = _parse(path, number, line)
        where = _Where(path, number)
        _number(row, "created", where)
        _require(row, "instance_id", where)
        for field in ("turn", "prompt_tokens", "completion_tokens"):
            _integer(row, field, where, minimum=0)


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _namespaced(request: AdvisorRequest, namespace: int) -> AdvisorRequest:
    # server-log ids are 64-bit: anything from bit 64 up is free for a file's namespace
    offset = namespace << 64
    return replace(
        request,
        hash_ids=tuple(offset + h for h in request.hash_ids),
        sequence_hash_ids=None if request.sequence_hash_ids is None else tuple(offset + h for h in request.sequence_hash_ids),
    )


def _rebase(requests: list[AdvisorRequest]) -> list[AdvisorRequest]:
    """Sorted by arrival, times counted from the first arrival."""
    requests = sorted(requests, key=lambda request: request.arrival_s)
    if not requests or requests[0].arrival_s == 0.0:
        return requests
    start = requests[0].arrival_s
    return [
        replace(r, arrival_s=r.arrival_s - start, finish_s=None if r.finish_s is None else r.finish_s - start)
        for r in requests
    ]
