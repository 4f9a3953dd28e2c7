"""Speculative decoding inside the engine step: draft, verify in the batch's one forward, roll back.

Policy in one paragraph. After the scheduler has planned a step, every speculating sequence in
decode state (one uncomputed token) may get draft tokens from its proposer, if the step holds at
most its spec's ``max_batch_size`` sequences (above that, verifying k extra positions per sequence
costs more than it saves; the step then runs exactly as without speculation and nothing is
proposed). Drafts are cut to the request's remaining ``max_tokens`` and context, to the step's
token budget, to the KV blocks free right now (speculation never preempts anyone), and, under a
grammar, to the prefix the grammar allows (the masks of every position are taken on the way and
the grammar rolled back: it advances only on accepted tokens). The forward computes the k+1
positions of each draft next to everyone else's tokens; :mod:`loopstack.engine.acceptance` picks
the tokens to keep; the rejected tokens' KV slots are truncated away. The cap k adapts per sequence:
from its recent per-token acceptance rate, the k that maximises expected tokens per unit of cost,
where a draft's cost is its share of the step: :mod:`loopstack.engine.step_cost` holds a step's
measured time by its rows, so ``j`` more rows in a step of ``B`` rows cost the sequence
``B * (T(B + j) - T(B)) / T(B)`` of its plain step (rows get cheaper the more a step has, until
attention, which each row pays over its own context, dominates). A sequence whose best k is not worth it
(fewer expected tokens than the cost) drafts nothing that step: speculation fades out as the
batch grows, before ``max_batch_size`` cuts it off. A proposer that states its confidence per
draft token (SuffixDecoding: the length of the match) is asked for up to k tokens instead, and
each draft is cut where its calibrated confidence stops paying (:mod:`loopstack.engine.draft_calibration`):
long where it continues a long match, short or nothing where the match is short.
"""

from __future__ import annotations

from collections.abc import Sequence as PySequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loopstack.engine.acceptance import Verdict, verify
from loopstack.engine.block_manager import BlockManager
from loopstack.engine.draft_calibration import DraftCalibration
from loopstack.engine.scheduler import ScheduledChunk
from loopstack.engine.seams.speculation import (
    Proposal,
    Proposer,
    ProposerContext,
    SpeculationSpec,
    proposer_cost,
    states_confidence,
)
from loopstack.engine.step_cost import DEFAULT_STEP_COST, StepCost
from loopstack.engine.text.grammar import apply_bitmask

if TYPE_CHECKING:
    from loopstack.engine.sequence import Sequence

__all__ = ["SequenceSpeculation", "SpeculationStatistics", "Speculator", "best_k", "gain"]

DECAY = 0.7  # weight of history in the per-sequence acceptance estimate


def gain(alpha: float, k: int, cost: float) -> float:
    """Expected tokens per unit of cost of a k-token draft at per-token acceptance ``alpha`` that
    costs ``cost`` (a share of the plain step): ``(1 - alpha^(k+1)) / (1 - alpha)`` tokens for
    ``1 + cost`` (plain decoding: 1)."""
    expected = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return expected / (1 + cost)


def best_k(alpha: float, costs: PySequence[float]) -> int:
    """The draft length (1..len(costs)) with the most expected tokens per unit of cost;
    ``costs[j - 1]``: what a ``j``-token draft costs."""
    return max(range(1, len(costs) + 1), key=lambda k: gain(alpha, k, costs[k - 1]))


@dataclass
class SpeculationStatistics:
    num_proposed: int = 0  # draft tokens verified
    num_accepted: int = 0
    num_verifies: int = 0  # sequence-steps that verified a draft
    num_emitted: int = 0  # tokens those steps appended (accepted + the target's own)
    num_off_steps: int = 0  # steps that skipped speculation for the batch size
    num_switched_off: int = 0  # times speculation went from on to off for the batch size
    acceptance_lengths: list[int] = field(default_factory=list)  # histogram: verifies by accepted count

    def record_verify(self, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        self.num_proposed += num_drafted
        self.num_accepted += num_accepted
        self.num_verifies += 1
        self.num_emitted += num_emitted
        if len(self.acceptance_lengths) <= num_accepted:
            self.acceptance_lengths.extend([0] * (num_accepted + 1 - len(self.acceptance_lengths)))
        self.acceptance_lengths[num_accepted] += 1

    @property
    def tokens_per_forward(self) -> float:
        """Tokens appended per target forward, over the speculating sequences' verify steps."""
        return self.num_emitted / self.num_verifies if self.num_verifies else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "proposed": self.num_proposed, "accepted": self.num_accepted, "verifies": self.num_verifies,
            "emitted": self.num_emitted, "tokens_per_forward": round(self.tokens_per_forward, 3),
            "acceptance_rate": round(self.num_accepted / self.num_proposed, 3) if self.num_proposed else 0.0,
            "off_steps": self.num_off_steps, "switched_off": self.num_switched_off,
            "acceptance_lengths": list(self.acceptance_lengths),
        }


@dataclass
class SequenceSpeculation:
    """One sequence's speculation: its spec and proposer, its acceptance estimate, this step's draft."""

    spec: SpeculationSpec
    proposer: Proposer
    accepted: float = 0.0  # decayed counts of accepted drafts and of rejections
    rejected: float = 0.0
    draft: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    draft_confidence: list[float] | None = None  # the proposer's, per draft token (None: not stated)
    masks: list[torch.Tensor | None] = field(default_factory=list)  # grammar bitmask per verified row
    statistics: SpeculationStatistics = field(default_factory=SpeculationStatistics)  # this sequence's

    @property
    def acceptance_rate(self) -> float:
        """Per-token acceptance estimate (a Beta(1, 1) prior on the decayed counts)."""
        return (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)

    def fade(self) -> None:
        """Decay the evidence without adding any (a step that did not draft)."""
        self.accepted *= DECAY
        self.rejected *= DECAY

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.accepted = self.accepted * DECAY + num_accepted
        self.rejected = self.rejected * DECAY + (1.0 if num_accepted < num_drafted else 0.0)


class Speculator:
    """The engine's speculative decoding: proposers by key, drafting, verification. Engine thread only."""

    def __init__(self, context: ProposerContext, block_manager: BlockManager, max_model_len: int,
                 *, step_cost: StepCost = DEFAULT_STEP_COST) -> None:
        self.context = context
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.step_cost = step_cost
        self.proposers: dict[str, Proposer] = {}
        self.calibrations: dict[str, DraftCalibration] = {}  # per spec key, for proposers stating confidence
        self.statistics = SpeculationStatistics()
        self._num_speculating = 0
        self._was_on = False

    # -- sequences -----------------------------------------------------------------------------

    def attach(self, seq: Sequence, spec: SpeculationSpec) -> None:
        """Make ``seq`` speculate with ``spec`` (builds the spec's proposer on first use)."""
        proposer = self.proposers.get(spec.key)
        if proposer is None:
            proposer = self.proposers[spec.key] = spec.factory(self.context)
        seq.speculation = SequenceSpeculation(spec, proposer)
        self._num_speculating += 1

    def detach(self, seq: Sequence) -> None:
        """``seq`` ended: its proposer may free what it holds and learn from it."""
        state = seq.speculation
        if state is None:
            return
        seq.speculation = None
        seq.speculation_statistics = state.statistics  # what it did, for its last output's usage
        self._num_speculating -= 1
        state.proposer.finish(seq)

    @property
    def is_idle(self) -> bool:
        """No sequence speculates: the step skips this module entirely."""
        return self._num_speculating == 0

    # -- one step ------------------------------------------------------------------------------

    def plan(self, chunks: list[ScheduledChunk], token_budget: int) -> list[ScheduledChunk]:
        """``chunks`` with draft tokens added to the speculating decodes (see the module docstring)."""
        candidates = [i for i, c in enumerate(chunks) if self._wants_draft(c)]
        if not candidates:
            return chunks
        on = [i for i in candidates if len(chunks) <= chunks[i].seq.speculation.spec.max_batch_size]  # type: ignore[union-attr]
        if len(on) < len(candidates):
            self.statistics.num_off_steps += 1
            if self._was_on:
                self.statistics.num_switched_off += 1
            for i in candidates:
                chunks[i].seq.speculation.statistics.num_off_steps += 1  # type: ignore[union-attr]
        self._was_on = bool(on)
        if not on:
            return chunks
        num_rows = sum(c.end - c.start for c in chunks)
        budget = token_budget - num_rows
        longest = max(chunks[i].seq.speculation.spec.num_speculative_tokens for i in on)  # type: ignore[union-attr]
        by_proposer: dict[int, list[int]] = {}
        for i in on:
            by_proposer.setdefault(id(chunks[i].seq.speculation.proposer), []).append(i)  # type: ignore[union-attr]
        planned = list(chunks)
        for indices in by_proposer.values():
            seqs = [chunks[i].seq for i in indices]
            proposer = seqs[0].speculation.proposer  # type: ignore[union-attr]
            costs = self.step_cost.draft_costs(num_rows, longest, proposer_cost(proposer))
            limits = [self.draft_limit(seq, costs) for seq in seqs]
            proposals = proposer.propose(seqs, limits)
            for i, seq, limit, proposal in zip(indices, seqs, limits, proposals, strict=True):
                limit = self._confident_length(seq, proposal, limit, costs)
                draft = self._fit(seq, proposal, min(limit, max(budget, 0)))
                if draft:
                    budget -= len(draft)
                    planned[i] = ScheduledChunk(seq, chunks[i].start, chunks[i].end + len(draft), tuple(draft))
        return planned

    def accept(self, seq: Sequence, logits: torch.Tensor) -> Verdict:
        """Verify ``seq``'s draft against the target's ``logits`` ``[k + 1, V]`` (float32, CPU) and
        roll the rejected tokens' KV back. The caller appends ``Verdict.token_ids``."""
        state = seq.speculation
        assert state is not None and state.draft
        draft = state.draft
        for row, mask in zip(logits, state.masks, strict=True):
            if mask is not None:
                apply_bitmask(row, mask)
        verdict = verify(logits, draft, seq.params, draft_probs=state.draft_probs, generator=seq.generator)
        base = seq.num_tokens  # the last token before the draft is computed now too
        kept = base + verdict.num_accepted
        self.block_manager.truncate(seq.request_id, kept)
        seq.num_computed_tokens = kept
        self.block_manager.mark_computed(seq.request_id, seq.token_ids + draft[: verdict.num_accepted])
        state.record(len(draft), verdict.num_accepted)
        if state.draft_confidence is not None:
            self._calibration(state.spec).record(state.draft_confidence, verdict.num_accepted)
        for stats in (self.statistics, state.statistics):
            stats.record_verify(len(draft), verdict.num_accepted, len(verdict.token_ids))
        state.draft, state.draft_probs, state.draft_confidence, state.masks = [], None, None, []
        return verdict

    # -- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _wants_draft(chunk: ScheduledChunk) -> bool:
        seq = chunk.seq
        return seq.speculation is not None and chunk.samples and chunk.end - chunk.start == 1

    def draft_limit(self, seq: Sequence, costs: PySequence[float]) -> int:
        """The most draft tokens worth verifying for ``seq`` now (``costs[j - 1]``: of a ``j``-token
        draft, as a share of its plain step; at least the spec's k of them). A sequence that has not
        verified yet drafts anyway, to learn."""
        state = seq.speculation
        assert state is not None
        spec = state.spec
        k = spec.num_speculative_tokens
        if spec.adaptive and not states_confidence(state.proposer):  # else each draft is cut by its confidence
            alpha = state.acceptance_rate
            k = best_k(alpha, costs[:k])
            if state.accepted + state.rejected > 0 and gain(alpha, k, costs[k - 1]) <= 1.0:
                state.fade()  # not worth it now; the evidence fades, so it is tried again later
                return 0
        room = min(seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens) - 1
        return max(0, min(k, room))

    def _calibration(self, spec: SpeculationSpec) -> DraftCalibration:
        calibration = self.calibrations.get(spec.key)
        if calibration is None:
            calibration = self.calibrations[spec.key] = DraftCalibration()
        return calibration

    def _confident_length(self, seq: Sequence, proposal: Proposal, limit: int, costs: PySequence[float]) -> int:
        """``limit``, cut where the proposal's calibrated confidence stops paying (adaptive specs)."""
        state = seq.speculation
        assert state is not None
        if not state.spec.adaptive or proposal.confidence is None:
            return limit
        return min(limit, self._calibration(state.spec).best_length(proposal.confidence[:limit], costs))

    def _fit(self, seq: Sequence, proposal: Proposal, limit: int) -> list[int]:
        """The part of ``proposal`` this step verifies; reserves its KV slots and records it on ``seq``."""
        draft = [int(t) for t in proposal.token_ids[:limit]]
        vocab = self.context.vocab_size
        cut = next((i for i, t in enumerate(draft) if not 0 <= t < vocab), len(draft))
        draft = draft[:cut]
        state = seq.speculation
        assert state is not None
        masks: list[torch.Tensor | None] = []
        if draft and seq.grammar is not None:
            draft, masks = _grammar_prefix(seq, draft)
        if not draft:
            return []
        bm = self.block_manager
        needed = seq.num_tokens + len(draft) - bm.num_tokens(seq.request_id)
        while needed > 0 and not bm.can_append(seq.request_id, needed):
            draft.pop()
            needed -= 1
            masks = masks[: len(draft) + 1]
        if not draft:
            return []
        if needed > 0:
            bm.append_slots(seq.request_id, needed)
        state.draft = draft
        state.draft_probs = None if proposal.probs is None else proposal.probs[: len(draft)].float().cpu()
        state.draft_confidence = None if proposal.confidence is None else list(proposal.confidence[: len(draft)])
        state.masks = masks or [None] * (len(draft) + 1)
        return draft


def _grammar_prefix(seq: Sequence, draft: list[int]) -> tuple[list[int], list[torch.Tensor | None]]:
    """The longest prefix of ``draft`` the grammar allows, and the bitmask of each of its k+1
    verified rows (None past a completed grammar); the grammar is left where it was."""
    grammar = seq.grammar
    assert grammar is not None
    kept: list[int] = []
    masks: list[torch.Tensor | None] = []
    for token in draft:
        if grammar.is_terminated:
            break
        mask = grammar.next_token_bitmask()
        masks.append(mask)
        if not grammar.allows(mask, token) or not grammar.accept(token):
            break
        kept.append(token)
    if len(masks) == len(kept):  # every token kept, or the grammar completed: the row after the last
        masks.append(None if grammar.is_terminated else grammar.next_token_bitmask())
    grammar.rollback(len(kept))
    return kept, masks
