"""What the plugin remembers per session and per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loopstack.tools import ToolInfo

if TYPE_CHECKING:
    from .catalog import CatalogIndex

__all__ = ["STATE_KEY", "RequestTools", "SessionTools"]

STATE_KEY = "tool_search"


@dataclass
class SessionTools:
    """Per session: the tools loaded into the conversation so far (name -> Responses
    function-tool dict, in load order) and how many searches ran."""

    loaded: dict[str, dict[str, Any]] = field(default_factory=dict)
    num_searches: int = 0
    num_requests: int = 0


@dataclass
class RequestTools:
    """Per request: the deferred tools (name -> info) and the index that searches them."""

    deferred: dict[str, ToolInfo] = field(default_factory=dict)
    catalog: CatalogIndex | None = None
    is_synced: bool = False  # the catalog holds exactly ``deferred`` (synced once per request)
