"""tool_search's on-disk vector cache: a restarted embedder encodes nothing, other model
keys miss, a bad file or folder never breaks a search, the LRU cap, two processes at once,
and the plugin's ``vector_cache`` option."""

from __future__ import annotations

import importlib.util
import logging
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from loopstack import PluginCatalog, StackLoader
from loopstack.plugins.tool_search.catalog import CatalogIndex
from loopstack.plugins.tool_search.docs import doc_from_info
from loopstack.plugins.tool_search.plugin import ToolSearchConfig
from loopstack.plugins.tool_search.retrieval import minilm
from loopstack.plugins.tool_search.retrieval.dense import chunk_texts
from loopstack.plugins.tool_search.retrieval.embedder import text_key
from loopstack.plugins.tool_search.retrieval.vector_store import VectorStore, default_path
from loopstack.tools import ToolInfo
from tests.plugins.tool_search.support import ON, runtime_with

HAS_MINILM = importlib.util.find_spec(minilm.MODEL_PACKAGE) is not None
needs_minilm = pytest.mark.skipif(not HAS_MINILM, reason=f"needs `{minilm.INSTALL_COMMAND}`")
STORE_LOGGER = "loopstack.plugins.tool_search.retrieval.vector_store"

INFOS = [
    ToolInfo("book_hotel", "Reserve a room at a hotel for the given dates", namespace="travel"),
    ToolInfo("create_issue", "Open a new issue in a GitHub repository", namespace="github"),
    ToolInfo("send_sms", "Send an SMS message to a phone number", namespace="46elks"),
    ToolInfo("get_forecast", "Weather forecast for a city " + "and its surroundings " * 40, namespace="weather"),
]


@pytest.fixture(scope="module")
def encoders():
    """bfloat16 (where native; else float32) and float32 encoders over the pinned weights,
    built once per module."""
    if not HAS_MINILM:
        pytest.skip(f"needs `{minilm.INSTALL_COMMAND}`")
    from loopstack.plugins.tool_search.retrieval.bert import BertEncoder
    from loopstack.plugins.tool_search.retrieval.embedder import default_dtype, read_model

    config, state_dict, tokenizer_json = read_model(minilm.model_zip_path())
    default = BertEncoder(config, state_dict, dtype=default_dtype())
    exact = default if default.dtype == torch.float32 else BertEncoder(config, state_dict, dtype=torch.float32)
    return {"default": default, "float32": exact, "tokenizer": tokenizer_json}


def _embedder(encoders, store, *, encoder="default", **options):
    from tokenizers import Tokenizer

    from loopstack.plugins.tool_search.retrieval.embedder import Embedder

    return Embedder(encoders[encoder], Tokenizer.from_str(encoders["tokenizer"]), store=store, **options)


def _search_works(embedder) -> None:
    catalog = CatalogIndex(embedder=embedder)
    catalog.sync(INFOS)
    assert catalog.search("a bed for the night", 1)[0].key == "book_hotel"


def _chunks() -> list[str]:
    """The texts a catalog sync of INFOS embeds."""
    return [text for info in INFOS for text in chunk_texts(doc_from_info(info))]


# -- the embedder over a store -----------------------------------------------------------


def test_a_restarted_embedder_encodes_nothing_and_gets_identical_vectors(encoders, tmp_path):
    path = tmp_path / "vectors.sqlite3"
    first = _embedder(encoders, VectorStore(path))
    CatalogIndex(embedder=first).sync(INFOS)
    texts = _chunks()
    assert first.statistics().num_encoded == len(texts) > len(INFOS)  # the long tool has 2 chunks
    restarted = _embedder(encoders, VectorStore(path))  # a new process: an empty memory cache
    catalog = CatalogIndex(embedder=restarted)
    catalog.sync(INFOS)
    stats = restarted.statistics()
    assert stats.num_encoded == 0 and stats.num_store_hits == len(texts) and stats.num_cache_hits == 0
    assert catalog.search("a bed for the night", 1)[0].key == "book_hotel"
    assert np.array_equal(restarted.embed_documents(texts), first.embed_documents(texts))  # bit for bit
    assert restarted.statistics().num_store_hits == len(texts)  # the second call: the memory cache


def test_only_the_missing_texts_are_encoded_and_written(encoders, tmp_path):
    store = VectorStore(tmp_path / "vectors.sqlite3")
    _embedder(encoders, store).embed_documents(["open an issue", "send a text"])
    again = _embedder(encoders, store)
    vectors = again.embed_documents(["open an issue", "book a hotel", "open an issue"])
    stats = again.statistics()
    assert (stats.num_encoded, stats.num_store_hits, stats.num_cache_hits) == (1, 1, 1)
    assert np.array_equal(vectors[0], vectors[2]) and store.statistics().num_entries == 3


def test_another_model_key_misses(encoders, tmp_path):
    store = VectorStore(tmp_path / "vectors.sqlite3")
    texts = _chunks()
    base = _embedder(encoders, store)
    base.embed_documents(texts)
    others = [_embedder(encoders, store, max_tokens=128)]
    if encoders["default"] is not encoders["float32"]:  # no native bfloat16: only one dtype
        others.append(_embedder(encoders, store, encoder="float32"))
    for other in others:
        assert other.model_key != base.model_key
        other.embed_documents(texts)
        assert other.statistics().num_store_hits == 0 and other.statistics().num_encoded == len(texts)
    assert minilm.WEIGHTS_SHA256 in base.model_key and "max_tokens=256" in base.model_key
    assert store.statistics().num_entries == len(texts) * (1 + len(others))


def test_a_corrupt_file_is_moved_aside_with_one_warning(encoders, tmp_path, caplog):
    path = tmp_path / "vectors.sqlite3"
    path.write_bytes(b"not a database " * 1000)
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        store = VectorStore(path)
        embedder = _embedder(encoders, store)
        _search_works(embedder)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    [aside] = tmp_path.glob("vectors.sqlite3.corrupt-*")
    assert str(path) in warning and "corrupt" in warning and str(aside) in warning
    assert aside.read_bytes().startswith(b"not a database")
    assert store.statistics().is_enabled and store.statistics().num_entries == len(_chunks())


def test_corruption_found_later_is_handled_the_same_way(tmp_path, caplog):
    path = tmp_path / "vectors.sqlite3"
    store = VectorStore(path)
    store.put_many("m", [(text_key("a"), np.ones(4, np.float32))])
    error = sqlite3.DatabaseError("database disk image is malformed")  # as SQLite raises it mid-read
    error.sqlite_errorcode = sqlite3.SQLITE_CORRUPT

    def corrupt_read(db: sqlite3.Connection) -> None:
        raise error

    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        store.run("read", corrupt_read, None)
    [warning] = [r.getMessage() for r in caplog.records]
    assert "corrupt" in warning and len(list(tmp_path.glob("vectors.sqlite3.corrupt-*"))) == 1
    assert store.get_many("m", [text_key("a")]) == {} and store.statistics().is_enabled


def test_a_folder_that_cannot_be_made_warns_once_and_search_still_works(encoders, tmp_path, monkeypatch, caplog):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("LOOPSTACK_CACHE_DIR", str(tmp_path / "a_file"))  # its tool_search/ cannot be made
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        store = VectorStore()
        embedder = _embedder(encoders, store)
        _search_works(embedder)
        embedder.embed_documents(["something new"])
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert str(tmp_path / "a_file") in warning and "not used" in warning
    assert not store.statistics().is_enabled and embedder.statistics().num_cached == len(_chunks()) + 1


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes to read-only folders")
def test_a_read_only_folder_warns_once(tmp_path, caplog):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
            store = VectorStore(folder / "vectors.sqlite3")
            store.put_many("m", [(text_key("a"), np.ones(4, np.float32))])
            assert store.get_many("m", [text_key("a")]) == {}
    finally:
        folder.chmod(0o700)
    assert len(caplog.records) == 1 and str(folder) in caplog.records[0].getMessage()


def test_a_full_disk_warns_once_and_vectors_still_come_back(encoders, tmp_path, caplog):
    store = VectorStore(tmp_path / "vectors.sqlite3")
    pages = store.run("setup", lambda db: db.execute("PRAGMA page_count").fetchone()[0], None)
    store.run("setup", lambda db: db.execute(f"PRAGMA max_page_count = {pages + 1}"), None)  # SQLITE_FULL: a full disk
    embedder = _embedder(encoders, store)
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        vectors = embedder.embed_documents(_chunks())
        embedder.embed_documents(["and more"])
    [warning] = [r.getMessage() for r in caplog.records]
    assert "full" in warning and str(store.path) in warning
    assert vectors.shape == (len(_chunks()), 384) and not store.statistics().is_enabled


def test_a_lock_held_too_long_skips_the_write_with_one_warning(tmp_path, caplog):
    path = tmp_path / "vectors.sqlite3"
    store = VectorStore(path, timeout_s=0.05)
    store.put_many("m", [(text_key("a"), np.ones(4, np.float32))])
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process writing
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        assert set(store.get_many("m", [text_key("a")])) == {text_key("a")}  # WAL: reads do not wait
        store.put_many("m", [(text_key("b"), np.ones(4, np.float32))])
        store.put_many("m", [(text_key("c"), np.ones(4, np.float32))])
    other.execute("ROLLBACK")
    other.close()
    [warning] = [r.getMessage() for r in caplog.records]
    assert "locked" in warning and str(path) in warning
    store.put_many("m", [(text_key("d"), np.ones(4, np.float32))])  # the store stays on
    assert set(store.get_many("m", [text_key(t) for t in "abcd"])) == {text_key("a"), text_key("d")}


def test_vectors_of_the_wrong_size_are_misses(tmp_path):
    path = tmp_path / "vectors.sqlite3"
    store = VectorStore(path)
    store.put_many("m", [(text_key("a"), np.ones(4, np.float32)), (text_key("b"), np.ones(4, np.float32))])
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("UPDATE vectors SET vector = zeroblob(12) WHERE key = ?", (bytes.fromhex(text_key("b")),))
    db.close()
    found = store.get_many("m", [text_key("a"), text_key("b")])
    assert list(found) == [text_key("a")] and found[text_key("a")].dtype == np.float32


# -- the size cap ------------------------------------------------------------------------


def test_past_max_entries_the_least_recently_used_go(tmp_path):
    now = [1_000_000.0]
    store = VectorStore(tmp_path / "vectors.sqlite3", max_entries=3, clock=lambda: now[0])
    keys = [text_key(str(i)) for i in range(5)]
    vector = np.ones(4, np.float32)
    for key in keys[:3]:  # 0, 1, 2 written a second apart
        store.put_many("m", [(key, vector)])
        now[0] += 1
    now[0] += 2 * 86_400  # two days later 0 is read: an old hit refreshes last_used
    assert set(store.get_many("m", keys[:1])) == {keys[0]}
    now[0] += 1
    store.put_many("m", [(keys[3], vector), (keys[4], vector)])  # 5 rows: the 2 oldest go
    assert set(store.get_many("m", keys)) == {keys[0], keys[3], keys[4]}
    assert store.statistics().num_entries == 3 and store.statistics().num_evicted == 2


# -- several processes -------------------------------------------------------------------

_WRITER = textwrap.dedent("""
    import hashlib, sys
    import numpy as np
    from loopstack.plugins.tool_search.retrieval.vector_store import VectorStore

    path, worker = sys.argv[1], int(sys.argv[2])
    store = VectorStore(path, timeout_s=30)
    rng = np.random.default_rng(worker)
    for batch in range(20):  # the two workers share half their keys
        keys = [hashlib.sha256(f"{i % 2 * worker}-{batch}-{i}".encode()).hexdigest() for i in range(50)]
        store.put_many("m", [(key, rng.random(384, dtype=np.float32)) for key in keys])
        assert len(store.get_many("m", keys)) == 50
    assert store.statistics().is_enabled
""")


@pytest.mark.slow
def test_two_processes_write_the_same_file_at_once(tmp_path):
    path = tmp_path / "vectors.sqlite3"
    workers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(worker)], stderr=subprocess.PIPE,
                                text=True) for worker in (1, 2)]
    errors = [worker.communicate(timeout=120)[1] for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0] and errors == ["", ""], errors
    assert VectorStore(path).statistics().num_entries == 20 * (25 + 25 + 25)  # 25 shared per batch


# -- the plugin option -------------------------------------------------------------------


def test_the_default_file_follows_the_environment(tmp_path):
    assert default_path({"LOOPSTACK_CACHE_DIR": str(tmp_path)}) == tmp_path / "tool_search" / "vectors.sqlite3"
    xdg = default_path({"XDG_CACHE_HOME": str(tmp_path)})
    assert xdg == tmp_path / "loopstack" / "tool_search" / "vectors.sqlite3"
    assert default_path({"XDG_CACHE_HOME": "relative"}) == Path.home() / ".cache/loopstack/tool_search/vectors.sqlite3"


def test_the_vector_cache_option_names_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPSTACK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ToolSearchConfig().vector_cache_path() == tmp_path / "cache" / "tool_search" / "vectors.sqlite3"
    assert ToolSearchConfig(vector_cache="").vector_cache_path() is None
    assert ToolSearchConfig(vector_cache="v.db").vector_cache_path() == tmp_path / "v.db"
    assert ToolSearchConfig(vector_cache="~/v.db").vector_cache_path() == tmp_path / "home" / "v.db"
    for bad, problem in ((str(tmp_path), "directory"), ("  ", "blank")):
        with pytest.raises(ValidationError, match=f"vector_cache should be 'default', ''.*{problem}"):
            ToolSearchConfig(vector_cache=bad)
    path = tmp_path / "bad.toml"
    path.write_text(f'[plugins.tool_search]\nenabled = true\nvector_cache = "{tmp_path}"\n')
    stack, issues = StackLoader(PluginCatalog.discover(use_entry_points=False, env={})).check(path)
    [error] = [issue for issue in issues if issue.severity == "error"]
    assert stack is None and error.key == "plugins.tool_search.vector_cache" and "'default'" in error.message


@needs_minilm
def test_the_plugin_writes_to_its_file_and_not_with_an_empty_option(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPSTACK_CACHE_DIR", str(tmp_path / "cache"))
    plugin = runtime_with(tmp_path, ON, name="on").instance("tool_search")
    plugin.catalogs.get(INFOS).sync(INFOS)  # a request's first sync embeds the tools
    embedder = plugin.embedder()
    assert embedder.store.path == tmp_path / "cache" / "tool_search" / "vectors.sqlite3"
    assert embedder.store.statistics().num_entries >= len(_chunks())
    off = runtime_with(tmp_path, ON + 'vector_cache = ""\n', name="off").instance("tool_search")
    assert off.vector_cache is None and off.embedder().store is None


def test_the_session_never_writes_to_the_home_cache():
    assert Path(os.environ["LOOPSTACK_CACHE_DIR"]) != Path.home() / ".cache" / "loopstack"
    assert default_path() != Path.home() / ".cache" / "loopstack" / "tool_search" / "vectors.sqlite3"


# -- learned uses (learning from use survives a restart) -----------------------------------


def test_uses_are_kept_per_catalog_and_model_oldest_first_and_bounded(tmp_path):
    ticks = iter(range(1000, 2000))
    store = VectorStore(tmp_path / "v.sqlite3", clock=lambda: next(ticks))
    vector = np.arange(4, dtype=np.float32)
    for index in range(5):
        store.add_use("m1", "github", f"query {index}", "create_issue", vector + index, max_per_catalog=3)
    store.add_use("m1", "github", "query 4", "create_issue", vector, max_per_catalog=3)  # known: unchanged
    store.add_use("m1", "slack", "post it", "send_message", vector, max_per_catalog=3)
    store.add_use("m2", "github", "query 0", "create_issue", vector, max_per_catalog=3)
    uses = store.uses("m1", "github", 10)
    assert [(q, t) for q, t, _ in uses] == [("query 2", "create_issue"), ("query 3", "create_issue"),
                                            ("query 4", "create_issue")]  # the 3 newest, oldest first
    assert np.array_equal(uses[-1][2], vector + 4)
    assert [q for q, _, _ in store.uses("m1", "github", 2)] == ["query 3", "query 4"]
    assert [q for q, _, _ in store.uses("m1", "slack", 10)] == ["post it"]
    assert [q for q, _, _ in store.uses("m2", "github", 10)] == ["query 0"] and store.uses("m3", "github", 5) == []
    store.close()  # a closed (or failed) store reads nothing and skips writes
    assert store.uses("m1", "github", 10) == []
    store.add_use("m1", "github", "later", "create_issue", vector, max_per_catalog=3)
    assert [q for q, _, _ in VectorStore(tmp_path / "v.sqlite3").uses("m1", "github", 10)][-1] == "query 4"


def test_a_file_from_before_uses_keeps_its_vectors_and_gains_the_table(tmp_path):
    path = tmp_path / "v.sqlite3"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE models (id INTEGER PRIMARY KEY, key TEXT NOT NULL UNIQUE, dim INTEGER NOT NULL);
        CREATE TABLE vectors (model_id INTEGER NOT NULL REFERENCES models (id), key BLOB NOT NULL,
            vector BLOB NOT NULL, last_used INTEGER NOT NULL, PRIMARY KEY (model_id, key));
        CREATE INDEX vectors_by_last_used ON vectors (last_used);
        PRAGMA user_version = 1;""")
    db.execute("INSERT INTO models (key, dim) VALUES ('m1', 2)")
    db.execute("INSERT INTO vectors VALUES (1, ?, ?, 0)", (bytes.fromhex("ab" * 32), np.ones(2, "<f4").tobytes()))
    db.commit()
    db.close()
    store = VectorStore(path)
    assert np.array_equal(store.get_many("m1", ["ab" * 32])["ab" * 32], np.ones(2))
    store.add_use("m1", "github", "open an issue", "create_issue", np.zeros(2), max_per_catalog=10)
    assert [q for q, _, _ in store.uses("m1", "github", 10)] == ["open an issue"]
    # the same schema version: a loopstack from before still opens the file
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 1
