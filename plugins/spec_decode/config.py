"""``[plugins.spec_decode]``: which proposer drafts, how many tokens, and when speculation is off."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loopstack.plugin import PluginConfig

__all__ = ["DEFAULT_K", "SpecDecodeConfig"]

# k when unset: suffix states a confidence per draft token, so its drafts are cut one by one and a
# long cap costs nothing where the match is short (measured: docs/techniques/spec-decode.md)
DEFAULT_K = {"suffix": 24, "ngram": 7, "draft_model": 7}


class SpecDecodeConfig(PluginConfig):
    proposer: Literal["suffix", "ngram", "draft_model"] = Field(
        "suffix", description="where draft tokens come from: suffix (SuffixDecoding; the faster one measured here, "
        "with drafts priced by this machine's step cost), ngram (prompt lookup) or draft_model (a smaller model with "
        "the target's tokenizer)")
    num_speculative_tokens: int | None = Field(
        None, ge=1, le=32, description="the most draft tokens verified per step (k); unset: 24 for suffix (whose "
        "drafts adaptive k cuts by their stated confidence), 7 for ngram and draft_model")
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

    # draft_model
    draft_model: str = Field(
        "smollm2-135m-instruct", description="draft_model: a built-in name, a .gguf file or a Hugging Face "
        "directory; it must share the target's tokenizer")
    draft_layers: int | None = Field(
        None, ge=1, description="draft_model: keep only its first N layers (a layer-truncated draft); unset: all")
    draft_quantization: Literal["auto", "none", "int8", "int4"] = Field(
        "auto", description="draft_model: as engine.quantization (int4 on CPU, none on GPU)")
    draft_kv_blocks: int = Field(1024, ge=2, description="draft_model: blocks of the draft's own KV cache")
    draft_cost: float | None = Field(
        None, gt=0, description="draft_model: one draft token's cost as a share of the target's decode step, "
        "for adaptive k; unset: the ratio of the two models' weight bytes")

    @property
    def k(self) -> int:
        """``num_speculative_tokens``, or the proposer's default where it is unset."""
        return self.num_speculative_tokens or DEFAULT_K[self.proposer]

    @model_validator(mode="after")
    def _check(self) -> SpecDecodeConfig:
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
        return self
