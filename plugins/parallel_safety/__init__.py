"""Parallel safety: guards that overlap inference instead of preceding it.

Not implemented yet (issue 10): the config is declared so stacks can set it today.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loopstack.plugin import Layer, Plugin, PluginConfig


class ParallelSafetyConfig(PluginConfig):
    mode: Literal["sequential", "stream_then_cut", "hold_until_pass"] = Field(
        "stream_then_cut", description="how guards and inference overlap"
    )
    chunk_tokens: int = Field(32, ge=1, description="output tokens per guard check")
    overlap_tokens: int = Field(8, ge=0, description="tokens shared by consecutive chunks")
    guard_timeout_s: float = Field(2.0, gt=0, description="limit on one guard check")
    fail_open: bool = Field(False, description="let traffic through when a guard errors or times out")


class ParallelSafety(Plugin):
    name = "parallel_safety"
    layers = (Layer.API,)
    Config = ParallelSafetyConfig
    summary = "Run input and output guards alongside prefill and decode."
    implemented = False
