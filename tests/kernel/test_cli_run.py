"""``loopstack run`` against the real server: MCP tools over stdio, the session streamed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from loopstack.cli.main import main

NOTES_SERVER = Path(__file__).parents[2] / "examples" / "mcp_notes_server.py"


@pytest.mark.slow
def test_run_streams_a_session_with_an_mcp_server(server, capfd):
    code = main(["run", "Save a note titled 'groceries' saying 'milk and eggs'.", "--url", f"{server.url}/v1",
                 "--no-shell", "--mcp", f"{sys.executable} {NOTES_SERVER}", "--tool-choice-first", "required",
                 "--max-turns", "2", "--max-output-tokens", "48", "--json"])
    events = [json.loads(line) for line in capfd.readouterr().out.splitlines() if line.startswith("{")]
    assert code == 0
    kinds = [e["event"] for e in events]
    assert kinds[0] == "TurnStarted" and "ModelCalled" in kinds and "ToolCalled" in kinds
    call = next(e for e in events if e["event"] == "ToolCalled")
    assert call["name"] in ("add_note", "list_notes", "search_notes", "enable_archive") and not call["is_error"]
    assert kinds[-1] in ("FinalAnswer", "TurnLimitReached")


def test_run_reports_a_refused_request(server, capfd):
    code = main(["run", "hi", "--url", f"{server.url}/v1", "--no-shell", "--max-output-tokens", "0"])
    assert code == 1  # max_output_tokens must be >= 1: the server refuses, the CLI says so
    assert "refused" in capfd.readouterr().err
