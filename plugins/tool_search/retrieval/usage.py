"""Learning from use: queries whose search led to a call of the tool, remembered per catalog.

A search that loads a tool the model then calls (without an error) is evidence that the
query meant that tool. :class:`UsageMemory` keeps the embeddings of such queries with the
tool called; a later search adds, for each tool, its best similarity to a remembered
query of that tool (from ``floor`` up) to the hybrid score. So a phrasing that the tool's
own text does not match ranks it once a conversation has used it for a like request.

The memory is a ring of ``max_entries`` rows (the oldest is overwritten first) that lives
with the catalog index in the process. The catalog also writes each new pair to the
embedder's disk store and reads them back at its first sync (:meth:`.catalog.CatalogIndex.remember`),
so a restart forgets nothing where that file is usable. Adding a pair
writes one row; a search reads the rows in one matrix product. Measured on the retrieval
sets, with half of each set's questions as remembered uses: docs/techniques/tool-search.md.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["UsageMemory"]

_NO_SLOT = -1


class UsageMemory:
    """(query vector, tool) pairs of searches that led to a call; thread-safe.

    Args:
        dim: the embedding's width.
        max_entries: pairs kept; a new pair overwrites the oldest.
        floor: a remembered query counts for a tool from this cosine up (below it, a
            query is not like the remembered one, and an unrelated query must still find
            nothing).
    """

    def __init__(self, dim: int, *, max_entries: int = 10_000, floor: float = 0.5) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.dim, self.max_entries, self.floor = dim, max_entries, floor
        self._vectors = np.zeros((0, dim), dtype=np.float32)  # [rows, dim], grown up to max_entries
        self._pairs: list[tuple[str, str]] = []  # row -> (query, tool)
        self._row_of: dict[tuple[str, str], int] = {}
        self._next = 0  # the row the next new pair takes once the ring is full
        self._owners = np.zeros(0, dtype=np.int64)  # row -> slot of its tool in the index
        self._owners_version: int | None = None  # the index's slots version _owners was read for
        self._stale_rows: set[int] = set()  # rows written since: their slot is unknown
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pairs)

    def pairs(self) -> list[tuple[str, str]]:
        """The remembered (query, tool) pairs, in row order."""
        with self._lock:
            return list(self._pairs)

    def add(self, query: str, vector: np.ndarray, tool: str) -> bool:
        """Remember that ``query`` (embedded as ``vector``) led to a call of ``tool``;
        False when that pair is remembered already."""
        if vector.shape != (self.dim,):
            raise ValueError(f"vector must have shape ({self.dim},), got {vector.shape}")
        with self._lock:
            pair = (query, tool)
            if pair in self._row_of:
                return False
            if len(self._pairs) < self.max_entries:
                row = len(self._pairs)
                self._pairs.append(pair)
                if row >= len(self._vectors):  # grow by doubling, not per pair
                    size = min(self.max_entries, max(64, 2 * len(self._vectors)))
                    self._vectors = np.concatenate([self._vectors, np.zeros((size - len(self._vectors), self.dim),
                                                                            dtype=np.float32)])
                    self._owners = np.concatenate([self._owners, np.full(size - len(self._owners), _NO_SLOT)])
            else:  # full: overwrite the oldest
                row = self._next
                self._next = (row + 1) % self.max_entries
                del self._row_of[self._pairs[row]]
                self._pairs[row] = pair
            self._row_of[pair] = row
            self._vectors[row] = vector
            self._stale_rows.add(row)
            return True

    def similarities(self, query_vector: np.ndarray, slot_of: dict[str, int], size: int,
                     slots_version: int) -> np.ndarray:
        """Per slot, the best cosine of ``query_vector`` to a remembered query of that
        slot's tool, 0 below :attr:`floor` or without one; ``[size]``.

        ``slots_version`` changes whenever ``slot_of`` does: the row -> slot column is
        rebuilt only then; rows added since the last search are looked up alone.
        """
        import torch  # loaded already: the embedder runs on it

        out = np.zeros(size, dtype=np.float32)
        with self._lock:
            num = len(self._pairs)
            if num == 0:
                return out
            if self._owners_version != slots_version:
                self._stale_rows = set(range(num))
                self._owners_version = slots_version
            for row in self._stale_rows:
                self._owners[row] = slot_of.get(self._pairs[row][1], _NO_SLOT)
            self._stale_rows.clear()
            owners = self._owners[:num].copy()
            vectors = self._vectors[:num]
            # through torch, like the tools' similarities (numpy's BLAS pool would fight torch's)
            cosines = (torch.from_numpy(vectors) @ torch.from_numpy(query_vector)).numpy()  # [num]
        keep = (owners >= 0) & (owners < size) & (cosines >= self.floor)
        np.maximum.at(out, owners[keep], cosines[keep])
        return out
