"""The ``ws_deltas`` plugin class: its hooks on the client and the server side."""

from __future__ import annotations

from typing import Any

from loopstack.plugins.ws_deltas.chain_prompt import TokenState
from loopstack.hookspecs import hookimpl
from loopstack.plugin import Layer, Plugin, PluginConfig

from loopstack.plugins.ws_deltas.config import WsDeltasConfig
from loopstack.plugins.ws_deltas.server import commit_middleware
from loopstack.plugins.ws_deltas.transport import DeltaTransport


class WsDeltas(Plugin):
    """Client: route the harness's Responses calls over one WebSocket per session, sending only
    new items when the chain allows. Server: keep each chain's token ids (``token_state``)."""

    name = "ws_deltas"
    layers = (Layer.HARNESS, Layer.API)
    Config = WsDeltasConfig
    summary = "Send only new items over one WebSocket per session; the server keeps the token ids."

    config: WsDeltasConfig

    def __init__(self, config: PluginConfig, *, arm: str = "default") -> None:
        super().__init__(config, arm=arm)
        # read by loopstack.plugins.ws_deltas.chain_prompt for requests this instance serves
        self.token_state = TokenState(self.config.max_chains)

    @hookimpl
    def loopstack_client_transport(self, ctx: Any) -> DeltaTransport:
        return ctx.session.state(self.name, lambda: DeltaTransport(self.config))

    @hookimpl(trylast=True)  # innermost: it sees the events the service produced
    def loopstack_response_middleware(self, runtime: Any) -> Any:
        return commit_middleware
