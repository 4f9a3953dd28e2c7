"""Cache-aware routing: send a request to the replica holding its longest cached prefix.

Not implemented yet: the config is declared so stacks can set it today.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loopstack.plugin import Layer, Plugin, PluginConfig


class CacheRoutingConfig(PluginConfig):
    policy: Literal["cache_aware", "round_robin", "random", "least_load"] = Field(
        "cache_aware", description="routing policy (the others exist for comparison)"
    )
    mode: Literal["precise", "approximate"] = Field(
        "approximate", description="precise: engines' KV events; approximate: the router's own prefix tree"
    )
    balance_threshold: float = Field(
        0.25, ge=0, le=1, description="load imbalance above which load wins over cache affinity"
    )


class CacheRouting(Plugin):
    name = "cache_routing"
    layers = (Layer.INFERENCE,)
    Config = CacheRoutingConfig
    summary = "Route to the replica with the longest cached prefix, balanced against load."
    implemented = False
