"""The seam speculative decoding plugs into: what a proposer is, and how a request asks for one.

A request that speculates carries a :class:`SpeculationSpec` (``stream(..., speculation=spec)``).
The engine keeps one :class:`Proposer` per spec key for its whole life (a proposer may learn
across requests: SuffixDecoding's global tree, a draft model's KV cache) and asks it, once per
step, for drafts for every speculating sequence in decode state; the target verifies them all
in that step's one forward (see :mod:`loopstack.engine.speculator`). A spec is plain data and a
picklable factory, so it travels to replica processes as it is.

Third parties write a proposer class with :meth:`Proposer.propose` (and ``finish``) and return
``SpeculationSpec(factory=TheirProposer, key="theirs", ...)`` from the ``loopstack_proposer`` hook.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from loopstack.engine.sampling_params import SamplingParams

__all__ = [
    "Proposal", "Proposer", "ProposerContext", "ProposerFactory", "SpeculatingSequence", "SpeculationSpec",
    "proposer_cost", "states_confidence",
]


class SpeculatingSequence(Protocol):
    """What a proposer may read of a sequence (the engine's own :class:`~loopstack.engine.sequence.Sequence`,
    read only: do not mutate its lists)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    salt: str
    params: SamplingParams  # a sampling draft model draws from the target's temperature, top-k, top-p


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one sequence: what the proposer thinks follows its last token.

    ``probs``: ``[len(token_ids), V]`` float32, the distribution each draft token was drawn from
    (a draft model sampling); ``None`` for a deterministic draft (model-free proposers, greedy
    drafts). Rejection sampling uses it so the output distribution stays the target's.

    ``confidence``: per draft token, the proposer's estimate that the target accepts it given it
    accepted the tokens before (any monotone score in [0, 1]: the engine calibrates it, see
    :mod:`loopstack.engine.draft_calibration`); ``None``: no estimate. A proposer whose proposals
    carry one declares ``states_confidence = True``: adaptive k then asks it for up to k tokens and
    cuts each draft where its calibrated confidence stops paying, instead of capping every draft
    of the sequence by its recent acceptance rate.
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None
    confidence: list[float] | None = None


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer factory gets from the engine that will run it."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: torch.device
    tokenizer: Any  # the target's tokenizer (a draft model must share it)
    target_weight_bytes: int = 0  # what the target reads per decode step (model_runner.weight_bytes)


@runtime_checkable
class Proposer(Protocol):
    """Proposes draft tokens; one per engine and spec key, called on the engine thread only."""

    def propose(self, seqs: Sequence[SpeculatingSequence], max_tokens: Sequence[int]) -> list[Proposal]:
        """Drafts for ``seqs`` (one per sequence, in order), at most ``max_tokens[i]`` tokens each
        (an empty proposal: nothing to propose, the sequence decodes plainly this step)."""
        ...

    def finish(self, seq: SpeculatingSequence) -> None:
        """``seq`` ended (finished, aborted or preempted): free what is held for it, learn from its output."""
        ...


def proposer_cost(proposer: Proposer) -> float:
    """What proposing one draft token costs, as a share of the target's plain decode step: a
    proposer's optional ``cost_per_token`` attribute (a draft model's forward), 0 without one
    (model-free proposers: a lookup is free next to a forward). Adaptive k weighs it."""
    return float(getattr(proposer, "cost_per_token", 0.0))


def states_confidence(proposer: Proposer) -> bool:
    """Whether ``proposer``'s proposals carry :attr:`Proposal.confidence` (its optional
    ``states_confidence`` attribute; False without one)."""
    return bool(getattr(proposer, "states_confidence", False))


ProposerFactory = Callable[[ProposerContext], Proposer]


@dataclass(frozen=True)
class SpeculationSpec:
    """How one request speculates.

    Attributes:
        factory: builds the engine's proposer for ``key`` on first use (a class or a
            ``functools.partial`` of one: it must pickle to reach a replica process).
        key: identifies the proposer instance within an engine (same key, same proposer).
        num_speculative_tokens: the most draft tokens verified per step (k).
        adaptive: adapt k per sequence to its recent acceptance.
        max_batch_size: speculate only in steps with at most this many sequences; above it
            verifying costs more than it saves.
    """

    factory: ProposerFactory
    key: str
    num_speculative_tokens: int = 7
    adaptive: bool = True
    max_batch_size: int = 4

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
