"""Hybrid search: BM25F and MiniLM sentence embeddings, fused per query.

21% of MetaTool's questions share no word with their tool's description, so no term
matcher finds them; a sentence embedding does. Neither signal wins everywhere: BM25 is
better on names and rare identifiers, the embedding on paraphrase. Per query, both score
vectors are min-max normalized over the catalog and mixed, ``(1 - w) * bm25 + w * cosine``
with ``w = dense_weight``; an exact or near tool-name match still ranks first. A tool that
matches no query term and whose similarity is below ``min_similarity`` is not a hit, so a
query about nothing in the catalog still finds nothing.

How the weight, the normalization (against reciprocal-rank fusion and z-scores) and the
chunking were chosen, on every retrieval set at once: docs/techniques/tool-search.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from loopstack.plugins.tool_search.retrieval.dense import DenseVectors
from loopstack.plugins.tool_search.retrieval.index import FieldWeights, Hit, ToolDoc, ToolIndex
from loopstack.plugins.tool_search.retrieval.usage import UsageMemory

if TYPE_CHECKING:
    from loopstack.plugins.tool_search.retrieval.embedder import Embedder

__all__ = ["HybridIndex", "HybridStatistics", "fuse"]


class HybridStatistics(NamedTuple):
    num_docs: int
    num_terms: int
    num_upserts: int
    num_removes: int
    num_searches: int
    num_encoded_chunks: int  # chunk texts handed to the embedder (its cache may have had them)
    num_pending: int  # tools queued for encoding


def _min_max(values: np.ndarray, live: np.ndarray) -> np.ndarray:
    """``values`` scaled to [0, 1] over the ``live`` slots; all 1 when they are all equal
    (one tool, or no query term anywhere: a constant that changes no ranking)."""
    low, high = float(values[live].min()), float(values[live].max())
    if high <= low:
        return np.ones(len(values))
    return (values - low) / (high - low)


def fuse(lexical: np.ndarray, similarity: np.ndarray, live: np.ndarray, *, dense_weight: float,
         min_similarity: float) -> np.ndarray:
    """Hybrid scores, ``[capacity]``: 0 for empty slots and for tools with neither a query
    term nor a similarity of ``min_similarity``.

    Args:
        lexical: BM25F scores, ``[capacity]``.
        similarity: cosine similarities, ``[capacity]``.
        live: which slots hold a tool, ``[capacity]``.
        dense_weight: the share of the normalized similarity in the mix.
        min_similarity: a tool without a query term needs at least this cosine.
    """
    if not live.any():
        return np.zeros(len(lexical))
    fused = (1.0 - dense_weight) * _min_max(lexical, live) + dense_weight * _min_max(similarity, live)
    eligible = live & ((lexical > 0) | (similarity >= min_similarity))
    return np.where(eligible, fused, 0.0)


class HybridIndex(ToolIndex):
    """A :class:`ToolIndex` whose search also ranks by sentence-embedding similarity.

    Updates stay incremental: :meth:`upsert` and :meth:`remove` change BM25's postings at
    once and queue the tool's chunks; :meth:`flush` (or the next search) encodes what is
    queued in one batched pass, taking unchanged texts from the embedder's cache.

    Args:
        embedder: the sentence encoder (see :func:`.embedder.load_embedder`).
        weights, k1, b, max_query_terms: as :class:`ToolIndex`.
        dense_weight: share of the embedding in the fused score (0: BM25 order, 1: embedding order).
        min_similarity: a tool that matches no query term is a hit only from this cosine up.
        chunk_words: words per embedded chunk of a tool's text.
        usage_weight: weight of :attr:`usage` (remembered queries that led to a call of
            the tool) added to the fused score; 0 ignores it.
    """

    def __init__(self, embedder: Embedder, weights: FieldWeights | None = None, *, k1: float = 1.2,
                 b: float = 0.75, max_query_terms: int = 64, dense_weight: float = 0.7,
                 min_similarity: float = 0.15, chunk_words: int = 64, usage_weight: float = 0.0) -> None:
        super().__init__(weights, k1=k1, b=b, max_query_terms=max_query_terms)
        self.dense = DenseVectors(embedder, chunk_words=chunk_words)
        self.dense_weight = dense_weight
        self.min_similarity = min_similarity
        self.usage_weight = usage_weight
        self.usage = UsageMemory(embedder.dim)

    @property
    def embedder(self) -> Embedder:
        return self.dense.embedder

    def upsert(self, doc: ToolDoc) -> None:
        if self.get(doc.key) == doc:
            return
        super().upsert(doc)  # removes the old version through self.remove
        self.dense.set(self._slot_of[doc.key], doc)

    def remove(self, key: str) -> bool:
        slot = self._slot_of.get(key)
        if not super().remove(key):
            return False
        assert slot is not None  # a removed key had a slot
        self.dense.clear(slot)
        return True

    def flush(self) -> int:
        """Encode the queued tools; returns how many chunk texts were looked up or encoded."""
        return self.dense.flush()

    def search(self, query: str, limit: int, *, allowed: set[str] | None = None,
               query_vector: np.ndarray | None = None) -> list[Hit]:
        """As :meth:`ToolIndex.search`, ranked by the fused score.

        Args:
            query_vector: the query's embedding when the caller has it already (batched
                evaluation); None encodes ``query``.
        """
        self._num_searches += 1
        self.flush()
        if len(self) == 0:
            return []
        vector = self.embedder.embed_query(query) if query_vector is None else query_vector
        similarity = self.dense.similarities(vector, len(self._live), len(self._docs))  # [capacity]
        scores = fuse(self.scores(query), similarity, self._live, dense_weight=self.dense_weight,
                      min_similarity=self.min_similarity)
        if self.usage_weight > 0 and len(self.usage):
            used = self.usage.similarities(vector, self._slot_of, len(scores), self._num_upserts + self._num_removes)
            scores = np.where(self._live, scores + self.usage_weight * used, 0.0)
        return self._select(query, scores, limit, allowed)

    def remember(self, query: str, key: str) -> bool:
        """Remember that a search for ``query`` led to a call of tool ``key`` (see
        :mod:`.usage`); False when the tool is not in the index or the pair is known."""
        if key not in self:
            return False
        return self.usage.add(query, self.embedder.embed_query(query), key)

    def statistics(self) -> HybridStatistics:
        base = super().statistics()
        return HybridStatistics(*base, self.dense.num_flushed_chunks, self.dense.num_pending)
