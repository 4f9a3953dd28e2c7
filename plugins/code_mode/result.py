"""What a program's outcome puts into the context: the result, capped, and its console lines."""

from __future__ import annotations

from loopstack.harness.tools.tool import ToolResult
from loopstack.plugins.code_mode.sandbox import ProgramOutcome

__all__ = ["cap_text", "outcome_to_result"]


def cap_text(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` UTF-8 bytes (on a character boundary), with a
    marker saying how much was shown; unchanged when it fits."""
    encoded = text.encode()
    if len(encoded) <= max_bytes:
        return text
    shown = encoded[:max_bytes].decode("utf-8", errors="ignore")
    return f"{shown}... [truncated: {len(shown.encode())} of {len(encoded)} bytes shown]"


def _console(outcome: ProgramOutcome, max_bytes: int) -> str:
    if not outcome.logs and not outcome.num_logs_dropped:
        return ""
    lines = cap_text("\n".join(outcome.logs), max_bytes)
    dropped = f"\n[{outcome.num_logs_dropped} more console lines dropped]" if outcome.num_logs_dropped else ""
    return f"\n--- console ---\n{lines}{dropped}"


def outcome_to_result(outcome: ProgramOutcome, *, max_result_bytes: int, max_log_bytes: int) -> ToolResult:
    """The ``exec`` tool's result for ``outcome``.

    ``ok``: the returned value as JSON, capped at ``max_result_bytes``. Otherwise an error
    result: the JavaScript stack (thrown errors, rejected promises, syntax errors) or the
    limit that stopped the program. Console lines follow either, capped at ``max_log_bytes``.
    """
    console = _console(outcome, max_log_bytes)
    if outcome.status == "ok":
        return ToolResult(cap_text(outcome.result_json or "null", max_result_bytes) + console)
    headline = {
        "error": "the program failed:",
        "timeout": "the program timed out; its V8 context was disposed:",
        "heap_limit": "the program ran out of memory; its V8 context was disposed:",
    }[outcome.status]
    error = cap_text(outcome.error or "", max_result_bytes)
    return ToolResult(f"{headline}\n{error}{console}", is_error=True)
