"""loopstack: composable optimization middlewares for LLM agent loops.

Public API only; see docs/architecture.md for the map and docs/writing-plugins.md to
write a plugin.
"""

from __future__ import annotations

from .context import RequestContext, Session
from .experiments import ArmOverrideError
from .live import LiveStack, ReloadResult
from .markers import hookimpl, hookspec
from .metrics import MetricsRegistry
from .middleware import Handler, MiddlewareFactory, compose
from .plugin import Layer, Plugin, PluginConfig
from .plugin_manager import PluginCatalog, PluginLoadError, PluginSpec
from .runtime import StackRuntime
from .stack import StackLoader, find_stack, list_stacks
from .stack_errors import StackError, StackIssue
from .stack_schema import ResolvedStack
from .tools import ToolInfo, ToolSet

__version__ = "0.1.0"

__all__ = [
    "ArmOverrideError",
    "Handler",
    "Layer",
    "LiveStack",
    "MetricsRegistry",
    "MiddlewareFactory",
    "Plugin",
    "PluginCatalog",
    "PluginConfig",
    "PluginLoadError",
    "PluginSpec",
    "ReloadResult",
    "RequestContext",
    "ResolvedStack",
    "Session",
    "StackError",
    "StackIssue",
    "StackLoader",
    "StackRuntime",
    "ToolInfo",
    "ToolSet",
    "__version__",
    "compose",
    "find_stack",
    "hookimpl",
    "hookspec",
    "list_stacks",
]
