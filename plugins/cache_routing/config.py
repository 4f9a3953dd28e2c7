"""The ``[plugins.cache_routing]`` table."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loopstack.plugin import PluginConfig

__all__ = ["CacheRoutingConfig", "PolicyName"]

PolicyName = Literal["cache_aware", "round_robin", "random", "least_load", "session_affinity"]


class CacheRoutingConfig(PluginConfig):
    """Defaults measured on the Mooncake trace replay (docs/techniques/cache-routing.md)."""

    policy: PolicyName = Field(
        "cache_aware", description="routing policy (the others exist for comparison and A/B arms)"
    )
    mode: Literal["auto", "precise", "approximate"] = Field(
        "auto",
        description="precise: replicas' KV events; approximate: the router's routing history;"
        " auto: precise for replicas that publish events, approximate for the rest",
    )
    balance: Literal["cost", "threshold"] = Field(
        "cost", description="cost: uncached prefill plus queued work (Dynamo-style); threshold: SGLang-style"
    )
    prefill_weight: float = Field(1.0, ge=0, description="cost of one uncached prompt token of this request")
    queue_weight: float = Field(0.1, ge=0, description="cost of one token of prefill already queued on the replica")
    new_session_queue_weight: float | None = Field(
        1.0, ge=0,
        description="queue_weight for a prompt_cache_key the router has not routed (a conversation's first"
        " turn: no prefix of its own is cached anywhere yet); none: queue_weight",
    )
    decode_weight: float = Field(0.0, ge=0, description="cost of one token held by the replica's running requests")
    running_weight: float = Field(
        0.04, ge=0, description="cost of each request the replica is running, as a share of this request's prompt tokens"
    )
    balance_abs_threshold: int = Field(8, ge=0, description="threshold: in-flight gap above which load wins")
    balance_rel_threshold: float = Field(1.5, ge=1, description="threshold: and max above this many times min")
    cache_threshold: float = Field(0.0, ge=0, le=1, description="threshold: share of the prompt a match must exceed")
    pending_ttl_s: float = Field(
        30.0, ge=0, description="precise: how long a prompt sent to a replica counts as cached there before its events arrive (0: off)"
    )
    admission: Literal["off", "shortest_first"] = Field(
        "off",
        description="shortest_first: the router holds requests while a replica has admission_budget_tokens of"
        " prefill outstanding and sends the shortest uncached prefill first; off: send at once",
    )
    admission_budget_tokens: int = Field(
        512, ge=1, description="shortest_first: uncached prefill tokens a replica may have sent and not yet answered"
    )
    admission_max_wait_s: float | None = Field(
        10.0, gt=0, description="shortest_first: a request held this long goes before shorter ones (none: never)"
    )
    history_ttl_s: float = Field(600.0, gt=0, description="approximate: how long a routed prefix counts as cached")
    history_max_entries: int = Field(1_000_000, ge=1, description="approximate: (block, replica) pairs kept")
    virtual_nodes: int = Field(64, ge=1, le=4096, description="session_affinity: ring points per replica")
    seed: int | None = Field(None, description="random, least_load: RNG seed (None: from the OS)")
