"""loopstack: composable optimization middlewares for LLM agent loops.

Public API only; see docs/architecture.md for the map and docs/writing-plugins.md to
write a plugin.
"""

from __future__ import annotations

from loopstack.catalog import PluginCatalog, PluginLoadError, PluginSpec
from loopstack.context import RequestContext, Session
from loopstack.experiments import ArmOverrideError
from loopstack.hookspecs import hookimpl, hookspec
from loopstack.live import LiveStack, ReloadResult
from loopstack.metrics import MetricsRegistry
from loopstack.middleware import Chain, MiddlewareStack, compose
from loopstack.plugin import Layer, Plugin, PluginConfig
from loopstack.runtime import StackRuntime
from loopstack.stack.errors import StackError, StackIssue
from loopstack.stack.loader import StackLoader, find_stack, list_stacks
from loopstack.stack.schema import ResolvedStack
from loopstack.tools import ToolInfo, ToolSet
from loopstack.types import Handler, MiddlewareFactory, ModelHandler, ResponseHandler, StateKey, ToolHandler

__version__ = "0.1.0"

__all__ = [
    "ArmOverrideError",
    "Chain",
    "Handler",
    "Layer",
    "LiveStack",
    "MetricsRegistry",
    "MiddlewareFactory",
    "MiddlewareStack",
    "ModelHandler",
    "Plugin",
    "PluginCatalog",
    "PluginConfig",
    "PluginLoadError",
    "PluginSpec",
    "ReloadResult",
    "RequestContext",
    "ResolvedStack",
    "ResponseHandler",
    "Session",
    "StackError",
    "StackIssue",
    "StackLoader",
    "StackRuntime",
    "StateKey",
    "ToolHandler",
    "ToolInfo",
    "ToolSet",
    "__version__",
    "compose",
    "find_stack",
    "hookimpl",
    "hookspec",
    "list_stacks",
]
