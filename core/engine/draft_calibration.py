"""How long a draft is worth verifying, from the proposer's per-token confidence, calibrated online.

A proposer that knows how sure it is of each draft token says so (``Proposal.confidence``: its
estimate that the target accepts token ``i`` given it accepted the tokens before). SuffixDecoding's
is the length of the match its draft continues: measured on the spec bench's agent requests, a
draft following a 2-3 token match kept its first token 55% of the time, one following a 16+ token
match kept every token nearly always. A per-sequence acceptance rate averages those two cases
away; the confidence keeps them apart.

Proposers are not calibrated, so the engine learns what their confidences mean: per proposer, the
observed acceptance of draft tokens in bins of stated confidence (decayed counts, a prior of a few
observations at the stated value). :meth:`DraftCalibration.best_length` then cuts a draft where
expected tokens per unit of cost peak: ``(1 + sum_i prod_{m<=i} p_m) / (1 + cost_j)`` over the
first ``j`` tokens, ``p`` the calibrated acceptances and ``cost_j`` what verifying them costs
(:mod:`loopstack.engine.step_cost`); 0 (no draft) when no ``j`` beats a plain step.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["DraftCalibration"]

# bin edges over stated confidence: fine near 1, where the long drafts are decided
EDGES = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99)
PRIOR = 4.0  # pseudo-observations at the stated confidence
DECAY = 0.995  # per observation in a bin: about the last 200 count


@dataclass
class _Bin:
    reached: float = 0.0  # draft tokens verified with every token before them accepted
    accepted: float = 0.0


@dataclass
class DraftCalibration:
    """One proposer's stated confidence -> observed acceptance (engine thread only)."""

    bins: list[_Bin] = field(default_factory=lambda: [_Bin() for _ in range(len(EDGES) + 1)])

    def calibrated(self, confidence: float) -> float:
        """The acceptance a draft token stated at ``confidence`` has had."""
        stated = min(max(confidence, 0.0), 1.0)
        b = self.bins[bisect.bisect_right(EDGES, stated)]
        return (b.accepted + PRIOR * stated) / (b.reached + PRIOR)

    def record(self, confidences: Sequence[float], num_accepted: int) -> None:
        """A draft stated at ``confidences`` was verified and its first ``num_accepted`` tokens kept."""
        for i, confidence in enumerate(confidences[: num_accepted + 1]):  # tokens past a rejection: not reached
            b = self.bins[bisect.bisect_right(EDGES, min(max(confidence, 0.0), 1.0))]
            b.reached = b.reached * DECAY + 1.0
            b.accepted = b.accepted * DECAY + (1.0 if i < num_accepted else 0.0)

    def best_length(self, confidences: Sequence[float], costs: Sequence[float]) -> int:
        """How many leading draft tokens maximise expected tokens per unit of cost (0: none is worth it).

        ``costs[j - 1]``: what verifying the first ``j`` tokens costs, as a share of the sequence's
        plain step (at least as many as ``confidences``).
        """
        best, best_gain = 0, 1.0
        expected, survive = 1.0, 1.0  # the target's own token always comes
        for j, confidence in enumerate(confidences, 1):
            survive *= self.calibrated(confidence)
            expected += survive
            gain = expected / (1.0 + costs[j - 1])
            if gain > best_gain:
                best, best_gain = j, gain
        return best

    def as_dict(self) -> dict[str, list[float]]:
        """Observed acceptance per bin (lower edge -> rate, tokens reached), for statistics."""
        lows = (0.0, *EDGES)
        return {f"{low:.2f}": [round(b.accepted / b.reached, 3) if b.reached else 0.0, round(b.reached, 1)]
                for low, b in zip(lows, self.bins, strict=True) if b.reached}
