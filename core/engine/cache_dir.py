"""Where loopstack keeps what it computes once per machine and reuses (measured curves, vectors)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["user_cache_dir"]


def user_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """``$LOOPSTACK_CACHE_DIR``, else ``$XDG_CACHE_HOME/loopstack``, else ``~/.cache/loopstack``
    (a relative ``XDG_CACHE_HOME`` is ignored, as the XDG spec says)."""
    if env.get("LOOPSTACK_CACHE_DIR"):
        return Path(env["LOOPSTACK_CACHE_DIR"]).expanduser()
    if env.get("XDG_CACHE_HOME") and Path(env["XDG_CACHE_HOME"]).is_absolute():
        return Path(env["XDG_CACHE_HOME"]) / "loopstack"
    return Path.home() / ".cache" / "loopstack"
