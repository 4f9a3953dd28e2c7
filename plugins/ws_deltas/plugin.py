"""The ``ws_deltas`` plugin class: its hooks on the client and the server side."""

from __future__ import annotations

from typing import Any

from loopstack.hookspecs import hookimpl
from loopstack.plugin import Layer, Plugin, PluginConfig
from loopstack.plugins.ws_deltas.chain_prompt import ChainPrompt, TokenState
from loopstack.plugins.ws_deltas.config import WsDeltasConfig
from loopstack.plugins.ws_deltas.server import chain_prompt, commit_middleware
from loopstack.plugins.ws_deltas.transport import SESSION_TRANSPORT, DeltaTransport
from loopstack.types import PromptRequest


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
        self.token_state = TokenState(self.config.max_chains)  # the chains of the requests this instance serves

    @hookimpl
    def loopstack_client_transport(self, ctx: Any) -> DeltaTransport:
        slot = ctx.session.state(SESSION_TRANSPORT)
        if slot.transport is None:
            slot.transport = DeltaTransport(self.config)
        return slot.transport

    @hookimpl
    def loopstack_prompt_ids(self, prompt: PromptRequest, ctx: Any) -> ChainPrompt | None:
        return chain_prompt(self.token_state, prompt)

    @hookimpl(trylast=True)  # innermost: it sees the events the service produced
    def loopstack_response_middleware(self, runtime: Any) -> Any:
        return commit_middleware
