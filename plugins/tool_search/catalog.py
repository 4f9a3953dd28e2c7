"""The deferred tools of a stack, indexed once and kept in step with their servers.

A :class:`CatalogIndex` is shared by every session whose deferred tools come from the same
namespaces. Each request hands it the current :class:`ToolInfo` list; unchanged tools (the
same objects, or equal ones) cost an identity check, and only tools that an MCP server
added, changed or dropped touch the index (and, for the hybrid retriever, get embedded).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from loopstack.plugins.tool_search.docs import doc_from_info
from loopstack.plugins.tool_search.namespaces import search_tool_description
from loopstack.plugins.tool_search.retrieval.hybrid import HybridIndex
from loopstack.plugins.tool_search.retrieval.index import FieldWeights, Hit, ToolIndex
from loopstack.tools import ToolInfo

if TYPE_CHECKING:
    from loopstack.plugins.tool_search.retrieval.embedder import Embedder
    from loopstack.plugins.tool_search.retrieval.vector_store import VectorStore

__all__ = ["CatalogCache", "CatalogIndex", "SyncResult"]


class SyncResult(NamedTuple):
    num_added: int
    num_changed: int
    num_removed: int
    seconds: float  # embedding the added and changed tools included


class CatalogIndex:
    """A :class:`ToolIndex` over a changing list of tools, plus the search tool's description.

    Args:
        weights, k1, b: BM25F settings.
        max_hinted_namespaces: see :func:`.namespaces.namespace_lines`.
        embedder: makes the index a :class:`HybridIndex`; None for BM25 alone.
        dense_weight, min_similarity, usage_weight: the hybrid's fusion settings.
        name: the catalog's identity in the embedder's disk store, where its learned uses
            are kept (hybrid, ``usage_weight`` above 0): its first sync loads what earlier
            processes learned. None keeps them in memory only.
    """

    def __init__(self, weights: FieldWeights | None = None, *, k1: float = 1.2, b: float = 0.75,
                 max_hinted_namespaces: int = 32, embedder: Embedder | None = None,
                 dense_weight: float = 0.7, min_similarity: float = 0.15, usage_weight: float = 0.0,
                 name: str | None = None) -> None:
        self.index: ToolIndex = (
            ToolIndex(weights, k1=k1, b=b) if embedder is None
            else HybridIndex(embedder, weights, k1=k1, b=b, dense_weight=dense_weight, min_similarity=min_similarity,
                             usage_weight=usage_weight)
        )
        self.max_hinted_namespaces = max_hinted_namespaces
        self.name = name
        self.num_restored_uses = 0
        self.infos: dict[str, ToolInfo] = {}
        self.num_syncs = 0
        self.is_built = False  # synced at least once: later syncs touch only what changed
        self.version = 0  # bumped by every sync that changes the tools
        self._description: tuple[tuple[ToolInfo, ...], str] | None = None
        # the list of the last sync, held so the ids stay its objects': the same objects
        # again (every request of a conversation) are one comparison in C, not a loop
        self._last: tuple[list[ToolInfo], tuple[int, ...]] = ([], ())
        # sessions share a catalog and search from a worker thread (:mod:`.worker`) or inline
        self.lock = threading.RLock()

    @property
    def retriever(self) -> str:
        return "hybrid" if isinstance(self.index, HybridIndex) else "bm25"

    def sync(self, infos: Sequence[ToolInfo]) -> SyncResult:
        """Make the index hold exactly ``infos`` (keyed by name), touching only what changed;
        new and changed tools are embedded before it returns (hybrid)."""
        with self.lock:
            return self._sync(infos)

    def _sync(self, infos: Sequence[ToolInfo]) -> SyncResult:
        started = time.perf_counter()
        ids = tuple(map(id, infos))
        if self.is_built and ids == self._last[1]:
            return SyncResult(0, 0, 0, time.perf_counter() - started)
        if not self.is_built:
            self._restore_uses()
        current = {info.name: info for info in infos}
        added = changed = 0
        for name, info in current.items():
            old = self.infos.get(name)
            if old is info or old == info:
                continue
            self.index.upsert(doc_from_info(info))
            added, changed = (added + 1, changed) if old is None else (added, changed + 1)
        removed = [name for name in self.infos if name not in current]
        for name in removed:
            self.index.remove(name)
        self.index.flush()
        self.infos = current
        self._last = (list(infos), ids)
        if added or changed or removed:
            self.num_syncs += 1
            self.version += 1
        self.is_built = True
        return SyncResult(added, changed, len(removed), time.perf_counter() - started)

    def search(self, query: str, limit: int) -> list[Hit]:
        with self.lock:
            return self.index.search(query, limit)

    def embed_query(self, query: str) -> bool:
        """Embed ``query`` into the embedder's query cache ahead of its search (hybrid; the
        catalog itself is not touched, so no lock). False for BM25."""
        if not isinstance(self.index, HybridIndex):
            return False
        self.index.embedder.embed_query(query)
        return True

    def remember(self, query: str, name: str) -> bool:
        """A search for ``query`` led to a successful call of tool ``name``: remember it
        (hybrid only; see :mod:`.usage`), on disk too where the catalog has a ``name`` and
        the embedder a store. False when nothing new was remembered."""
        with self.lock:
            if not isinstance(self.index, HybridIndex) or not self.index.remember(query, name):
                return False
            store, embedder = self._use_store(), self.index.embedder
            if store is not None and self.name is not None:  # (a store implies a name)
                store.add_use(embedder.model_key, self.name, query, name, embedder.embed_query(query),
                              max_per_catalog=self.index.usage.max_entries)
            return True

    def _use_store(self) -> VectorStore | None:
        """Where learned uses are kept: the embedder's disk store, for a named hybrid
        catalog that learns."""
        if not isinstance(self.index, HybridIndex) or self.index.usage_weight <= 0 or self.name is None:
            return None
        return self.index.embedder.store

    def _restore_uses(self) -> None:
        """The uses earlier processes learned for this catalog, oldest first (first sync)."""
        store = self._use_store()
        if store is None or self.name is None or not isinstance(self.index, HybridIndex):
            return  # (a store implies the other two; the checks narrow the types)
        embedder, usage = self.index.embedder, self.index.usage
        for query, tool, vector in store.uses(embedder.model_key, self.name, usage.max_entries):
            if vector.shape == (usage.dim,):
                self.num_restored_uses += usage.add(query, vector, tool)

    def description(self, infos: Sequence[ToolInfo]) -> str:
        """``tool_search``'s description for ``infos``, recomputed only when they change
        (it is sent every turn and must be byte-identical while the tools are)."""
        key = tuple(infos)
        cached = self._description
        if cached is None or len(cached[0]) != len(key) or any(a is not b and a != b for a, b in zip(cached[0], key)):
            self._description = (key, search_tool_description(infos, max_hinted=self.max_hinted_namespaces))
        assert self._description is not None
        return self._description[1]


class CatalogCache:
    """Least-recently-used :class:`CatalogIndex` per set of namespaces (one per agent setup).

    Args:
        max_entries: catalogs kept.
        embedder: called when a catalog is made; its embedder makes the catalog hybrid,
            None keeps it BM25 (the model loads on the first catalog, not at start-up).
        options: passed to :class:`CatalogIndex`.
    """

    def __init__(self, *, max_entries: int = 8, embedder: Callable[[], Embedder | None] | None = None,
                 **options: object) -> None:
        self._entries: OrderedDict[frozenset[str], CatalogIndex] = OrderedDict()
        self._options = options
        self._embedder = embedder
        self.max_entries = max_entries

    def get(self, infos: Sequence[ToolInfo]) -> CatalogIndex:
        key = frozenset(info.namespace for info in infos)
        catalog = self._entries.get(key)
        if catalog is None:
            embedder = self._embedder() if self._embedder is not None else None
            name = "\n".join(sorted(namespace or "" for namespace in key))  # its learned uses, on disk
            catalog = CatalogIndex(embedder=embedder, name=name, **self._options)  # type: ignore[arg-type]
            self._entries[key] = catalog
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        return catalog

    def __len__(self) -> int:
        return len(self._entries)

    def catalogs(self) -> list[CatalogIndex]:
        """The catalogs kept, least recently used first."""
        return list(self._entries.values())
