"""One request inside the engine: its tokens, progress, and how it ends."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loopstack.engine.cache_options import Retention
from loopstack.engine.capture import CaptureAccumulator
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.text.grammar import GrammarState
from loopstack.engine.text.tokenizer import IncrementalDecoder

if TYPE_CHECKING:
    from loopstack.engine.seams.speculation import SpeculationSpec
    from loopstack.engine.speculator import SequenceSpeculation, SpeculationStatistics

__all__ = ["FinishReason", "Sequence", "SequenceStatus", "StopChecker"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or string, or the grammar completed
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller (or a guard)
    ERROR = "error"  # the grammar rejected every token, or the step failed
    HANDOFF = "handoff"  # a prefill-only request sampled its first token: its KV is held for a transfer


class StopChecker:
    """Incremental text with stop strings: hold back text that may still become a stop."""

    def __init__(self, decoder: IncrementalDecoder, stops: tuple[str, ...]) -> None:
        self._decoder = decoder
        self._stops = stops
        self._held = ""  # text not yet released (could be the start of a stop string)
        self._hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, token_id: int) -> tuple[str, bool]:
        """Add a token; return (text to release, stop string hit)."""
        return self._scan(self._decoder.step(token_id))

    def flush(self) -> str:
        text, _ = self._scan(self._decoder.flush(), final=True)
        return text

    def _scan(self, new: str, final: bool = False) -> tuple[str, bool]:
        buffer = self._held + new
        cuts = [buffer.find(s) for s in self._stops if s in buffer]
        if cuts:
            self._held = ""
            return buffer[: min(cuts)], True
        keep = 0 if final else min(self._hold, len(buffer))
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False


@dataclass(eq=False)
class Sequence:
    """Mutable state of one request, owned by the engine thread."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    salt: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at first admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    grammar: GrammarState | None = None
    generator: torch.Generator | None = None
    stop_checker: StopChecker | None = None
    output_text: str = ""
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    admitted: bool = False
    capture: CaptureAccumulator | None = None  # a hidden-state capture asked for (see loopstack.engine.capture)
    speculation_spec: SpeculationSpec | None = None  # asked for speculative decoding
    speculation: SequenceSpeculation | None = None  # its state while it runs (see loopstack.engine.speculator)
    speculation_statistics: SpeculationStatistics | None = None  # what its speculation did, once it ended
    prefill_only: bool = False  # end with HANDOFF after the first token, blocks kept (disaggregation)
    retention: Retention | None = None  # when it ends: a pin of its prompt prefix, and whether it ended its session
    num_sampling_forwards: int = 0  # forwards that appended tokens to it (sampled one, or verified a draft)
    kept_logits: torch.Tensor | None = None  # admitted with its whole prompt cached: its first token's logits

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_capturing(self) -> bool:
        """A hidden-state capture was asked for and is not complete yet."""
        return self.capture is not None and self.capture.is_pending

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error = error
