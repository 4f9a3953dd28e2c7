"""The Mooncake conversation trace: real production requests as 512-token block hash ids.

``../shared/data/traces/mooncake_conversation_trace.jsonl`` (kvcache-ai/Mooncake, FAST'25, Apache-2.0):
one JSON object per request with ``timestamp`` (ms), ``input_length``, ``output_length`` and
``hash_ids``: one id per 512-token block of the prompt, equal ids meaning equal prefixes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["AGENT_TRACE", "MOONCAKE_BLOCK_TOKENS", "MOONCAKE_TRACE", "TraceRequest", "load_agent_trace", "load_trace"]

MOONCAKE_TRACE = Path("traces") / "mooncake_conversation_trace.jsonl"
# mini-swe-agent on SWE-bench Verified: 500 agent sessions, one row per model call (a source the
# routing weights were not chosen on)
AGENT_TRACE = Path("trajectories") / "swebench_minisweagent" / "per_turn_usage.jsonl"
MOONCAKE_BLOCK_TOKENS = 512
# mini-swe-agent's last command: the model's output that ends its session
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    # the output ended its agent session (the submit command; in a tool-calling agent, an answer
    # with no tool call): what a server sees when the request finishes
    final: bool = False


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


def load_agent_trace(path: Path, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS, limit: int | None = None) -> list[TraceRequest]:
    """Agent sessions as block hash ids: ``per_turn_usage.jsonl`` rows (``instance_id``, ``turn``,
    ``prompt_tokens``, ``completion_tokens``, ``created`` in seconds).

    An agent's call n+1 repeats call n and appends (the loop is append-only), so block i of a
    session is the same id on every turn; block 0 stands for the system prompt every session shares.
    The task text after it differs per session, so no other block is shared across sessions.
    """
    if not path.exists():
        raise FileNotFoundError(f"{path}: the agent trace is not there (it comes with ../shared/data)")
    rows = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
                rows.append((float(row["created"]), str(row["instance_id"]), int(row["turn"]),
                             int(row["prompt_tokens"]), int(row["completion_tokens"]),
                             SUBMIT_MARKER in str(row.get("command") or "")))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a usage row ({exc})") from None
    rows.sort(key=lambda row: (row[0], row[1], row[2]))
    block_ids: dict[tuple[str, int], int] = {}

    def block_id(session: str, index: int) -> int:
        key = ("", 0) if index == 0 else (session, index)
        return block_ids.setdefault(key, len(block_ids))

    requests = []
    start = rows[0][0] if rows else 0.0
    for created, session, _, prompt_tokens, completion_tokens, final in rows[:limit]:
        num_blocks = max(1, -(-prompt_tokens // block_tokens))
        requests.append(TraceRequest(created - start, prompt_tokens, max(1, completion_tokens),
                                     tuple(block_id(session, i) for i in range(num_blocks)), final))
    return requests
