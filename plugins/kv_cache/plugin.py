"""The ``kv_cache`` plugin: the engine's eviction policy, pinned prefixes, a second tier, a request log.

Engine-wide settings go out through ``loopstack_kv_cache`` (asked when engines start and after every
live reload); per request, ``loopstack_kv_retention`` maps what the client asked and what the stack
asks to a pin the engine takes when the request ends: ``prompt_cache_options.ttl`` ("30m", "12h":
a minimum lifetime) or ``prompt_cache_retention="24h"`` pin the whole prompt under its
``prompt_cache_key`` (so a session's next turn replaces its last pin); otherwise
``pin_static_prefix`` pins the system prompt and tools for ``pin_ttl_s``. Pins stay within
``max_pinned_share`` of the cache. With ``final_answers_first``, an agent request (one offering tools)
also carries what a tool call starts with, so the engine knows when its answer, with no call, ended
the agent's task; ``reuse`` then evicts that session's blocks before any other's. The block manager
does the rest (:mod:`loopstack.engine.block_manager`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from loopstack.context import RequestContext
from loopstack.engine.cache_options import KVCacheOptions, Retention, RetentionRequest
from loopstack.hookspecs import hookimpl
from loopstack.plugin import Layer, Plugin
from loopstack.plugins.kv_cache.config import KVCacheConfig

__all__ = ["EXTENDED_RETENTION", "KVCache", "kv_cache_options"]

# prompt_cache_retention values (the Responses API spells the default "in_memory"; "in-memory" seen too)
EXTENDED_RETENTION = "24h"


def kv_cache_options(config: KVCacheConfig) -> KVCacheOptions:
    return KVCacheOptions(policy=config.policy, max_pinned_share=config.max_pinned_share, tier=config.tier,
                          tier_blocks=config.tier_blocks, request_log=config.request_log or None)


class KVCache(Plugin):
    name = "kv_cache"
    layers = (Layer.INFERENCE,)
    Config = KVCacheConfig
    summary = "Eviction policy (lru, slru, frequency, reuse), pinned prefixes with a TTL, a second KV tier, a request log."

    config: KVCacheConfig

    @hookimpl
    def loopstack_kv_cache(self, engine_config: Any) -> KVCacheOptions:
        return kv_cache_options(self.config)

    @hookimpl
    def loopstack_kv_retention(self, request: RetentionRequest, ctx: RequestContext) -> Retention | None:
        retention = self._pin(request)
        if not (self.config.final_answers_first and request.tool_call_markers):
            return retention
        return replace(retention or Retention(0.0), final_unless=request.tool_call_markers)

    def _pin(self, request: RetentionRequest) -> Retention | None:
        if request.prompt_cache_ttl_s is not None:  # prompt_cache_options.ttl: a minimum lifetime
            return Retention(request.prompt_cache_ttl_s, None, request.prompt_cache_key)
        if request.prompt_cache_retention == EXTENDED_RETENTION:
            return Retention(self.config.extended_retention_s, None, request.prompt_cache_key)
        if not self.config.pin_static_prefix:
            return None
        num_tokens = request.static_prefix_tokens()
        return Retention(self.config.pin_ttl_s, num_tokens) if num_tokens > 0 else None
