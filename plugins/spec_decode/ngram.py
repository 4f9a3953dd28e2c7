"""Prompt lookup (n-gram) drafting: find the longest recent occurrence of the sequence's last
tokens in its own prompt and output, and propose what followed it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loopstack.engine.seams.speculation import Proposal, ProposerContext, SpeculatingSequence
from loopstack.plugins.spec_decode.token_index import SequenceIndex

__all__ = ["NgramOptions", "NgramProposer"]


@dataclass(frozen=True)
class NgramOptions:
    min_n: int = 2  # the shortest tail worth matching
    max_n: int = 8  # the longest tail looked up first


class NgramProposer:
    """The ``ngram`` proposer: the most recent longest match's continuation, as long as allowed."""

    def __init__(self, context: ProposerContext, options: NgramOptions | None = None) -> None:
        self.options = options or NgramOptions()
        lengths = sorted({self.options.max_n, max(self.options.min_n, self.options.max_n // 2), self.options.min_n})
        self._lengths = tuple(lengths)
        self._indexes: dict[str, SequenceIndex] = {}

    def propose(self, seqs: Sequence[SpeculatingSequence], max_tokens: Sequence[int]) -> list[Proposal]:
        out = []
        for seq, limit in zip(seqs, max_tokens):
            index = self._index(seq)
            match = index.match(index.tokens) if limit > 0 else None
            out.append(Proposal(index.most_recent(match, limit) if match is not None else []))
        return out

    def finish(self, seq: SpeculatingSequence) -> None:
        self._indexes.pop(seq.request_id, None)

    def _index(self, seq: SpeculatingSequence) -> SequenceIndex:
        index = self._indexes.get(seq.request_id)
        if index is None:
            index = self._indexes[seq.request_id] = SequenceIndex(self._lengths, max_match=self.options.max_n)
        index.catch_up(seq)
        return index
