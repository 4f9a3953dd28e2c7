"""Prefill/decode disaggregation: separate worker processes joined by a KV connector.

Not implemented yet: the config is declared so stacks can set it today.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loopstack.plugin import Layer, Plugin, PluginConfig


class DisaggregationConfig(PluginConfig):
    prefill_workers: int = Field(1, ge=1)
    decode_workers: int = Field(1, ge=1)
    connector: Literal["shm", "tcp"] = Field("shm", description="KV transfer: shared memory on one host, TCP across hosts")
    transfer_timeout_s: float = Field(10.0, gt=0)


class Disaggregation(Plugin):
    name = "disaggregation"
    layers = (Layer.INFERENCE,)
    Config = DisaggregationConfig
    summary = "Prefill and decode in separate workers; KV blocks handed over by a connector."
    implemented = False
