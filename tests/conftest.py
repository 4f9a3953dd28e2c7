"""Shared fixtures: a plugin catalog with test plugins, and stack files in tmp_path."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from kernel_support import Recorder

from loopstack import PluginCatalog

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
