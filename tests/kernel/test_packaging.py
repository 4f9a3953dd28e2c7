"""The wheel must contain every package directory (setuptools lists them explicitly)."""

from __future__ import annotations

import tomllib

from tests.support import REPO


def test_every_package_directory_is_listed_in_pyproject():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for prefix, root in (("loopstack", REPO / "core"), ("loopstack.plugins", REPO / "plugins")):
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            found.add(".".join((prefix, *parts)))
    assert found == listed


def test_torch_is_pinned():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch==2.13.0" in deps
