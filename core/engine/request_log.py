"""The request log ``loopstack kv advise`` replays: one JSON line per finished request, no text.

A row (a superset of the Mooncake trace's rows, so the same reader takes both)::

    {"timestamp": 1764620000123.4,   # arrival, ms since the epoch
     "finish_ms": 1764620001456.7,   # when the engine finished it (its blocks were freed)
     "input_length": 812, "output_length": 64, "block_size": 16,
     "hash_ids": [...],              # one per prompt block (the last may be partial): equal ids, equal prefixes
     "sequence_hash_ids": [...],     # one per FULL block of the computed sequence (prompt + output), what
                                     # the engine cached when it finished: a next turn's prompt hits these
     "cached_tokens": 800,           # prompt tokens the engine served from its cache
     "pin_tokens": 0, "pin_ttl_s": 0.0,
     "final": false}                 # it ended its session (BlockManager.free's hint to the policy)

Hash ids are the first 8 bytes of the engine's chained block hashes (tenant salt mixed into the first
block, so tenants never share ids), as unsigned integers: restart-stable, no text recoverable. Rows
are appended and flushed one at a time, so a crash loses at most the row being written.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path

from loopstack.engine.seams.kv_events import hash_block_tokens

__all__ = ["RequestLog", "block_hash_ids"]


def block_hash_ids(token_ids: Sequence[int], block_size: int, salt: bytes = b"", *, partial: bool) -> list[int]:
    """The chained hash ids of ``token_ids``' blocks (the trailing partial block too if ``partial``)."""
    ids: list[int] = []
    parent: bytes | None = None
    end = len(token_ids) if partial else len(token_ids) - len(token_ids) % block_size
    for start in range(0, end, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], salt if parent is None else b"")
        ids.append(int.from_bytes(parent[:8], "big"))
    return ids


class RequestLog:
    """Appends rows to ``path`` (created with its parent folders); thread-safe."""

    def __init__(self, path: str | Path, block_size: int) -> None:
        self.path = Path(path)
        self.block_size = block_size
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self.num_rows = 0

    def record(
        self, *, arrival_s: float, finish_s: float, prompt_token_ids: Sequence[int], computed_token_ids: Sequence[int],
        salt: bytes, cached_tokens: int, pin_tokens: int = 0, pin_ttl_s: float = 0.0, final: bool = False,
    ) -> None:
        """One finished request; ``computed_token_ids``: prompt and output tokens whose KV was written."""
        row = {
            "timestamp": round(arrival_s * 1000.0, 3),
            "finish_ms": round(finish_s * 1000.0, 3),
            "input_length": len(prompt_token_ids),
            "output_length": max(0, len(computed_token_ids) - len(prompt_token_ids) + 1),
            "block_size": self.block_size,
            "hash_ids": block_hash_ids(prompt_token_ids, self.block_size, salt, partial=True),
            "sequence_hash_ids": block_hash_ids(computed_token_ids, self.block_size, salt, partial=False),
            "cached_tokens": cached_tokens,
            "pin_tokens": pin_tokens,
            "pin_ttl_s": pin_ttl_s,
            "final": final,
        }
        line = json.dumps(row, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()
            self.num_rows += 1

    def close(self) -> None:
        with self._lock:
            self._file.close()
