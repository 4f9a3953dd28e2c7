"""Where a context's tail occurred before in a token stream, and what followed it.

The index keeps, for each of a few n-gram lengths, the end positions of every n-gram of the
stream (appended incrementally). A lookup takes the context's last ``n`` tokens for the longest
``n`` that occurs, extends each occurrence's match backwards to its full length, and keeps the
occurrences with the longest match: exactly the occurrences below the deepest node a suffix tree
of the stream would match (SuffixDecoding's lookup), without building the tree — O(len) memory
and O(1) per appended token instead of O(depth).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loopstack.engine.seams.speculation import SpeculatingSequence

__all__ = ["Continuation", "Match", "SequenceIndex", "TokenIndex"]

SEPARATOR = -1  # between documents of one stream: no match or continuation crosses it


@dataclass(frozen=True)
class Match:
    length: int  # tokens of the context's tail matched
    ends: tuple[int, ...]  # stream positions right after each longest occurrence, most recent first


@dataclass(frozen=True)
class Continuation:
    token_ids: list[int]
    probs: list[float]  # estimated probability that each prefix is right (non-increasing)

    @property
    def expected_accepted(self) -> float:
        return sum(self.probs)


class TokenIndex:
    """An append-only token stream with n-gram position lists (see the module docstring)."""

    def __init__(self, gram_lengths: Sequence[int] = (8, 4, 2), *, max_match: int = 64,
                 max_occurrences: int = 64) -> None:
        self.gram_lengths = tuple(sorted(set(gram_lengths), reverse=True))
        self.max_match = max_match
        self.max_occurrences = max_occurrences
        self.tokens: list[int] = []
        self._grams: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in self.gram_lengths}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, token_ids: Iterable[int]) -> None:
        tokens = self.tokens
        for token in token_ids:
            tokens.append(token)
            end = len(tokens)
            for n, grams in self._grams.items():
                if end >= n:
                    gram = tuple(tokens[end - n : end])
                    if SEPARATOR not in gram:
                        grams.setdefault(gram, []).append(end)

    def end_document(self) -> None:
        """Close the current document: what follows is not its continuation."""
        if self.tokens and self.tokens[-1] != SEPARATOR:
            self.tokens.append(SEPARATOR)

    def match(self, context: Sequence[int], *, exclude_end: int | None = None) -> Match | None:
        """The longest occurrences of ``context``'s tail that have a continuation (``exclude_end``:
        an end position not to count, the context itself when it is this stream)."""
        tokens = self.tokens
        for n in self.gram_lengths:
            if len(context) < n:
                continue
            ends = self._grams[n].get(tuple(context[-n:]))
            if not ends:
                continue
            best, found = 0, []
            for end in reversed(ends[-self.max_occurrences * 4 :]):
                if end == exclude_end or end >= len(tokens) or tokens[end] == SEPARATOR:
                    continue
                length = n
                limit = min(self.max_match, end, len(context))
                while length < limit and tokens[end - length - 1] == context[-length - 1] != SEPARATOR:
                    length += 1
                if length > best:
                    best, found = length, [end]
                elif length == best and len(found) < self.max_occurrences:
                    found.append(end)
            if found:
                return Match(best, tuple(found))
        return None

    def most_recent(self, match: Match, max_tokens: int) -> list[int]:
        """What followed the most recent longest occurrence (prompt lookup)."""
        end = match.ends[0]
        out = self.tokens[end : end + max_tokens]
        return out[: out.index(SEPARATOR)] if SEPARATOR in out else out

    def continuation(self, match: Match, max_tokens: int, min_prob: float) -> Continuation:
        """The most frequent continuation of ``match``'s occurrences, token by token, while the
        estimated probability of the whole prefix (the share of occurrences that agree) stays
        at least ``min_prob``."""
        tokens = self.tokens
        alive = list(match.ends)
        total = len(alive)
        out: list[int] = []
        probs: list[float] = []
        for offset in range(max_tokens):
            counts: dict[int, int] = {}
            for end in alive:
                position = end + offset
                if position < len(tokens) and tokens[position] != SEPARATOR:
                    counts[tokens[position]] = counts.get(tokens[position], 0) + 1
            if not counts:
                break
            token, count = max(counts.items(), key=lambda item: item[1])
            prob = count / total
            if prob < min_prob:
                break
            out.append(token)
            probs.append(prob)
            alive = [end for end in alive if end + offset < len(tokens) and tokens[end + offset] == token]
        return Continuation(out, probs)

    def compact(self, keep_tokens: int) -> None:
        """Keep only about the last ``keep_tokens`` tokens (whole documents), rebuilding the lists."""
        if len(self.tokens) <= keep_tokens:
            return
        tail = self.tokens[-keep_tokens:]
        if SEPARATOR in tail:
            tail = tail[tail.index(SEPARATOR) + 1 :]
        self.tokens = []
        self._grams = {n: {} for n in self.gram_lengths}
        self.extend(tail)


class SequenceIndex(TokenIndex):
    """The index of one sequence's prompt then output, caught up with what it appended since."""

    def __init__(self, gram_lengths: Sequence[int] = (8, 4, 2), *, max_match: int = 64) -> None:
        super().__init__(gram_lengths, max_match=max_match)
        self._num_prompt = 0
        self._num_output = 0

    def catch_up(self, seq: SpeculatingSequence) -> None:
        if self._num_prompt < len(seq.prompt_token_ids):
            self.extend(seq.prompt_token_ids[self._num_prompt :])
            self._num_prompt = len(seq.prompt_token_ids)
        if self._num_output < len(seq.output_token_ids):
            self.extend(seq.output_token_ids[self._num_output :])
            self._num_output = len(seq.output_token_ids)
