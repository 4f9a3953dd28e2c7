"""Prefix pinning: byte-stable, append-only requests and a prefix-break detector.

Not implemented yet (issue 8): the config is declared so stacks can set it today.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loopstack.plugin import Layer, Plugin, PluginConfig


class PrefixPinningConfig(PluginConfig):
    tool_order: Literal["sorted", "first_seen"] = Field("sorted", description="how tools are pinned")
    strict: bool = Field(False, description="raise on a prefix break (for tests of other plugins)")


class PrefixPinning(Plugin):
    name = "prefix_pinning"
    layers = (Layer.HARNESS, Layer.API)
    Config = PrefixPinningConfig
    summary = "Canonical, append-only requests so the engine's prefix cache keeps hitting."
    implemented = False
