"""ResponseStore: round trips, tenant isolation, chains, expiry, durability across processes, threads."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from loopstack.api.store import (
    SCHEMA_VERSION,
    ChainCycleError,
    ChainTooLongError,
    ResponseNotFoundError,
    ResponseStore,
    SchemaVersionError,
    StoredResponse,
    StoreError,
)

NOW = 1_000_000.0
TTL_S = 3600.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def record(response_id: str, *, tenant: str = "acme", previous: str | None = None, at: float = NOW) -> StoredResponse:
    return StoredResponse(
        id=response_id,
        tenant=tenant,
        created_at=at,
        model="smollm2-135m-instruct",
        previous_response_id=previous,
        input_items=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "héllo"}]}],
        output_items=[{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}],
        request={"instructions": "be brief", "tools": [], "temperature": 0.0, "metadata": {"k": "v"}},
        response={"id": response_id, "object": "response", "status": "completed", "usage": {"total_tokens": 7}},
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[ResponseStore]:
    with ResponseStore(tmp_path / "db" / "responses.sqlite3", ttl_s=TTL_S, clock=clock) as opened:
        yield opened


def run_python(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args], check=False, capture_output=True, text=True, timeout=120
    )


def test_round_trip_keeps_every_field_including_a_long_output(store: ResponseStore) -> None:
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "é" * 50_000}]}]
    original = replace(record("resp_1", previous="resp_0"), output_items=output)
    store.put(original)
    assert store.get("resp_1", tenant="acme") == original


VERSION_1_SCHEMA = (  # as loopstack wrote it before the unused prompt_token_ids column went
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE responses (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at REAL NOT NULL, model TEXT NOT NULL, "
    "previous_response_id TEXT, input_items TEXT NOT NULL, output_items TEXT NOT NULL, request TEXT NOT NULL, "
    "response TEXT NOT NULL, prompt_token_ids BLOB)",
    "CREATE INDEX responses_by_created_at ON responses (created_at)",
    "INSERT INTO meta (key, value) VALUES ('schema_version', '1')",
    "INSERT INTO responses VALUES ('resp_old', 'acme', 2e9, 'm', NULL, '[]', '[{\"type\":\"reasoning\"}]', '{}', "
    "'{\"id\":\"resp_old\"}', NULL)",
)


def test_a_version_1_file_is_migrated_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    conn = sqlite3.connect(path)
    try:
        with conn:
            for statement in VERSION_1_SCHEMA:
                conn.execute(statement)
    finally:
        conn.close()
    with ResponseStore(path, ttl_s=TTL_S, clock=lambda: 2e9) as store:
        old = store.get("resp_old", tenant="acme")
        assert old is not None and old.output_items == [{"type": "reasoning"}] and old.response == {"id": "resp_old"}
        store.put(replace(record("resp_new", previous="resp_old"), created_at=2e9))
        assert [link.id for link in store.chain("resp_new", tenant="acme")] == ["resp_old", "resp_new"]
    conn = sqlite3.connect(path)
    try:
        columns = [name for (_, name, *_rest) in conn.execute("PRAGMA table_info(responses)")]
        (version,) = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    finally:
        conn.close()
    assert "prompt_token_ids" not in columns and version == str(SCHEMA_VERSION) == "2"
    with ResponseStore(path, ttl_s=TTL_S, clock=lambda: 2e9) as store:  # a migrated file opens as it is
        assert store.get("resp_new", tenant="acme") is not None


def test_put_replaces_the_row_with_the_same_id(store: ResponseStore) -> None:
    store.put(record("resp_1"))
    replacement = replace(record("resp_1"), output_items=[{"type": "reasoning"}])
    store.put(replacement)
    assert store.get("resp_1", tenant="acme") == replacement
    assert store.statistics().num_responses == 1


def test_another_tenant_sees_nothing(store: ResponseStore) -> None:
    store.put(record("resp_1", tenant="acme"))
    assert store.get("resp_1", tenant="globex") is None
    assert store.delete("resp_1", tenant="globex") is False
    with pytest.raises(ResponseNotFoundError, match="resp_1"):
        store.chain("resp_1", tenant="globex")
    assert store.get("resp_1", tenant="acme") is not None


def test_another_tenant_cannot_overwrite_an_id(store: ResponseStore) -> None:
    store.put(record("resp_1", tenant="acme"))
    with pytest.raises(StoreError):
        store.put(record("resp_1", tenant="globex"))
    stored = store.get("resp_1", tenant="acme")
    assert stored is not None and stored.tenant == "acme"


def test_delete_removes_the_response(store: ResponseStore) -> None:
    store.put(record("resp_1"))
    assert store.delete("resp_1", tenant="acme") is True
    assert store.get("resp_1", tenant="acme") is None
    assert store.delete("resp_1", tenant="acme") is False


def test_chain_is_oldest_first(store: ResponseStore) -> None:
    store.put(record("resp_1"))
    store.put(record("resp_2", previous="resp_1"))
    store.put(record("resp_3", previous="resp_2"))
    assert [link.id for link in store.chain("resp_3", tenant="acme")] == ["resp_1", "resp_2", "resp_3"]


def test_chain_with_a_missing_link_names_that_id(store: ResponseStore) -> None:
    store.put(record("resp_2", previous="resp_gone"))
    store.put(record("resp_3", previous="resp_2"))
    with pytest.raises(ResponseNotFoundError, match="resp_gone") as raised:
        store.chain("resp_3", tenant="acme")
    assert raised.value.response_id == "resp_gone"
    assert isinstance(raised.value, KeyError)


def test_chain_detects_a_cycle(store: ResponseStore) -> None:
    store.put(record("resp_1", previous="resp_2"))
    store.put(record("resp_2", previous="resp_1"))
    with pytest.raises(ChainCycleError, match="resp_2"):
        store.chain("resp_2", tenant="acme")


def test_chain_longer_than_max_depth_is_refused(store: ResponseStore) -> None:
    store.put(record("resp_1"))
    store.put(record("resp_2", previous="resp_1"))
    with pytest.raises(ChainTooLongError):
        store.chain("resp_2", tenant="acme", max_depth=1)


def test_expired_responses_are_hidden_then_deleted(store: ResponseStore, clock: Clock) -> None:
    store.put(record("resp_old", at=NOW - TTL_S + 10))
    store.put(record("resp_new", at=NOW))
    clock.now = NOW + 10
    assert store.get("resp_old", tenant="acme") is None
    with pytest.raises(ResponseNotFoundError, match="resp_old"):
        store.chain("resp_old", tenant="acme")
    assert store.expire() == 1
    assert store.get("resp_new", tenant="acme") is not None
    assert store.statistics().num_responses == 1


def test_puts_expire_old_rows_every_n_puts(tmp_path: Path, clock: Clock) -> None:
    with ResponseStore(tmp_path / "r.sqlite3", ttl_s=TTL_S, clock=clock, expire_every=2) as store:
        store.put(record("resp_old", at=NOW - 2 * TTL_S))
        assert store.statistics().num_responses == 1
        store.put(record("resp_new"))
        assert store.statistics().num_responses == 1


def test_a_new_process_sees_the_rows(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    with ResponseStore(path, ttl_s=TTL_S) as store:
        fresh = replace(record("resp_1"), created_at=2e9)
        store.put(fresh)
    script = """
        import sys
        from loopstack.api.store import ResponseStore
        with ResponseStore(sys.argv[1], ttl_s=3600.0, clock=lambda: 2e9) as store:
            found = store.get("resp_1", tenant="acme")
            print(found.response["usage"], found.input_items[0]["content"][0]["text"])
    """
    done = run_python(script, str(path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{'total_tokens': 7} héllo"


def test_a_killed_process_keeps_what_it_put(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    script = """
        import os, signal, sys
        from loopstack.api.store import ResponseStore, StoredResponse
        store = ResponseStore(sys.argv[1], ttl_s=3600.0, clock=lambda: 2e9)
        store.put(StoredResponse("resp_k", "acme", 2e9, "m", None, [], [{"type": "reasoning"}] * 1000, {},
                                 {"id": "resp_k"}))
        os.kill(os.getpid(), signal.SIGKILL)
    """
    done = run_python(script, str(path))
    assert done.returncode == -signal.SIGKILL, done.stderr
    with ResponseStore(path, ttl_s=3600.0, clock=lambda: 2e9) as store:
        found = store.get("resp_k", tenant="acme")
    assert found is not None and found.output_items == [{"type": "reasoning"}] * 1000


def test_concurrent_puts_from_threads_all_land(store: ResponseStore) -> None:
    num_threads, num_puts = 8, 25
    errors: list[Exception] = []

    def writer(thread_index: int) -> None:
        try:
            for index in range(num_puts):
                store.put(record(f"resp_{thread_index}_{index}"))
                assert store.get(f"resp_{thread_index}_{index}", tenant="acme") is not None
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(index,)) for index in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert store.statistics().num_responses == num_threads * num_puts


def test_a_newer_schema_version_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    ResponseStore(path, ttl_s=TTL_S).close()
    conn = sqlite3.connect(path)
    try:
        with conn:
            conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    finally:
        conn.close()
    with pytest.raises(SchemaVersionError, match="99"):
        ResponseStore(path, ttl_s=TTL_S)


def test_a_file_that_is_not_a_store_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    path.write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreError, match="r.sqlite3"):
        ResponseStore(path, ttl_s=TTL_S)


def test_the_store_uses_wal(store: ResponseStore) -> None:
    conn = sqlite3.connect(store.path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    finally:
        conn.close()


def test_statistics_count_rows_and_bytes(store: ResponseStore) -> None:
    store.put(record("resp_1"))
    stats = store.statistics()
    assert (stats.num_responses, stats.num_puts) == (1, 1)
    assert stats.num_bytes > 0


def test_a_closed_store_raises(store: ResponseStore) -> None:
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get("resp_1", tenant="acme")


def test_unserializable_fields_are_refused(store: ResponseStore) -> None:
    bad = replace(record("resp_1"), request={"when": object()})
    with pytest.raises(StoreError, match="request"):
        store.put(bad)
