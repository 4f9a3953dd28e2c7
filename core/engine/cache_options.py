"""How an engine manages its KV cache, and how long one request's prefix stays (plain data: both
pickle to replica processes).

:class:`KVCacheOptions` is engine-wide (the ``kv_cache`` plugin answers ``loopstack_kv_cache`` with
one; the policy and the pin share switch while serving, the tier and the request log at start).
:class:`Retention` is per request (``loopstack_kv_retention``): pin the first ``num_tokens`` of its
prompt for ``ttl_s`` seconds once they are computed, and say when the request ends its session (an
agent's answer with no tool call: ``final_unless``), so the eviction policy can let its blocks go first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["KVCacheOptions", "Retention", "RetentionRequest", "TierKind"]

TierKind = Literal["none", "int8", "host"]


@dataclass(frozen=True)
class KVCacheOptions:
    policy: str = "lru"  # an eviction policy of loopstack.engine.eviction.POLICIES
    max_pinned_share: float = 0.25  # of the KV blocks, at most, held by pins
    tier: TierKind = "none"  # second tier: int8 K/V in host memory, or full precision host memory
    tier_blocks: int = 0  # slots in the second tier (0: as many as the primary cache has blocks)
    request_log: str | None = None  # JSONL path: one row per finished request (hash ids, lengths)


@dataclass(frozen=True)
class Retention:
    ttl_s: float  # how long to pin (0: no pin)
    num_tokens: int | None = None  # None: the whole prompt
    key: str | None = None  # pins under one key replace each other (a prompt_cache_key)
    # the request ends its session if it stops with none of these in its output (the tool-call
    # opener of an agent request: an answer without a call ends the agent's task); None: never
    final_unless: tuple[str, ...] | None = None

    def ends_session(self, output_text: str) -> bool:
        """Whether an output that stopped normally ends the request's session (see ``final_unless``)."""
        return self.final_unless is not None and not any(marker in output_text for marker in self.final_unless)


@dataclass(frozen=True)
class RetentionRequest:
    """What the API knows of a request when it asks ``loopstack_kv_retention``."""

    num_prompt_tokens: int
    prompt_cache_key: str | None  # the client's affinity hint (Responses and chat completions field)
    prompt_cache_retention: str | None  # "in_memory" or "24h" (a maximum retention), as the Responses API has it
    prompt_cache_ttl_s: float | None  # prompt_cache_options.ttl in seconds (a minimum lifetime): "30m", "12h"
    static_prefix_tokens: Callable[[], int]  # tokens of the system prompt and tools before the first turn
    # what starts a tool call in this request's output (empty: it offers no tools, so no answer is final)
    tool_call_markers: tuple[str, ...] = ()
