"""Shared fixtures: a plugin catalog with test plugins, and stack files in tmp_path."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from kernel_support import Recorder

from loopstack import PluginCatalog


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
    return found


@pytest.fixture
def write_stack(tmp_path: Path) -> Callable[[str, str], Path]:
    """write_stack("name", toml_text) -> path of tmp_path/name.toml."""

    def write(name: str, text: str) -> Path:
        path = tmp_path / f"{name}.toml"
        path.write_text(textwrap.dedent(text).lstrip())
        return path

    return write
