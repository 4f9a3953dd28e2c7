"""``[plugins.spec_decode]``: which proposer drafts, how many tokens, and when speculation is off."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loopstack.plugin import PluginConfig

__all__ = ["SpecDecodeConfig"]


class SpecDecodeConfig(PluginConfig):
    proposer: Literal["suffix", "ngram"] = Field(
        "ngram", description="where draft tokens come from: ngram (prompt lookup; the faster one measured here) or "
        "suffix (SuffixDecoding); a draft model is not built yet")
    num_speculative_tokens: int = Field(7, ge=1, le=32, description="the most draft tokens verified per step (k)")
    adaptive: bool = Field(True, description="adapt k per sequence to its recent acceptance")
    max_batch_size: int = Field(
        4, ge=1, description="speculate only in steps of at most this many sequences (measured on 2 CPU cores: "
        "see docs/techniques/spec-decode.md)")
    # suffix
    max_match: int = Field(32, ge=2, le=256, description="suffix: the longest tail matched")
    spec_factor: float = Field(1.0, gt=0, le=16, description="suffix: draft tokens per matched token, at most")
    min_prob: float = Field(0.1, ge=0, le=1, description="suffix: stop drafting below this estimated probability")
    global_tokens: int = Field(262_144, ge=0, description="suffix: recent output tokens per tenant in the global index")
    # ngram
    min_n: int = Field(2, ge=1, le=64, description="ngram: the shortest tail matched")
    max_n: int = Field(8, ge=1, le=64, description="ngram: the longest tail matched")

    @model_validator(mode="after")
    def _check(self) -> SpecDecodeConfig:
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
        return self
