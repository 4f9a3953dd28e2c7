"""Engine test fixtures. They live in engine_support so that test modules can import its
helpers by name (two modules named ``conftest`` cannot both be imported); pytest finds the
fixtures here by name."""

from __future__ import annotations

from tests.engine.support import *  # noqa: F403
