"""Fixtures shared by the API tests."""

from __future__ import annotations

import pytest

from loopstack.testing.codex_cli import CodexCLI, CodexUnavailable


@pytest.fixture(scope="module")
def codex() -> CodexCLI:
    """The pinned Codex CLI (installed from npm on first use), or a skip saying how to get it."""
    try:
        return CodexCLI.install()
    except CodexUnavailable as exc:
        pytest.skip(f"the Codex CLI is not installed and npm could not install it ({exc}); run `make codex`")
