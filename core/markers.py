"""The pluggy markers for the ``loopstack`` project name."""

from __future__ import annotations

import pluggy

PROJECT_NAME = "loopstack"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
