"""Per-request settings, validated like any user input: sampling, and hidden-state capture."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from loopstack.engine.errors import EngineError

__all__ = ["HiddenCapture", "InvalidHiddenCaptureError", "InvalidSamplingParamsError", "SamplingParams"]


class InvalidSamplingParamsError(EngineError, ValueError):
    """A sampling value is out of range; the message names the field and what is allowed."""


class InvalidHiddenCaptureError(EngineError, ValueError):
    """A hidden-state capture is malformed, or does not fit the prompt or the model."""


def _problems(exc: ValidationError, default: str) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or default}: {e['msg'].replace('Value error, ', '')}"
        + (f" (got {e['input']!r})" if e["type"] != "missing" and not isinstance(e["input"], dict) else "")
        for e in exc.errors(include_url=False)
    )


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
            raise InvalidSamplingParamsError(f"invalid sampling parameters: {_problems(exc, 'sampling')}") from None


class HiddenCapture(BaseModel):
    """Ask for the mean hidden state of some prompt tokens, computed by the request's own prefill.

    The residual stream after the first ``num_layers`` decoder layers (before the final
    norm), averaged over the prompt positions in ``spans`` (half-open ``[start, end)``,
    sorted, not overlapping). The engine sums the rows in float32 across chunked-prefill
    chunks and delivers the ``[hidden_size]`` float32 mean once, on the ``RequestOutput``
    (``hidden_state``) of the step that computes the last span's last token. A prefix-cache
    hit never skips the spans (the reused prefix stops at the first span's start), and a
    preemption restarts the sum. The engine checks ``num_layers`` against the model and
    ``spans`` against the prompt when the request is added.

    Example: the mean over prompt tokens 40..99 and 180..239 after layer 8::

        HiddenCapture(num_layers=8, spans=((40, 100), (180, 240)))
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: int = Field(ge=1, description="decoder layers applied before the capture (8: the eighth's output)")
    spans: tuple[tuple[int, int], ...] = Field(min_length=1, description="[start, end) prompt positions, sorted")

    @model_validator(mode="after")
    def _check_spans(self) -> HiddenCapture:
        previous_end = 0
        for start, end in self.spans:
            if not previous_end <= start < end:
                raise ValueError(f"span ({start}, {end}) must be non-empty, start at or after the previous "
                                 f"span's end ({previous_end}), and not be negative")
            previous_end = end
        return self

    @property
    def start(self) -> int:
        return self.spans[0][0]

    @property
    def end(self) -> int:
        return self.spans[-1][1]

    @property
    def num_tokens(self) -> int:
        return sum(end - start for start, end in self.spans)

    def positions(self, start: int, end: int) -> list[int]:
        """The captured positions among ``[start, end)``."""
        positions: list[int] = []
        for span_start, span_end in self.spans:
            positions.extend(range(max(span_start, start), min(span_end, end)))
        return positions

    @classmethod
    def make(cls, **values: Any) -> HiddenCapture:
        """Validate ``values``; raise InvalidHiddenCaptureError naming every bad field."""
        try:
            return cls(**values)
        except ValidationError as exc:
            raise InvalidHiddenCaptureError(f"invalid hidden-state capture: {_problems(exc, 'capture')}") from None
