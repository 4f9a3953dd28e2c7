"""The ``[plugins.ws_deltas]`` table."""

from __future__ import annotations

from pydantic import Field

from loopstack.plugin import PluginConfig


class WsDeltasConfig(PluginConfig):
    ping_interval_s: float | None = Field(20.0, gt=0, description="keepalive ping period; null disables")
    ping_timeout_s: float | None = Field(20.0, gt=0, description="a pong later than this closes the connection")
    first_event_timeout_s: float | None = Field(30.0, gt=0, description="limit on the wait for a first event")
    max_connection_age_s: float | None = Field(3600.0, gt=0, description="rotate connections older than this")
    max_chains: int = Field(1024, ge=1, description="token-state chains the server keeps in memory (LRU)")
    max_reconnects: int = Field(3, ge=0, description="further attempts when opening the connection fails")
    backoff_s: float = Field(0.1, gt=0, description="wait before the first reconnect, doubled each time")
    max_backoff_s: float = Field(5.0, gt=0, description="cap on the wait between reconnects")
    max_resends: int = Field(2, ge=0, description="resends of a request whose connection dropped mid-response")
