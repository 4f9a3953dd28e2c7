"""The ``[plugins.code_mode]`` table."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loopstack.plugin import PluginConfig


class CodeModeConfig(PluginConfig):
    timeout_s: float = Field(10.0, gt=0, description="wall-clock limit of one program")
    heap_mb: int = Field(64, ge=8, description="V8 heap limit")
    max_result_bytes: int = Field(16_384, ge=256, description="cap on the result that enters the context")
    max_log_bytes: int = Field(4_096, ge=0, description="cap on the console output that enters the context")
    code_mode_only: bool = Field(False, description="exec (and tool_search) are the only tools the model sees")
    context: Literal["exec", "session"] = Field("exec", description="a fresh V8 context per exec, or one per session")
