"""The Mooncake conversation trace: real production requests as 512-token block hash ids.

``../shared/data/traces/mooncake_conversation_trace.jsonl`` (kvcache-ai/Mooncake, FAST'25, Apache-2.0):
one JSON object per request with ``timestamp`` (ms), ``input_length``, ``output_length`` and
``hash_ids``: one id per 512-token block of the prompt, equal ids meaning equal prefixes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MOONCAKE_BLOCK_TOKENS", "MOONCAKE_TRACE", "TraceRequest", "load_trace"]

MOONCAKE_TRACE = Path("traces") / "mooncake_conversation_trace.jsonl"
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path, *, limit: int | None = None) -> list[TraceRequest]:
    """The trace's requests in arrival order (the first ``limit`` of them)."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: the Mooncake trace is not there (it comes with ../shared/data)")
    requests: list[TraceRequest] = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(requests) >= limit:
                break
            try:
                row = json.loads(line)
                requests.append(TraceRequest(
                    row["timestamp"] / 1000.0, int(row["input_length"]), int(row["output_length"]),
                    tuple(int(h) for h in row["hash_ids"]),
                ))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a trace row ({exc})") from None
    requests.sort(key=lambda request: request.arrival_s)
    return requests
