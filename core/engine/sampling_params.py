"""How to pick tokens for one request, validated like any user input (hidden-state capture:
:mod:`loopstack.engine.capture`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from loopstack.engine.errors import EngineError, describe_validation_error

__all__ = ["InvalidSamplingParamsError", "SamplingParams"]


class InvalidSamplingParamsError(EngineError, ValueError):
    """A sampling value is out of range; the message names the field and what is allowed."""


class SamplingParams(BaseModel):
    """How to pick tokens for one request.

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` switch those
    filters off. ``grammar`` constrains output (see :mod:`loopstack.engine.text.grammar`):
    ``{"type": "json_schema", "schema": {...}}``, ``{"type": "structural_tag", "format":
    {...}}``, ``{"type": "regex", "pattern": "..."}`` or ``{"type": "ebnf", "grammar": "..."}``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(256, ge=1, description="tokens to generate at most")
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens (0: off)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass (1: off)")
    seed: int | None = Field(None, ge=0, description="makes sampling reproducible per request")
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = Field((), description="stop strings (not included in the output)")
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=20, description="top-n logprobs per token (0: only the chosen)")
    grammar: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_stops(self) -> SamplingParams:
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def make(cls, **values: Any) -> SamplingParams:
        """Validate ``values``; raise InvalidSamplingParamsError naming every bad field."""
        try:
            return cls(**values)
        except ValidationError as exc:
            problems = describe_validation_error(exc, "sampling")
            raise InvalidSamplingParamsError(f"invalid sampling parameters: {problems}") from None
