"""Document vectors on disk, so a restarted process embeds nothing it embedded before;
and the uses a catalog learned (:mod:`.usage`), so a restart forgets none.

One SQLite file in WAL mode: several processes may read and write it at once (readers
never wait for a writer; writers wait up to ``timeout_s`` for each other). A vector row
is (model key, sha256 of the text) -> float32 vector, a cache. A use row is (model key,
catalog, query, tool) -> the query's vector: learned state, bounded per catalog and never
evicted for the vectors. Nothing here may break a search. A file that cannot be opened, a full disk or a read-only directory logs one
warning naming the file, and the store turns itself off (the embedder keeps its memory
cache); a corrupt file is moved aside to ``<name>.corrupt-<timestamp>`` and a new one
started.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import NamedTuple, TypeVar

import numpy as np

from loopstack.engine.cache_dir import user_cache_dir

__all__ = ["SCHEMA_VERSION", "VectorStore", "VectorStoreStatistics", "default_path"]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_REFRESH_AFTER_S = 86_400  # a hit rewrites last_used only when it is older: reads stay reads
_SCHEMA = (
    "CREATE TABLE models (id INTEGER PRIMARY KEY, key TEXT NOT NULL UNIQUE, dim INTEGER NOT NULL)",
    """CREATE TABLE vectors (
    model_id INTEGER NOT NULL REFERENCES models (id),
    key BLOB NOT NULL,  -- sha256 of the text, 32 bytes
    vector BLOB NOT NULL,  -- little-endian float32, 4 bytes a dimension
    last_used INTEGER NOT NULL,  -- unix seconds
    PRIMARY KEY (model_id, key)
)""",
    "CREATE INDEX vectors_by_last_used ON vectors (last_used)",
)
# learned uses (learning from use): a table added to any file that lacks it, without a new
# schema version, so a loopstack that predates it still reads the file's vectors
_USES = """CREATE TABLE IF NOT EXISTS uses (
    model_id INTEGER NOT NULL REFERENCES models (id),
    catalog TEXT NOT NULL,  -- the catalog's namespaces, sorted, one per line
    query TEXT NOT NULL,
    tool TEXT NOT NULL,
    vector BLOB NOT NULL,  -- the query's, little-endian float32
    created INTEGER NOT NULL,  -- unix seconds
    PRIMARY KEY (model_id, catalog, query, tool)
)"""
_UPSERT = """INSERT INTO vectors (model_id, key, vector, last_used) VALUES (?, ?, ?, ?)
ON CONFLICT (model_id, key) DO UPDATE SET vector = excluded.vector, last_used = excluded.last_used"""
_EVICT = "DELETE FROM vectors WHERE rowid IN (SELECT rowid FROM vectors ORDER BY last_used, rowid LIMIT ?)"
_CORRUPT = {sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB}
_BUSY = {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED}

T = TypeVar("T")


def default_path(env: Mapping[str, str] = os.environ) -> Path:
    """``$LOOPSTACK_CACHE_DIR/tool_search/vectors.sqlite3``, else the same under
    ``$XDG_CACHE_HOME/loopstack``, else under ``~/.cache/loopstack``."""
    return user_cache_dir(env) / "tool_search" / "vectors.sqlite3"


def _code(error: Exception) -> int | None:
    """SQLite's primary result code of ``error`` (None for errors SQLite did not raise)."""
    code = getattr(error, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


class VectorStoreStatistics(NamedTuple):
    num_entries: int  # rows in the file, every model key
    num_bytes: int  # the file plus its WAL
    num_hits: int  # vectors returned by get_many
    num_misses: int  # keys get_many did not find
    num_puts: int  # vectors written
    num_evicted: int  # rows dropped for max_entries
    is_enabled: bool  # False after a failure: lookups miss and writes are skipped


class _Unusable(Exception):
    """The file is a database, but not one this store may use."""


class VectorStore:
    """Vectors by (model key, text sha256) in one SQLite file, shared by processes.

    Args:
        path: the file; None for :func:`default_path`. Its folders are created.
        max_entries: past this many rows, the least recently used are dropped. A row's
            ``last_used`` is set when it is written and when a hit finds it a day old.
        timeout_s: how long a write waits for another process's write.
        clock: unix seconds (injectable for tests).

    No method raises on a bad file, a full disk, a read-only folder or a lock held too long:
    each logs one warning naming the file, and lookups then miss (a lock: only that call).

    Example::

        store = VectorStore()
        store.put_many(embedder.model_key, [(text_key(text), vector)])
        store.get_many(embedder.model_key, [text_key(text)])  # {key: vector}
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, max_entries: int = 500_000,
                 timeout_s: float = 2.0, clock: Callable[[], float] = time.time) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.path = Path(path).expanduser() if path is not None else default_path()
        self.max_entries, self.timeout_s, self.clock = max_entries, timeout_s, clock
        self._lock = threading.Lock()  # one connection, any thread
        self._db: sqlite3.Connection | None = None
        self._model_ids: dict[str, tuple[int, int]] = {}  # model key -> (id, dim), committed rows only
        self._has_moved_aside = self._has_warned_busy = False
        self._num_hits = self._num_misses = self._num_puts = self._num_evicted = 0
        with self._lock:
            self._open()

    # -- opening, and what happens when the file is not usable -----------------------------

    def _open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None, check_same_thread=False)
        except (OSError, sqlite3.Error) as error:
            self._disable(f"cannot open it ({error})")
            return
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                _prepare(db)
                break
            except sqlite3.Error as error:
                # two processes opening a new file at once: switching it to WAL can answer "locked"
                # without waiting for the busy timeout, so wait here; it is not a reason to turn off
                if _code(error) not in _BUSY or time.monotonic() >= deadline:
                    return self._unusable(db, error)
                time.sleep(0.05)
            except _Unusable as error:
                return self._unusable(db, error)
        self._db = db

    def _unusable(self, db: sqlite3.Connection, error: Exception) -> None:
        db.close()
        if _code(error) in _CORRUPT:
            self._move_aside(error)
        else:
            self._disable(f"cannot use it ({error})")

    def _move_aside(self, error: Exception) -> None:
        """Start a new file in place of a corrupt one; a second corruption turns the store off."""
        self.close()
        if self._has_moved_aside:
            self._disable(f"it is corrupt again ({error})")
            return
        self._has_moved_aside = True
        aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        try:
            self.path.replace(aside)
            for suffix in ("-wal", "-shm"):  # they belong to the old file
                self.path.with_name(self.path.name + suffix).unlink(missing_ok=True)
        except OSError as move_error:
            self._disable(f"it is corrupt ({error}) and cannot be moved aside ({move_error})")
            return
        log.warning("tool_search: the vector cache %s is corrupt (%s); moved it to %s and started a new one",
                    self.path, error, aside)
        self._open()

    def _disable(self, what: str) -> None:
        self.close()
        log.warning("tool_search: the vector cache %s is not used: %s; tool vectors are cached in memory only",
                    self.path, what)

    def run(self, what: str, operation: Callable[[sqlite3.Connection], T], default: T) -> T:
        """``operation`` on the connection, or ``default`` where the store is off or it fails;
        a failure is handled as every read and write's is (``what`` names it in the warning)."""
        with self._lock:
            if self._db is None:
                return default
            try:
                return operation(self._db)
            except Exception as error:  # a cache must not break a search: a failure is a miss
                if self._db.in_transaction:
                    with suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                code = _code(error)
                if code in _CORRUPT:
                    self._move_aside(error)
                elif code in _BUSY:  # another process's write: skip this call, try the next
                    if not self._has_warned_busy:
                        self._has_warned_busy = True
                        log.warning("tool_search: the vector cache %s was locked by another process for more "
                                    "than %.1f s; skipped a %s (warned once)", self.path, self.timeout_s, what)
                else:
                    self._disable(f"a {what} failed ({type(error).__name__}: {error})")
                return default

    # -- reads and writes --------------------------------------------------------------

    def get_many(self, model_key: str, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """The stored vectors of ``keys`` (hex sha256 digests of texts) for ``model_key``;
        keys not stored are left out. Vectors are read-only float32 arrays of the model's
        dimension (a row of another size is a miss)."""
        if not keys:
            return {}
        found, stale = self.run("read", lambda db: self._get(db, model_key, keys), ({}, []))
        self._num_hits += len(found)
        self._num_misses += len(set(keys)) - len(found)
        if stale:
            self.run("last_used update", lambda db: self._touch(db, stale), None)
        return found

    def _get(self, db: sqlite3.Connection, model_key: str, keys: Sequence[str]) -> tuple[dict, list[int]]:
        model = self._model(db, model_key)
        if model is None:
            return {}, []
        model_id, dim = model
        by_digest = {bytes.fromhex(key): key for key in keys}
        digests = list(by_digest)
        found: dict[str, np.ndarray] = {}
        stale: list[int] = []
        old = int(self.clock()) - _REFRESH_AFTER_S
        step = db.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) - 1  # 32,765 here: one query per catalog
        for start in range(0, len(digests), step):
            chunk = digests[start : start + step]
            rows = db.execute(f"SELECT rowid, key, vector, last_used FROM vectors WHERE model_id = ? "
                              f"AND key IN ({','.join('?' * len(chunk))})", (model_id, *chunk))
            for rowid, digest, blob, last_used in rows:
                if len(blob) != 4 * dim:
                    continue
                found[by_digest[digest]] = np.frombuffer(blob, dtype="<f4")
                if last_used < old:
                    stale.append(rowid)
        return found, stale

    def _touch(self, db: sqlite3.Connection, rowids: list[int]) -> None:
        now = int(self.clock())
        step = db.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) - 1
        with _transaction(db):
            for start in range(0, len(rowids), step):
                chunk = rowids[start : start + step]
                db.execute(f"UPDATE vectors SET last_used = ? WHERE rowid IN ({','.join('?' * len(chunk))})",
                           (now, *chunk))

    def put_many(self, model_key: str, items: Iterable[tuple[str, np.ndarray]]) -> None:
        """Store ``(key, vector)`` pairs for ``model_key`` in one transaction, then drop the
        least recently used rows past ``max_entries``. Vectors are 1-d, of one dimension."""
        items = list(items)
        if items:
            self.run("write", lambda db: self._put(db, model_key, items), None)

    def _put(self, db: sqlite3.Connection, model_key: str, items: list[tuple[str, np.ndarray]]) -> None:
        rows = [(bytes.fromhex(key), np.ascontiguousarray(vector, dtype="<f4")) for key, vector in items]
        shapes = {vector.shape for _, vector in rows}
        if len(shapes) != 1 or len(shape := next(iter(shapes))) != 1:
            raise ValueError(f"vectors must be 1-d and of one size, got shapes {sorted(shapes)}")
        now = int(self.clock())
        with _transaction(db):
            model_id = self._model_id(db, model_key, shape[0])
            db.executemany(_UPSERT, [(model_id, digest, vector.tobytes(), now) for digest, vector in rows])
            excess = db.execute("SELECT count(*) FROM vectors").fetchone()[0] - self.max_entries
            if excess > 0:
                db.execute(_EVICT, (excess,))
        self._num_puts += len(rows)
        self._num_evicted += max(excess, 0)

    # -- learned uses (learning from use, see .usage) -------------------------------------

    def add_use(self, model_key: str, catalog: str, query: str, tool: str, vector: np.ndarray, *,
                max_per_catalog: int) -> None:
        """Keep a (query, tool) pair a catalog learned, with the query's vector; a known
        pair is left as it is. Past ``max_per_catalog`` pairs of that catalog and model,
        the oldest go. Unlike the vectors, uses are not evicted for ``max_entries``."""
        row = np.ascontiguousarray(vector, dtype="<f4")
        if row.ndim != 1:
            raise ValueError(f"a use's vector must be 1-d, got shape {row.shape}")

        def write(db: sqlite3.Connection) -> None:
            with _transaction(db):
                model_id = self._model_id(db, model_key, len(row))
                db.execute("INSERT OR IGNORE INTO uses (model_id, catalog, query, tool, vector, created) "
                           "VALUES (?, ?, ?, ?, ?, ?)", (model_id, catalog, query, tool, row.tobytes(),
                                                         int(self.clock())))
                db.execute("DELETE FROM uses WHERE rowid IN (SELECT rowid FROM uses WHERE model_id = ? AND "
                           "catalog = ? ORDER BY created DESC, rowid DESC LIMIT -1 OFFSET ?)",
                           (model_id, catalog, max_per_catalog))

        self.run("use write", write, None)

    def uses(self, model_key: str, catalog: str, limit: int) -> list[tuple[str, str, np.ndarray]]:
        """The newest ``limit`` (query, tool, vector) uses of ``catalog`` for ``model_key``,
        oldest first (the order they were learned in)."""
        def read(db: sqlite3.Connection) -> list[tuple[str, str, np.ndarray]]:
            model = self._model(db, model_key)
            if model is None:
                return []
            rows = db.execute("SELECT query, tool, vector FROM uses WHERE model_id = ? AND catalog = ? "
                              "ORDER BY created DESC, rowid DESC LIMIT ?", (model[0], catalog, limit)).fetchall()
            return [(query, tool, np.frombuffer(blob, dtype="<f4")) for query, tool, blob in reversed(rows)
                    if len(blob) == 4 * model[1]]

        return self.run("use read", read, [])

    def _model_id(self, db: sqlite3.Connection, model_key: str, dim: int) -> int:
        """The id of ``model_key``, added with ``dim`` if new (inside a transaction)."""
        model = self._model(db, model_key)
        if model is None:
            model = (db.execute("INSERT INTO models (key, dim) VALUES (?, ?)", (model_key, dim)).lastrowid, dim)
        if model[1] != dim:
            raise ValueError(f"{dim}-d vectors for model key {model_key!r}, stored as {model[1]}-d")
        return int(model[0])

    def _model(self, db: sqlite3.Connection, model_key: str) -> tuple[int, int] | None:
        model = self._model_ids.get(model_key)
        if model is None:
            model = db.execute("SELECT id, dim FROM models WHERE key = ?", (model_key,)).fetchone()
            if model is not None and not db.in_transaction:  # committed: safe to remember
                self._model_ids[model_key] = model
        return model

    # -- the rest ----------------------------------------------------------------------

    def statistics(self) -> VectorStoreStatistics:
        num_entries = self.run("count", lambda db: db.execute("SELECT count(*) FROM vectors").fetchone()[0], 0)
        num_bytes = 0
        for suffix in ("", "-wal"):
            with suppress(OSError):
                num_bytes += self.path.with_name(self.path.name + suffix).stat().st_size
        return VectorStoreStatistics(num_entries, num_bytes, self._num_hits, self._num_misses, self._num_puts,
                                     self._num_evicted, self._db is not None)

    def close(self) -> None:
        """Close the file; the store then misses and skips writes."""
        if self._db is not None:
            self._db.close()
            self._db = None
        self._model_ids.clear()


@contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    """``BEGIN IMMEDIATE`` .. ``COMMIT``, or ``ROLLBACK`` on an error: the write lock is
    taken up front, so two writers wait (busy timeout) instead of failing half-way."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _prepare(db: sqlite3.Connection) -> None:
    """WAL mode and the schema, created by whichever process comes first."""
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA synchronous = NORMAL")  # a cache: a power cut may lose the last writes, never the file
    if db.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
        with _transaction(db):
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version == 0 and db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                raise _Unusable("a SQLite file with other tables, not a loopstack vector cache")
            if version not in (0, SCHEMA_VERSION):
                raise _Unusable(f"schema version {version}; this loopstack reads {SCHEMA_VERSION}")
            if version == 0:
                for statement in _SCHEMA:
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'uses'").fetchone() is None:
        with _transaction(db):  # a file from before learned uses were kept gains the table
            db.execute(_USES)
