"""Hidden-state capture: the mean residual stream over some prompt positions, taken from the
request's own prefill.

What a request meets, in order:

- :class:`HiddenCapture`, what a caller asks for (validated like any user input), and
  :func:`check_capture`, whether it fits the model and the prompt (when the request is added);
- :class:`CaptureAccumulator`, one sequence's float32 sum across chunked-prefill chunks: it keeps
  the prefix cache short of the first span, restarts on preemption and hands the mean over once;
- :class:`CaptureBatch`, the rows one forward copies out for every capturing sequence in it, one
  :class:`LayerCapture` per layer (what :meth:`CausalLM.forward` fills in).

The engine front ends take ``capture=`` on ``stream``/``generate`` and answer
``hidden_state_model`` (the :class:`~loopstack.engine.config.ModelConfig` a captured vector
belongs to); the vector arrives as ``RequestOutput.hidden_state``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from loopstack.engine.config import ModelConfig
from loopstack.engine.errors import EngineError, describe_validation_error

__all__ = [
    "CaptureAccumulator",
    "CaptureBatch",
    "HiddenCapture",
    "InvalidHiddenCaptureError",
    "LayerCapture",
    "check_capture",
]


class InvalidHiddenCaptureError(EngineError, ValueError):
    """A hidden-state capture is malformed, or does not fit the prompt or the model."""


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
            problems = describe_validation_error(exc, "capture")
            raise InvalidHiddenCaptureError(f"invalid hidden-state capture: {problems}") from None


def check_capture(capture: HiddenCapture, model: ModelConfig, num_prompt_tokens: int) -> None:
    """Raise InvalidHiddenCaptureError if ``capture`` asks for a layer ``model`` lacks or for
    positions past the prompt."""
    if capture.num_layers > model.num_layers:
        raise InvalidHiddenCaptureError(f"capture.num_layers is {capture.num_layers}; the model has {model.num_layers}")
    if capture.end > num_prompt_tokens:
        raise InvalidHiddenCaptureError(f"capture spans end at {capture.end}, past the prompt's "
                                        f"{num_prompt_tokens} tokens")


@dataclass(eq=False)
class CaptureAccumulator:
    """One sequence's capture in progress (owned by the engine thread)."""

    capture: HiddenCapture
    running_sum: torch.Tensor | None = None  # [hidden] float32, on the model's device
    num_captured_tokens: int = 0
    is_done: bool = False
    _result: torch.Tensor | None = field(default=None, repr=False)  # [hidden] float32 mean on CPU, until taken

    @property
    def is_pending(self) -> bool:
        """Some span positions are still to be computed."""
        return not self.is_done

    @property
    def max_cached_tokens(self) -> int | None:
        """The longest cached prefix a (re)admission may reuse: a pending capture must compute
        its spans, so none past the first span's start; None once done (no limit)."""
        return self.capture.start if self.is_pending else None

    def add(self, rows: torch.Tensor) -> None:
        """Add ``[R, hidden]`` captured rows; the mean is ready once every position is in."""
        total = rows.sum(0, dtype=torch.float32)
        self.running_sum = total if self.running_sum is None else self.running_sum + total
        self.num_captured_tokens += rows.shape[0]
        if self.num_captured_tokens == self.capture.num_tokens:
            self._result = (self.running_sum / self.num_captured_tokens).cpu()
            self.running_sum = None
            self.is_done = True

    def restart(self) -> None:
        """Drop an unfinished sum (preemption: its positions are computed again)."""
        if self.is_pending:
            self.running_sum = None
            self.num_captured_tokens = 0

    def take_result(self) -> torch.Tensor | None:
        """The finished mean, once; None before it is complete and after it was taken."""
        result, self._result = self._result, None
        return result


@dataclass(eq=False)
class LayerCapture:
    """Rows of the residual stream to keep from one forward.

    After the first ``num_layers`` decoder layers, rows ``rows`` (``[R]`` token indices into
    the batch) are copied out; the forward sets ``hidden`` to them, ``[R, hidden_size]`` float32.
    """

    num_layers: int
    rows: torch.Tensor
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class _Part:
    accumulator: CaptureAccumulator
    layer: LayerCapture
    offset: int  # into layer.rows
    count: int


class CaptureBatch:
    """The captured rows of one forward: ``layers`` go to the model, :meth:`deliver` hands each
    sequence its rows afterwards."""

    def __init__(self, layers: list[LayerCapture], parts: list[_Part]) -> None:
        self.layers = layers  # sorted by num_layers, as the forward runs them
        self._parts = parts

    @classmethod
    def plan(
        cls, chunks: Sequence[tuple[CaptureAccumulator | None, int, int]], device: torch.device
    ) -> CaptureBatch:
        """``chunks``: ``(accumulator, start, end)`` of every chunk of the batch, in batch order
        (accumulator None: that sequence captures nothing)."""
        rows: dict[int, list[int]] = {}  # num_layers -> batch rows
        spans: list[tuple[CaptureAccumulator, int, int, int]] = []
        offset = 0  # the chunk's first row in the batch
        for accumulator, start, end in chunks:
            if accumulator is not None and accumulator.is_pending:
                positions = accumulator.capture.positions(start, end)
                if positions:
                    num_layers = accumulator.capture.num_layers
                    layer_rows = rows.setdefault(num_layers, [])
                    spans.append((accumulator, num_layers, len(layer_rows), len(positions)))
                    layer_rows.extend(offset + p - start for p in positions)
            offset += end - start
        layers = {n: LayerCapture(n, torch.tensor(r, dtype=torch.long, device=device)) for n, r in sorted(rows.items())}
        return cls(list(layers.values()), [_Part(acc, layers[n], first, count) for acc, n, first, count in spans])

    def deliver(self) -> None:
        """Add each sequence's rows (filled in by the forward) to its accumulator."""
        for part in self._parts:
            assert part.layer.hidden is not None  # the forward fills every LayerCapture it is given
            part.accumulator.add(part.layer.hidden[part.offset:part.offset + part.count])
