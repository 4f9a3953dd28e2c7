"""``loopstack replay`` and the terminal approver of ``loopstack run``."""

from __future__ import annotations

import io
import json

import anyio
import pytest

from loopstack.cli.agent import TerminalApprover
from loopstack.cli.main import main
from loopstack.harness.tools.approval import ToolCallRequest
from tests.support import SHARED_DATA

TRAJECTORY = (SHARED_DATA / "trajectories" / "swebench_minisweagent" / "full_trajectories"
              / "django__django-12155.traj.json")


def _session(path):
    path.write_text(json.dumps([
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "k", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "k", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]))
    return path


def test_replay_prints_json_and_exits_0_when_faithful(tmp_path, capsys):
    assert main(["replay", str(_session(tmp_path / "s.json")), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["calls_match"] and report["sizes_match"] and len(report["turns"]) == 2


def test_replay_of_a_bad_file_names_it(tmp_path):
    (tmp_path / "x.json").write_text("[]")
    with pytest.raises(SystemExit, match="x.json: unknown trajectory format"):
        main(["replay", str(tmp_path / "x.json")])


@pytest.mark.needs_data
@pytest.mark.skipif(not TRAJECTORY.exists(), reason=f"{TRAJECTORY} is absent (../shared/data)")
def test_replay_of_a_real_session_prints_a_table(capsys):
    assert main(["replay", str(TRAJECTORY), "--max-turns", "6"]) == 0
    out = capsys.readouterr().out
    assert "6 of 20 turns replayed" in out and "tool calls as recorded: yes" in out
    assert len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == 6


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_approver_asks_a_person_and_denies_without_a_terminal():
    request = ToolCallRequest("shell", "rm -rf build")
    prompts = io.StringIO()
    assert anyio.run(TerminalApprover(_FakeTTY("y\n"), prompts), request) is True
    assert "rm -rf build" in prompts.getvalue()
    assert anyio.run(TerminalApprover(_FakeTTY("\n"), io.StringIO()), request) is False  # default: no
    notices = io.StringIO()
    assert anyio.run(TerminalApprover(io.StringIO("y\n"), notices), request) is False  # piped stdin: never approves
    assert "no terminal" in notices.getvalue()
