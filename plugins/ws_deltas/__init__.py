"""WebSocket deltas: one connection per session, incremental requests, server-side tokens.

Not implemented yet (issue 9): the config is declared so stacks can set it today.
"""

from __future__ import annotations

from pydantic import Field

from loopstack.plugin import Layer, Plugin, PluginConfig


class WsDeltasConfig(PluginConfig):
    ping_interval_s: float | None = Field(20.0, gt=0, description="keepalive ping period; null disables")
    first_event_timeout_s: float | None = Field(30.0, gt=0, description="limit on the wait for a response's first event")
    max_connection_age_s: float | None = Field(3600.0, gt=0, description="rotate connections older than this")
    max_chains: int = Field(1024, ge=1, description="token-state chains the server keeps in memory (LRU)")


class WsDeltas(Plugin):
    name = "ws_deltas"
    layers = (Layer.API,)
    Config = WsDeltasConfig
    summary = "Send only new items over one WebSocket per session; the server keeps the token ids."
    implemented = False
