"""Retrieval quality: capped recall@k and binary nDCG@k of an index over a query set."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from loopstack.plugins.tool_search.bench.datasets import Query, RetrievalSet
from loopstack.plugins.tool_search.retrieval.hybrid import HybridIndex
from loopstack.plugins.tool_search.retrieval.index import FIELDS, FieldWeights, ToolIndex
from loopstack.plugins.tool_search.retrieval.terms import terms

if TYPE_CHECKING:
    from loopstack.plugins.tool_search.retrieval.embedder import Embedder

__all__ = ["RetrievalScores", "build_index", "evaluate", "evaluate_learned", "lexical_overlap", "ndcg_at",
           "recall_at"]


class RetrievalScores(NamedTuple):
    recall_at_1: float
    recall_at_5: float
    ndcg_at_10: float
    num_queries: int
    num_tools: int


def recall_at(ranked: Sequence[str], gold: frozenset[str], k: int) -> float:
    """Share of the gold tools in the top ``k``, out of ``min(k, len(gold))`` (capped recall:
    a two-tool query scores 1.0 at k=1 when its one slot holds a gold tool)."""
    return len(gold.intersection(ranked[:k])) / min(k, len(gold))


def ndcg_at(ranked: Sequence[str], gold: frozenset[str], k: int) -> float:
    """Binary-relevance nDCG@k."""
    dcg = sum(1.0 / math.log2(rank + 2) for rank, key in enumerate(ranked[:k]) if key in gold)
    ideal = sum(1.0 / math.log2(rank + 2) for rank in range(min(k, len(gold))))
    return dcg / ideal


def build_index(dataset: RetrievalSet, weights: FieldWeights | None = None, *, k1: float = 1.2,
                b: float = 0.75, embedder: Embedder | None = None, dense_weight: float = 0.7,
                min_similarity: float = 0.15, usage_weight: float = 0.0) -> ToolIndex:
    """The index of ``dataset``'s tools: BM25, or hybrid when ``embedder`` is given."""
    index = (ToolIndex(weights, k1=k1, b=b) if embedder is None else
             HybridIndex(embedder, weights, k1=k1, b=b, dense_weight=dense_weight, min_similarity=min_similarity,
                         usage_weight=usage_weight))
    for doc in dataset.docs:
        index.upsert(doc)
    index.flush()
    return index


def evaluate(index: ToolIndex, queries: Sequence[Query],
             progress: Callable[[Sequence[Query]], Sequence[Query]] = lambda q: q) -> RetrievalScores:
    """Mean recall@1, recall@5 and nDCG@10 of ``index`` over ``queries``.

    A hybrid index gets its query vectors in batches first (the same vectors one search
    at a time would compute, many times faster).
    """
    vectors = None
    if isinstance(index, HybridIndex):
        vectors = index.embedder.embed_queries([query.text for query in queries])
    r1 = r5 = n10 = 0.0
    for i, query in enumerate(progress(queries)):
        if vectors is None:
            hits = index.search(query.text, 10)
        else:
            assert isinstance(index, HybridIndex)
            hits = index.search(query.text, 10, query_vector=vectors[i])
        ranked = [hit.key for hit in hits]
        r1 += recall_at(ranked, query.gold, 1)
        r5 += recall_at(ranked, query.gold, 5)
        n10 += ndcg_at(ranked, query.gold, 10)
    n = max(len(queries), 1)
    return RetrievalScores(r1 / n, r5 / n, n10 / n, len(queries), len(index))


def evaluate_learned(index: HybridIndex, queries: Sequence[Query], *, seed: int = 0,
                     progress: Callable[[Sequence[Query]], Sequence[Query]] = lambda q: q,
                     ) -> tuple[RetrievalScores, RetrievalScores]:
    """Learning from use (:mod:`.usage`) on a retrieval set: ``(without, with)`` scores on
    the same held-out half of ``queries``.

    The queries are shuffled (``seed``) and halved. The first half goes into the index's
    usage memory as if each search had led to a call of its gold tools (perfect feedback:
    an upper bound on what noisy real use teaches); the second half is searched before
    and after. The index's memory is filled by this call.
    """
    shuffled = list(queries)
    random.Random(seed).shuffle(shuffled)
    remembered, held_out = shuffled[: len(shuffled) // 2], shuffled[len(shuffled) // 2 :]
    weight, index.usage_weight = index.usage_weight, 0.0
    try:
        without = evaluate(index, held_out, progress)
    finally:
        index.usage_weight = weight
    vectors = index.embedder.embed_queries([query.text for query in remembered])
    for query, vector in zip(remembered, vectors):
        for key in sorted(query.gold):
            index.usage.add(query.text, vector, key)
    return without, evaluate(index, held_out, progress)


def lexical_overlap(dataset: RetrievalSet) -> float:
    """Share of queries that share at least one search term with one of their gold tools'
    texts: an upper bound on recall@k of any retriever that matches terms, BM25 included."""
    texts = {doc.key: set(terms(" ".join(doc.field_text(f) for f in FIELDS))) for doc in dataset.docs}
    hits = sum(1 for q in dataset.queries if any(texts[key] & set(terms(q.text)) for key in q.gold))
    return hits / max(len(dataset.queries), 1)
