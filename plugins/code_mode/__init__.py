"""Code Mode: one JavaScript program over the tools, run in embedded V8 (DESIGN.md technique 2).

The model calls ``exec`` with a program; every callable tool of the request is an async
function ``tools.<name>(args)`` inside it, and only the program's (capped) result and
console output enter the context. See docs/techniques/code-mode.md.

Modules: ``config`` (the TOML table), ``declarations`` (JSON Schema -> TypeScript),
``prelude`` (the JavaScript glue), ``sandbox`` (the V8 runner), ``gate`` (concurrency of
tool calls), ``result`` (what enters the context), ``exec_tool``, ``plugin``, ``bench``
(the ``code-mode`` workload).
"""

from __future__ import annotations

from typing import Any

from loopstack.hookspecs import hookimpl
from loopstack.plugins.code_mode.config import CodeModeConfig
from loopstack.plugins.code_mode.plugin import CodeMode

__all__ = ["PLUGIN", "CodeMode", "CodeModeConfig"]

PLUGIN = CodeMode


@hookimpl
def loopstack_bench_workloads() -> list[Any]:
    from loopstack.plugins.code_mode.bench.workload import CodeModeWorkload

    return [CodeModeWorkload()]
