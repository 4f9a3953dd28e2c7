"""The ``[plugins.kv_cache]`` table."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loopstack.plugin import PluginConfig

__all__ = ["KVCacheConfig"]


class KVCacheConfig(PluginConfig):
    """Defaults measured with ``loopstack bench --workload kv`` (docs/techniques/kv-cache.md)."""

    policy: Literal["lru", "slru", "frequency", "reuse"] = Field(
        "reuse", description="eviction policy of the engine's prefix cache (switches on live reload)"
    )
    pin_static_prefix: bool = Field(
        True, description="pin each request's system prompt and tool definitions for pin_ttl_s"
    )
    pin_ttl_s: float = Field(600.0, gt=0, description="how long a static prefix stays pinned after its last use")
    max_pinned_share: float = Field(
        0.25, ge=0, le=0.9, description="share of the KV blocks pins may hold (0: no pins)"
    )
    extended_retention_s: float = Field(
        86_400.0, gt=0, description='what prompt_cache_retention="24h" pins a whole prompt for'
    )
    final_answers_first: bool = Field(
        True, description="an agent request (one offering tools) answered without a tool call ended its session:"
        " tell the eviction policy, so `reuse` lets its blocks go first"
    )
    tier: Literal["none", "int8", "host"] = Field(
        "none", description="second tier behind the KV cache: int8 K/V in host memory (CPU), host memory (GPU)"
    )
    tier_blocks: int = Field(0, ge=0, description="second tier slots (0: as many as the KV cache has blocks)")
    request_log: str = Field(
        "", description="write one JSONL row per finished request (block hash ids and lengths, no text) for"
        " `loopstack kv advise`; empty: off"
    )
