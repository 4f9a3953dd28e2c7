"""Prompts for engine benchmarks: real agent-session text when ../shared/data is there."""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TRAJECTORIES = "trajectories/swebench_minisweagent/full_trajectories"
# the cached-prompt TTFT is the median of this many calls (one call is under a millisecond in-process:
# mostly this machine's noise), in-process and over HTTP alike
CACHED_TTFT_REPEATS = 15


@functools.lru_cache(maxsize=4)
def _corpus(data_dir: Path) -> str:
    texts: list[str] = []
    folder = data_dir / TRAJECTORIES
    for path in sorted(folder.glob("*.traj.json")) if folder.is_dir() else []:
        messages = json.loads(path.read_text()).get("messages", [])
        texts.extend(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    if not texts:  # a user's machine without the shared data: plain but deterministic text
        texts = [f"Step {i}: run the tests, read the failure, fix the function, run them again." for i in range(3000)]
    return "\n".join(texts)


def bench_prompt_ids(tokenizer: Any, num_tokens: int, data_dir: Path, *, variant: int) -> list[int]:
    """``num_tokens`` token ids of real text; each ``variant`` starts at a different place."""
    ids = _token_ids(tokenizer, data_dir)
    start = (variant * 7919) % max(1, len(ids) - num_tokens)
    window = ids[start : start + num_tokens]
    while len(window) < num_tokens:
        window += ids[: num_tokens - len(window)]
    return window


@functools.lru_cache(maxsize=4)
def _token_ids_cached(tokenizer_id: int, tokenizer: Any, data_dir: Path) -> tuple[int, ...]:
    return tuple(tokenizer.encode(_corpus(data_dir)[:400_000]))


def _token_ids(tokenizer: Any, data_dir: Path) -> list[int]:
    return list(_token_ids_cached(id(tokenizer), tokenizer, data_dir))


# what an agent's next turn adds to a cached conversation: a short new message
NEXT_TURN_TEXT = "\n\nNow list the files you changed and say in one sentence why each changed."

ESSAY_TOPICS = ("the printing press", "steam engines", "the history of maps", "bread baking", "lighthouses",
                "the postal service", "glass making", "clocks and calendars")


@dataclass(frozen=True)
class EnginePrompts:
    """One round of the engine bench: token ids for the in-process backends, texts for the servers.

    ``prefill``: a long prompt (prefill tok/s); ``batch``: same-length prompts decoded together
    (the first alone is batch 1); ``ttft``: a prompt timed cold, then again (all of it cached),
    then with ``next_turn`` after it (its prefix cached, a new message to compute, as in an agent's
    next turn); ``long_context``: a prompt of an agent's length, batch-1 decode after it.
    ``*_text``: the same as chat messages for the servers (``essays`` ask for long answers, so
    every stream decodes ``decode_tokens`` before the model would stop).
    """

    prefill: list[int]
    batch: list[list[int]]
    ttft: list[int]
    decode_tokens: int
    prefill_text: str = ""
    ttft_text: str = ""
    essays: tuple[str, ...] = ()
    next_turn: list[int] = field(default_factory=list)
    next_turn_text: str = ""
    long_context: list[int] = field(default_factory=list)  # batch-1 decode after it (empty: not measured)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EnginePrompts:
        return cls(**{**data, "essays": tuple(data.get("essays", ()))})
