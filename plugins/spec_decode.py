"""Speculative decoding: a draft model or n-gram lookup proposes, the target verifies.

Not implemented yet: the config is declared so stacks can set it today.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loopstack.plugin import Layer, Plugin, PluginConfig


class SpecDecodeConfig(PluginConfig):
    proposer: Literal["ngram", "draft"] = Field("ngram", description="where draft tokens come from")
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="tokens proposed per step (k)")
    draft_model: str | None = Field(None, description="draft model name or path (proposer = 'draft')")
    adaptive: bool = Field(True, description="adapt k to the acceptance rate")
    max_batch_size: int = Field(8, ge=1, description="switch off above this many running sequences")


class SpecDecode(Plugin):
    name = "spec_decode"
    layers = (Layer.INFERENCE,)
    Config = SpecDecodeConfig
    summary = "Propose k tokens cheaply, verify them in one target forward."
    implemented = False
