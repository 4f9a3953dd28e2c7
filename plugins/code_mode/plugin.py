"""The ``code_mode`` plugin: adds ``exec`` and writes the tools' declarations into it."""

from __future__ import annotations

from typing import Any

from loopstack.hookspecs import hookimpl
from loopstack.plugin import Layer, Plugin
from loopstack.plugins.code_mode.config import CodeModeConfig
from loopstack.plugins.code_mode.exec_tool import EXEC_TOOL_NAME, TOOL_SEARCH_NAME, ExecTool, exec_description
from loopstack.plugins.code_mode.spare import SpareContexts

__all__ = ["CodeMode"]


class CodeMode(Plugin):
    """An ``exec`` tool: the model writes one JavaScript program over the tools, run in V8.

    Hooks:
        ``loopstack_extra_tools``: an :class:`ExecTool` bound to the request (fresh V8
            contexts come from a :class:`SpareContexts` shared by the plugin's requests).
        ``loopstack_unconfigure``: disposes the spare context.
        ``loopstack_visible_tools`` (``trylast``, so after plugins that defer tools, such as
            ``tool_search``): ``exec`` is kept listed and its description gets TypeScript
            declarations of the tools the model sees; with ``code_mode_only`` every tool
            but ``exec`` and ``tool_search`` is then deferred (out of the model's list,
            still callable from programs).
    """

    name = "code_mode"
    layers = (Layer.HARNESS,)
    Config = CodeModeConfig
    summary = "An exec tool: the model writes one JavaScript program over the tools, run in V8."

    config: CodeModeConfig

    def __init__(self, config: CodeModeConfig, *, arm: str = "default") -> None:
        super().__init__(config, arm=arm)
        self.spares = SpareContexts(heap_bytes=config.heap_mb << 20, max_log_chars=config.max_log_bytes)

    @hookimpl
    def loopstack_unconfigure(self, runtime: Any) -> None:
        self.spares.close()

    @hookimpl
    def loopstack_extra_tools(self, ctx: Any) -> list[Any]:
        return [ExecTool(ctx, self.config, self.spares)]

    @hookimpl(trylast=True)
    def loopstack_visible_tools(self, tools: Any, ctx: Any) -> None:
        if EXEC_TOOL_NAME not in tools.names() or tools.is_hidden(EXEC_TOOL_NAME):
            return
        tools.load(EXEC_TOOL_NAME)  # a plugin deferring every tool (tool_search, defer = "all") must not hide exec
        declared = [t for t in tools.visible() if t.name != EXEC_TOOL_NAME]
        has_search = any(t.name == TOOL_SEARCH_NAME for t in declared)
        undeclared = [t.name for t in tools.deferred() if t.name != EXEC_TOOL_NAME]
        description = exec_description(declared, self.config, has_search=has_search, undeclared=undeclared)
        tools.update(EXEC_TOOL_NAME, description=description)
        if self.config.code_mode_only:
            for info in declared:
                if info.name != TOOL_SEARCH_NAME:
                    tools.defer(info.name)
