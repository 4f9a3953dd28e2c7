"""What the plugin remembers per session and per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loopstack.tools import ToolInfo
from loopstack.types import StateKey

if TYPE_CHECKING:
    from loopstack.plugins.tool_search.catalog import CatalogIndex

__all__ = ["REQUEST_TOOLS", "SESSION_TOOLS", "RequestTools", "SessionTools"]


@dataclass
class SessionTools:
    """Per session: the tools loaded into the conversation so far (name -> Responses
    function-tool dict, in load order) and how many searches ran."""

    loaded: dict[str, dict[str, Any]] = field(default_factory=dict)
    num_searches: int = 0
    num_requests: int = 0
    found_by: dict[str, str] = field(default_factory=dict)  # tool name -> the last query that found it


@dataclass
class RequestTools:
    """Per request: the deferred tools (name -> info) and the index that searches them."""

    deferred: dict[str, ToolInfo] = field(default_factory=dict)
    catalog: CatalogIndex | None = None
    is_synced: bool = False  # the catalog was synced with ``deferred`` (once per request)
    synced_version: int = -1  # the catalog's version right after that sync
    embedded_early: set[str] = field(default_factory=set)  # call ids whose query was embedded as it streamed

    def sync(self) -> None:
        """Make the catalog hold ``deferred`` (the first search of a request does this)."""
        assert self.catalog is not None
        with self.catalog.lock:
            self.catalog.sync(list(self.deferred.values()))
            self.is_synced = True
            self.synced_version = self.catalog.version


SESSION_TOOLS = StateKey("tool_search.session", SessionTools)
"""Per session (``ctx.session.state(SESSION_TOOLS)``): what was loaded and searched."""

REQUEST_TOOLS = StateKey("tool_search.request", RequestTools)
"""Per request (``ctx.state(REQUEST_TOOLS)``): the deferred tools and their index."""
