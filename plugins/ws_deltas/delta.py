"""Which message to send: a delta (``response.append``) or the full request. No I/O here.

After a completed response, the client knows what the server's chain holds: the request's
input items plus the response's output items (:class:`ChainCursor`). The next request is a
delta when it only appends to that — the same non-input fields, an input list that starts
with exactly those items — and the chain is still reachable (stored, or on the same
connection). Anything else is sent in full, with the reason recorded for the metrics.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ChainCursor", "Plan", "cursor_after", "non_input_fields", "plan_request"]

# request fields that a delta does not repeat (the server's ResponsesRequest.non_input_fields)
_NOT_INHERITED = frozenset({"input", "stream", "previous_response_id", "store", "metadata", "generate",
                            "client_metadata"})


def non_input_fields(request: Mapping[str, Any]) -> dict[str, Any]:
    """Everything a ``response.append`` inherits from the previous request."""
    return {k: v for k, v in request.items() if k not in _NOT_INHERITED}


@dataclass(frozen=True)
class ChainCursor:
    """What the server holds after a completed response of this session.

    Attributes:
        response_id: the response to chain from.
        fields: the non-input fields of the request that made it.
        items: the conversation so far as the client sent and received it (input + output).
        is_stored: ``store`` was true (any connection can chain from it).
        connection: the connection generation it was made on (``store: false`` chains die with it).
    """

    response_id: str
    fields: dict[str, Any]
    items: list[Any]
    is_stored: bool
    connection: int


@dataclass(frozen=True)
class Plan:
    """A message to send: ``kind`` is ``"delta"`` or ``"full"``; ``reason`` says why full."""

    kind: str
    message: bytes | None  # None for full: the client serializes the request itself
    reason: str
    num_new_items: int


def plan_request(request: Mapping[str, Any], cursor: ChainCursor | None, *, connection: int,
                 supports_append: bool = True) -> Plan:
    """Delta when ``request`` only appends to ``cursor``'s chain; else full, with the reason."""
    items = request.get("input")
    reason = ""
    if cursor is None:
        reason = "no_chain"
    elif not supports_append:
        reason = "append_unsupported"
    elif request.get("previous_response_id") is not None or not isinstance(items, list):
        reason = "caller_chains"
    elif not cursor.is_stored and cursor.connection != connection:
        reason = "connection_changed"
    elif non_input_fields(request) != cursor.fields:
        reason = "fields_changed"
    elif len(items) < len(cursor.items) or items[:len(cursor.items)] != cursor.items:
        reason = "history_changed"  # list == compares by identity first: the agent's own items are cheap
    if reason:
        return Plan("full", None, reason, len(items) if isinstance(items, list) else 1)
    assert cursor is not None and isinstance(items, list)
    new_items = items[len(cursor.items):]
    message: dict[str, Any] = {"type": "response.append", "previous_response_id": cursor.response_id,
                               "input": new_items}
    for name in ("store", "metadata"):
        if name in request:
            message[name] = request[name]
    body = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()
    return Plan("delta", body, "", len(new_items))


def cursor_after(request: Mapping[str, Any], response: Mapping[str, Any], *, connection: int) -> ChainCursor | None:
    """The chain after ``response`` completed, or None when the next request cannot extend it."""
    items = request.get("input")
    if request.get("previous_response_id") is not None or not isinstance(items, list) or not response.get("id"):
        return None
    output: Sequence[Any] = response.get("output") or []
    return ChainCursor(str(response["id"]), non_input_fields(request), [*items, *output],
                       bool(request.get("store", True)), connection)
