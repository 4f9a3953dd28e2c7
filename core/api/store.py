"""Stored responses (``store=true``) in SQLite, so a restart loses no conversation.

One connection in WAL mode, guarded by a lock, serves the event-loop thread and worker threads alike.
Every `ResponseStore.put` is its own transaction, committed with ``synchronous=FULL``: the WAL is
fsynced before `put` returns, so neither a killed process nor a power cut loses an acknowledged
response. The cost, one fsync per model call, is small next to the model call itself; NORMAL would
survive a killed process but could drop the last commits on power loss.

Rows are visible only to their own tenant and only until they expire; a row that is missing, expired
or owned by another tenant reads the same (``None`` / `ResponseNotFoundError`), never saying which.

Schema versions: 1 had a ``prompt_token_ids`` column that nothing wrote; opening a version-1 file
drops it (SQLite 3.35+; an older SQLite leaves the unused column in place) and marks the file 2.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Self

__all__ = [
    "SCHEMA_VERSION", "ChainCycleError", "ChainTooLongError", "ResponseNotFoundError", "ResponseStore",
    "SchemaVersionError", "StoreError", "StoreStatistics", "StoredResponse",
]  # fmt: skip

SCHEMA_VERSION = 2

_SCHEMA = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE responses (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_at REAL NOT NULL,
    model TEXT NOT NULL,
    previous_response_id TEXT,
    input_items TEXT NOT NULL,
    output_items TEXT NOT NULL,
    request TEXT NOT NULL,
    response TEXT NOT NULL
)""",
    "CREATE INDEX responses_by_created_at ON responses (created_at)",
)
_COLUMNS = "id, tenant, created_at, model, previous_response_id, input_items, output_items, request, response"
# A put never takes over another tenant's id: the update only applies when the tenant matches.
_UPSERT = f"""
INSERT INTO responses ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (id) DO UPDATE SET
    created_at = excluded.created_at, model = excluded.model,
    previous_response_id = excluded.previous_response_id, input_items = excluded.input_items,
    output_items = excluded.output_items, request = excluded.request, response = excluded.response
WHERE responses.tenant = excluded.tenant
"""
_SELECT_VISIBLE = f"SELECT {_COLUMNS} FROM responses WHERE id = ? AND tenant = ? AND created_at > ?"


class StoreError(Exception):
    """Base of every error the response store raises."""


class ResponseNotFoundError(StoreError, KeyError):
    """A response is missing, expired, or belongs to another tenant (deliberately indistinguishable)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(f"response {response_id!r} not found")
        self.response_id = response_id

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class ChainCycleError(StoreError):
    """Following ``previous_response_id`` links came back to a response already in the chain."""


class ChainTooLongError(StoreError):
    """A chain has more links than the ``max_depth`` the caller allowed."""


class SchemaVersionError(StoreError):
    """The store file was written by a newer (or foreign) schema than this loopstack understands."""


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: what the request added, what the model answered, and the request's settings.

    ``input_items`` are only the new input items of that request (earlier ones live in the responses
    that ``previous_response_id`` points at); ``request`` holds its non-input fields (instructions,
    tools, tool_choice, sampling, text format, metadata...); ``response`` is the full Responses API
    object as returned.
    """

    id: str
    tenant: str
    created_at: float
    model: str
    previous_response_id: str | None
    input_items: list[dict[str, Any]]
    output_items: list[dict[str, Any]]
    request: dict[str, Any]
    response: dict[str, Any]


class StoreStatistics(NamedTuple):
    """Counters of a `ResponseStore`; ``num_bytes`` is the database plus its WAL on disk."""

    num_responses: int
    num_bytes: int
    num_puts: int
    num_expired: int


class ResponseStore:
    """Stored responses in one SQLite file (WAL), created with its parent folders if missing.

    Args:
        path: the SQLite file (``":memory:"`` for a throwaway store).
        ttl_s: a response expires this many seconds after its ``created_at``.
        clock: returns the current time in seconds (injectable for tests).
        expire_every: `expire` runs after every this many puts; ``None`` leaves expiry to the caller.
        timeout_s: how long to wait for another process holding the write lock.

    Raises:
        StoreError: the file is not a SQLite database or cannot be opened.
        SchemaVersionError: the file has a schema version this code does not know.

    Example::

        with ResponseStore(".loopstack/responses.sqlite3", ttl_s=30 * 86400) as store:
            store.put(record)
            store.chain(record.id, tenant=record.tenant)
    """

    def __init__(
        self,
        path: str | Path,
        *,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
        expire_every: int | None = 1000,
        timeout_s: float = 10.0,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.path = path if str(path) == ":memory:" else Path(path)
        self.ttl_s = float(ttl_s)
        self._clock = clock
        self._expire_every = expire_every
        self._lock = threading.Lock()
        self._num_puts = 0
        self._num_expired = 0
        if isinstance(self.path, Path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn: sqlite3.Connection | None = sqlite3.connect(
                str(self.path), timeout=timeout_s, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as error:
            raise StoreError(f"cannot open response store {str(path)!r}: {error}") from error
        try:
            self._open_schema()
        except BaseException:
            self._conn.close()
            self._conn = None
            raise
        self.expire()

    # -- public API ------------------------------------------------------------------------------

    def put(self, record: StoredResponse) -> None:
        """Insert ``record``, or replace the row with its id; durable once this returns.

        Raises:
            StoreError: a field is not JSON-serializable, or the id already belongs to another tenant.
        """
        row = _encode(record)
        with self._connection() as conn:
            if conn.execute(_UPSERT, row).rowcount != 1:
                raise StoreError(f"response id {record.id!r} is already taken")
            self._num_puts += 1
            if self._expire_every and self._num_puts % self._expire_every == 0:
                self._expire_locked(conn, self._clock())

    def get(self, response_id: str, *, tenant: str) -> StoredResponse | None:
        """The response, or ``None`` when it is missing, expired, or created by another tenant."""
        with self._connection() as conn:
            return self._get_locked(conn, response_id, tenant)

    def all_present(self, response_ids: list[str], *, tenant: str) -> bool:
        """Whether every one of ``response_ids`` is visible to ``tenant`` (none missing,
        expired or another tenant's): one query, for checking a cached chain's links."""
        unique = sorted(set(response_ids))
        if not unique:
            return True
        with self._connection() as conn:
            found = 0
            for start in range(0, len(unique), 500):  # SQLite's bound-parameter limit
                batch = unique[start : start + 500]
                marks = ",".join("?" * len(batch))
                (count,) = conn.execute(
                    f"SELECT COUNT(*) FROM responses WHERE id IN ({marks}) AND tenant = ? AND created_at > ?",
                    (*batch, tenant, self._cutoff()),
                ).fetchone()
                found += count
        return found == len(unique)

    def delete(self, response_id: str, *, tenant: str) -> bool:
        """Delete a visible response; ``False`` when there was none for this tenant (or it expired)."""
        with self._connection() as conn:
            cursor = conn.execute(
                "DELETE FROM responses WHERE id = ? AND tenant = ? AND created_at > ?",
                (response_id, tenant, self._cutoff()),
            )
            return cursor.rowcount > 0

    def chain(self, response_id: str, *, tenant: str, max_depth: int = 10_000) -> list[StoredResponse]:
        """The conversation ending at ``response_id``, oldest first, following ``previous_response_id``.

        Raises:
            ResponseNotFoundError: some link is missing, expired or another tenant's; names that id.
            ChainCycleError: the links loop.
            ChainTooLongError: more than ``max_depth`` links.
        """
        records: list[StoredResponse] = []
        seen: set[str] = set()
        with self._connection() as conn:
            current: str | None = response_id
            while current is not None:
                if current in seen:
                    raise ChainCycleError(f"response chain of {response_id!r} loops back to {current!r}")
                if len(records) >= max_depth:
                    raise ChainTooLongError(f"response chain of {response_id!r} is longer than {max_depth}")
                record = self._get_locked(conn, current, tenant)
                if record is None:
                    raise ResponseNotFoundError(current)
                seen.add(current)
                records.append(record)
                current = record.previous_response_id
        records.reverse()
        return records

    def expire(self, now: float | None = None) -> int:
        """Delete every response older than ``ttl_s`` at ``now`` (default: the clock); returns how many."""
        with self._connection() as conn:
            return self._expire_locked(conn, self._clock() if now is None else now)

    def statistics(self) -> StoreStatistics:
        """Rows stored (expired ones not yet deleted included), bytes on disk, puts and expiries so far."""
        with self._connection() as conn:
            (num_responses,) = conn.execute("SELECT count(*) FROM responses").fetchone()
            if isinstance(self.path, Path):
                files = (self.path, self.path.with_name(self.path.name + "-wal"))
                num_bytes = sum(file.stat().st_size for file in files if file.exists())
            else:
                (num_pages,) = conn.execute("PRAGMA page_count").fetchone()
                (page_size,) = conn.execute("PRAGMA page_size").fetchone()
                num_bytes = num_pages * page_size
            return StoreStatistics(num_responses, num_bytes, self._num_puts, self._num_expired)

    def close(self) -> None:
        """Close the connection (idempotent); later calls raise `StoreError`."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._conn is None:
                raise StoreError("the response store is closed")
            try:
                yield self._conn
            except sqlite3.Error as error:
                raise StoreError(f"response store {str(self.path)!r}: {error}") from error

    def _open_schema(self) -> None:
        assert self._conn is not None
        conn = self._conn
        try:
            conn.execute("PRAGMA journal_mode = WAL").fetchone()
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("BEGIN IMMEDIATE")  # two processes opening a fresh file must not both create it
            try:
                version = _read_version(conn, self.path)
                if version is None:
                    for statement in _SCHEMA:
                        conn.execute(statement)
                    conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                elif version == 1:
                    _migrate_from_1(conn)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.DatabaseError as error:
            raise StoreError(f"{str(self.path)!r} is not a usable response store: {error}") from error

    def _get_locked(self, conn: sqlite3.Connection, response_id: str, tenant: str) -> StoredResponse | None:
        row = conn.execute(_SELECT_VISIBLE, (response_id, tenant, self._cutoff())).fetchone()
        return None if row is None else _decode(row)

    def _expire_locked(self, conn: sqlite3.Connection, now: float) -> int:
        num_expired = conn.execute("DELETE FROM responses WHERE created_at <= ?", (now - self.ttl_s,)).rowcount
        self._num_expired += num_expired
        return num_expired

    def _cutoff(self) -> float:
        return self._clock() - self.ttl_s


def _migrate_from_1(conn: sqlite3.Connection) -> None:
    """Version 1 -> 2: drop the ``prompt_token_ids`` column nothing wrote (inside the caller's
    transaction, so two processes opening the file at once migrate it once)."""
    try:
        conn.execute("ALTER TABLE responses DROP COLUMN prompt_token_ids")
    except sqlite3.OperationalError:  # SQLite before 3.35: the unused, nullable column stays
        pass
    conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))


def _read_version(conn: sqlite3.Connection, path: object) -> int | None:
    """The file's schema version; ``None`` for an empty file. Raises for foreign or newer files."""
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "meta" not in tables:
        if tables:
            raise SchemaVersionError(f"{str(path)!r} is a SQLite file but not a loopstack response store")
        return None
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    version = int(row[0]) if row is not None and str(row[0]).isdigit() else -1
    if version not in (1, SCHEMA_VERSION):
        raise SchemaVersionError(
            f"response store {str(path)!r} has schema version {row[0] if row else 'none'}; this loopstack "
            f"reads version {SCHEMA_VERSION}: upgrade loopstack or point [api] store_path at another file"
        )
    return version


def _dumps(value: object, field: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as error:
        raise StoreError(f"field {field!r} is not JSON-serializable: {error}") from error


def _encode(record: StoredResponse) -> tuple[object, ...]:
    json_columns = ("input_items", "output_items", "request", "response")
    return (
        *(record.id, record.tenant, float(record.created_at), record.model, record.previous_response_id),
        *(_dumps(getattr(record, name), name) for name in json_columns),
    )


def _decode(row: tuple[Any, ...]) -> StoredResponse:
    id_, tenant, created_at, model, previous_response_id, *json_texts = row
    input_items, output_items, request, response = (json.loads(text) for text in json_texts)
    return StoredResponse(
        id_, tenant, created_at, model, previous_response_id, input_items, output_items, request, response,
    )  # fmt: skip
