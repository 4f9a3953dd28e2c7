"""A fielded BM25 index over tool descriptions, updated in place as tools come and go.

Scoring is BM25F (Robertson & Zaragoza): per term, the field frequencies are length-
normalized per field, weighted, summed into one pseudo frequency, then saturated once
with ``k1`` and multiplied by the term's idf (Lucene's ``ln(1 + (N - df + .5) / (df + .5))``,
never negative, so adding or removing a tool needs no global correction). It ranks like
``rank_bm25.BM25Okapi`` on a single field, but walks postings lists instead of every
document per query term, so one search over 4,938 tools costs well under a millisecond.

A query that names a tool (``create_issue``, ``createIssue``, or a near miss of a one-word
query such as ``create_isue``) puts that tool first whatever BM25 says.
"""

from __future__ import annotations

import difflib
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from loopstack.plugins.tool_search.retrieval.terms import normalize_name, terms

__all__ = ["FieldWeights", "Hit", "IndexStatistics", "ToolDoc", "ToolIndex"]

FIELDS = ("name", "namespace", "title", "description", "parameters")
# identifier-looking tokens in a query: snake/dotted/dashed names or camelCase words
_IDENTIFIER = re.compile(r"[A-Za-z0-9]+(?:[._\-/][A-Za-z0-9]+)+|[a-z0-9]+[A-Z][A-Za-z0-9]*|[A-Z][a-z0-9]+[A-Z][A-Za-z0-9]*")
_EXACT_BONUS = 1e6  # above any BM25 score
_NEAR_BONUS = 1e5
_NEAR_CUTOFF = 0.85
_NEAR_CANDIDATES = 20


def _trigrams(text: str) -> set[str]:
    return {text[i : i + 3] for i in range(max(len(text) - 2, 1))}


@dataclass(frozen=True)
class FieldWeights:
    """How much a term found in each field counts (BM25F weights)."""

    name: float = 3.0
    namespace: float = 1.0
    title: float = 1.5
    description: float = 1.0
    parameters: float = 0.5

    def of(self, field_name: str) -> float:
        return float(getattr(self, field_name))


@dataclass(frozen=True)
class ToolDoc:
    """The searchable text of one tool. ``key`` is unique in an index (the tool name)."""

    key: str
    name: str
    namespace: str = ""
    title: str = ""
    description: str = ""
    parameters: str = ""  # parameter names and descriptions, space-separated

    def field_text(self, field_name: str) -> str:
        return str(getattr(self, field_name))


class Hit(NamedTuple):
    key: str
    score: float


class IndexStatistics(NamedTuple):
    num_docs: int
    num_terms: int
    num_upserts: int
    num_removes: int
    num_searches: int


@dataclass
class _Field:
    weight: float
    postings: dict[str, dict[int, int]] = field(default_factory=dict)  # term -> slot -> tf
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [capacity]
    total_length: float = 0.0


class ToolIndex:
    """BM25F over :class:`ToolDoc` fields with incremental :meth:`upsert` and :meth:`remove`.

    Args:
        weights: per-field weights.
        k1: term-frequency saturation.
        b: length normalization (0: none, 1: full), the same for every field.
        max_query_terms: a query counts only its this-many rarest distinct terms.

    Example:
        >>> index = ToolIndex()
        >>> index.upsert(ToolDoc("create_issue", "create_issue", "github", description="Open a new issue"))
        >>> index.upsert(ToolDoc("send_sms", "send_sms", "46elks", description="Send an SMS"))
        >>> index.search("open an issue", 1)[0].key
        'create_issue'
    """

    def __init__(self, weights: FieldWeights | None = None, *, k1: float = 1.2, b: float = 0.75,
                 max_query_terms: int = 64) -> None:
        self.weights = weights or FieldWeights()
        self.k1, self.b = k1, b
        self.max_query_terms = max_query_terms
        self._fields = {name: _Field(self.weights.of(name)) for name in FIELDS}
        self._docs: list[ToolDoc | None] = []  # slot -> doc
        self._slot_of: dict[str, int] = {}
        self._free: list[int] = []
        self._live = np.zeros(0, dtype=bool)
        self._names: dict[str, set[int]] = {}  # normalized name -> slots
        self._trigrams: dict[str, set[str]] = {}  # trigram -> normalized names (typo matching)
        # term -> (slots, BM25F pseudo frequency): depends on average field lengths, so any
        # update clears it; rebuilt per term on first use
        self._combined: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._num_upserts = self._num_removes = self._num_searches = 0

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: str) -> bool:
        return key in self._slot_of

    def get(self, key: str) -> ToolDoc | None:
        slot = self._slot_of.get(key)
        return None if slot is None else self._docs[slot]

    def keys(self) -> list[str]:
        return list(self._slot_of)

    # -- updates -------------------------------------------------------------------------

    def upsert(self, doc: ToolDoc) -> None:
        """Add ``doc``, or replace the document with the same key (only its terms change)."""
        if self.get(doc.key) == doc:
            return
        self.remove(doc.key)
        slot = self._free.pop() if self._free else self._grow()
        self._docs[slot] = doc
        self._slot_of[doc.key] = slot
        self._live[slot] = True
        self._add_name(normalize_name(doc.name), slot)
        self._combined.clear()
        for name, fld in self._fields.items():
            doc_terms = terms(doc.field_text(name))
            fld.lengths[slot] = len(doc_terms)
            fld.total_length += len(doc_terms)
            for term in doc_terms:
                postings = fld.postings.setdefault(term, {})
                postings[slot] = postings.get(slot, 0) + 1
        self._num_upserts += 1

    def remove(self, key: str) -> bool:
        """Drop the document ``key``; False when there is none."""
        slot = self._slot_of.pop(key, None)
        if slot is None:
            return False
        doc = self._docs[slot]
        assert doc is not None  # a mapped slot always holds a document
        for name, fld in self._fields.items():
            for term in set(terms(doc.field_text(name))):
                postings = fld.postings[term]
                del postings[slot]
                if not postings:
                    del fld.postings[term]
            fld.total_length -= fld.lengths[slot]
            fld.lengths[slot] = 0.0
        self._remove_name(normalize_name(doc.name), slot)
        self._combined.clear()
        self._docs[slot] = None
        self._live[slot] = False
        self._free.append(slot)
        self._num_removes += 1
        return True

    def _add_name(self, normalized: str, slot: int) -> None:
        if normalized not in self._names:
            for gram in _trigrams(normalized):
                self._trigrams.setdefault(gram, set()).add(normalized)
        self._names.setdefault(normalized, set()).add(slot)

    def _remove_name(self, normalized: str, slot: int) -> None:
        slots = self._names[normalized]
        slots.discard(slot)
        if slots:
            return
        del self._names[normalized]
        for gram in _trigrams(normalized):
            names = self._trigrams[gram]
            names.discard(normalized)
            if not names:
                del self._trigrams[gram]

    def _grow(self) -> int:
        slot = len(self._docs)
        self._docs.append(None)
        if slot >= len(self._live):
            capacity = max(64, 2 * len(self._live))
            self._live = np.resize(self._live, capacity)
            self._live[slot:] = False
            for fld in self._fields.values():
                fld.lengths = np.concatenate([fld.lengths, np.zeros(capacity - len(fld.lengths))])
        return slot

    def flush(self) -> int:
        """Finish queued work; BM25 has none (the hybrid index encodes queued tools here)."""
        return 0

    # -- search --------------------------------------------------------------------------

    def scores(self, query: str) -> np.ndarray:
        """BM25F score of every slot for ``query`` (0 for empty slots); ``[capacity]``.

        Only the ``max_query_terms`` rarest distinct terms count: a pasted page still
        searches in bounded time, and its rare words are the ones that discriminate.
        """
        num_docs = len(self._slot_of)
        scores = np.zeros(len(self._live))
        if num_docs == 0:
            return scores
        found = [(term, p) for term in dict.fromkeys(terms(query)) if (p := self._postings(term)) is not None]
        found.sort(key=lambda item: len(item[1][0]))
        for _, (slots, pseudo_tf) in found[: self.max_query_terms]:
            doc_freq = len(slots)
            idf = math.log(1.0 + (num_docs - doc_freq + 0.5) / (doc_freq + 0.5))
            scores[slots] += idf * pseudo_tf * (self.k1 + 1) / (self.k1 + pseudo_tf)
        return scores

    def _postings(self, term: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(slots, pseudo frequency) of the documents holding ``term`` in any field."""
        cached = self._combined.get(term)
        if cached is not None:
            return cached
        num_docs = len(self._slot_of)
        pseudo: dict[int, float] = {}
        for fld in self._fields.values():
            postings = fld.postings.get(term)
            if not postings or fld.weight == 0:
                continue
            average = max(fld.total_length / num_docs, 1e-9)
            for slot, tf in postings.items():
                norm = 1.0 - self.b + self.b * fld.lengths[slot] / average
                pseudo[slot] = pseudo.get(slot, 0.0) + fld.weight * tf / norm
        if not pseudo:
            return None
        cached = (np.fromiter(pseudo.keys(), dtype=np.int64, count=len(pseudo)),
                  np.fromiter(pseudo.values(), dtype=float, count=len(pseudo)))
        self._combined[term] = cached
        return cached

    def name_matches(self, query: str) -> tuple[set[int], set[int]]:
        """(exact, near) slots whose tool name the query names."""
        whole = normalize_name(query)
        exact = set(self._names.get(whole, ()))
        for token in _IDENTIFIER.findall(query):
            exact |= self._names.get(normalize_name(token), set())
        near: set[int] = set()
        if not exact and len(query.split()) == 1 and 4 <= len(whole) <= 64:
            grams = _trigrams(whole)
            shared = Counter(name for gram in grams for name in self._trigrams.get(gram, ()))
            candidates = [name for name, count in shared.most_common(_NEAR_CANDIDATES) if count >= len(grams) / 3]
            for match in difflib.get_close_matches(whole, candidates, n=3, cutoff=_NEAR_CUTOFF):
                near |= self._names[match]
        return exact, near

    def search(self, query: str, limit: int, *, allowed: set[str] | None = None) -> list[Hit]:
        """The best ``limit`` documents for ``query``, best first; only positive scores.

        Args:
            query: free text or a tool name.
            limit: at most this many hits.
            allowed: keys to consider (others are skipped); None for all.
        """
        self._num_searches += 1
        return self._select(query, self.scores(query), limit, allowed)

    def _select(self, query: str, scores: np.ndarray, limit: int, allowed: set[str] | None) -> list[Hit]:
        """The best ``limit`` slots of ``scores`` (``[capacity]``, modified) after the name bonuses."""
        exact, near = self.name_matches(query)
        for slot in exact:
            scores[slot] += _EXACT_BONUS
        for slot in near:
            scores[slot] += _NEAR_BONUS
        if allowed is not None:
            mask = np.zeros(len(scores), dtype=bool)
            mask[[self._slot_of[k] for k in allowed if k in self._slot_of]] = True
            scores[~mask] = 0.0
        positive = np.flatnonzero(scores > 0)
        if len(positive) == 0:
            return []
        if len(positive) > limit:  # O(n) selection first; ties at the cut stay in (slot order decides)
            kth = -np.partition(-scores[positive], limit - 1)[limit - 1]
            positive = positive[scores[positive] >= kth]
        top = positive[np.argsort(-scores[positive], kind="stable")[:limit]]
        return [Hit(self._docs[slot].key, float(scores[slot])) for slot in top]  # type: ignore[union-attr]

    def statistics(self) -> IndexStatistics:
        num_terms = len({t for fld in self._fields.values() for t in fld.postings})
        return IndexStatistics(len(self), num_terms, self._num_upserts, self._num_removes, self._num_searches)
