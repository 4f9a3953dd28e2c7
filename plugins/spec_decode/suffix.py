"""SuffixDecoding (Oliaro et al., 2024): draft from the most frequent continuation of the longest
match of the sequence's tail, in its own prompt and output and in the recent outputs of all
requests.

Each sequence gets a :class:`~loopstack.plugins.spec_decode.token_index.SequenceIndex` over its
prompt and output (updated with the tokens appended since its last proposal), and each tenant
(cache salt: tenants never see each other's outputs) a global index over the outputs of its
recently finished requests, bounded in tokens. Both are looked up; the candidate with more expected
accepted tokens wins. The draft is at most ``spec_factor`` times the match length (a long match
is a confident one) and stops where the estimated probability of the prefix falls below
``min_prob``.

Each draft token carries a confidence (:attr:`Proposal.confidence`): the share of the match's
occurrences that continue with it, times ``m / (m + 1)`` for the match length ``m`` it extends
(the tail matched plus the draft tokens before it). The engine calibrates it and cuts the draft
where it stops paying, so a long match drafts long and a short one drafts a token or two.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from loopstack.engine.seams.speculation import Proposal, ProposerContext, SpeculatingSequence
from loopstack.plugins.spec_decode.token_index import Continuation, Match, SequenceIndex, TokenIndex

__all__ = ["SuffixOptions", "SuffixProposer"]


@dataclass(frozen=True)
class SuffixOptions:
    max_match: int = 32  # the deepest match looked for (SuffixDecoding's tree depth)
    spec_factor: float = 1.0  # draft at most this many tokens per matched token
    min_prob: float = 0.1  # stop the draft where the prefix's estimated probability drops below
    global_tokens: int = 262_144  # recent output tokens kept per tenant for the global index
    global_tenants: int = 64  # tenants with a global index (least recently used dropped)


class SuffixProposer:
    """The ``suffix`` proposer (see the module docstring)."""

    states_confidence = True

    def __init__(self, context: ProposerContext, options: SuffixOptions | None = None) -> None:
        self.options = options or SuffixOptions()
        self._tracked: dict[str, SequenceIndex] = {}
        self._global: OrderedDict[str, TokenIndex] = OrderedDict()

    def propose(self, seqs: Sequence[SpeculatingSequence], max_tokens: Sequence[int]) -> list[Proposal]:
        return [self._draft(seq, limit) if limit > 0 else Proposal([]) for seq, limit in zip(seqs, max_tokens)]

    def finish(self, seq: SpeculatingSequence) -> None:
        self._tracked.pop(seq.request_id, None)
        if seq.output_token_ids:
            index = self._global_index(seq.salt)
            index.extend(seq.output_token_ids)
            index.end_document()
            if len(index) > self.options.global_tokens * 2:
                index.compact(self.options.global_tokens)

    def _draft(self, seq: SpeculatingSequence, limit: int) -> Proposal:
        options = self.options
        own = self._tracked.get(seq.request_id)
        if own is None:
            own = self._tracked[seq.request_id] = SequenceIndex(max_match=options.max_match)
        own.catch_up(seq)
        context = own.tokens
        best, best_confidence, best_expected = Continuation([], []), [], 0.0
        sources: list[TokenIndex] = [own]
        shared = self._global.get(seq.salt)
        if shared is not None:
            sources.append(shared)
        for index in sources:
            match = index.match(context)
            if match is None:
                continue
            budget = min(limit, max(1, math.ceil(options.spec_factor * match.length)))
            candidate = index.continuation(match, budget, options.min_prob)
            confidence = draft_confidence(match, candidate)
            expected = sum(itertools.accumulate(confidence, operator.mul))
            if expected > best_expected:
                best, best_confidence, best_expected = candidate, confidence, expected
        return Proposal(best.token_ids, confidence=best_confidence)

    def _global_index(self, salt: str) -> TokenIndex:
        index = self._global.get(salt)
        if index is None:
            index = self._global[salt] = TokenIndex(max_match=self.options.max_match)
            while len(self._global) > self.options.global_tenants:
                self._global.popitem(last=False)
        self._global.move_to_end(salt)
        return index


def draft_confidence(match: Match, continuation: Continuation) -> list[float]:
    """Per draft token: the share of occurrences continuing with it among those that continued
    with the tokens before, times ``m / (m + 1)`` for the match length ``m`` it extends."""
    out, before = [], 1.0
    for i, prob in enumerate(continuation.probs):
        length = match.length + i
        out.append((prob / before if before > 0 else 0.0) * length / (length + 1))
        before = prob
    return out
