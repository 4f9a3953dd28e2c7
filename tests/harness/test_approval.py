"""Approval policies of the shell tool, and that a denied command never runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loopstack.harness.tools.approval import (
    ApprovalPolicy,
    ToolCallRequest,
    is_safe_command,
    needs_approval,
)
from loopstack.harness.tools.sandbox import ShellSandbox, network_isolation_works
from loopstack.harness.tools.shell import ShellTool
from loopstack.stack.schema import HarnessConfig

SAFE = ["ls -la", "cat README.md", "head -n 5 a.txt", "tail b.txt", "wc -l a.txt", "grep -rn foo .",
        "rg TODO", "find . -name x.py", "pwd", "echo hello", ["grep", "a b", "file.txt"]]
UNSAFE = ["rm -rf /", "touch x", "python3 -c 1", "find . -delete", "find . -exec rm {} +", "find . -fprint out",
          "rg --pre ./evil foo", "/bin/ls", "FOO=1 ls", "sh -c ls", "", "   ", "cat 'unbalanced"]
METACHARACTERS = ["ls; rm -rf x", "ls | sh", "ls && touch x", "echo hi > f", "cat < f", "echo `id`",
                  "echo $(id)", "echo $HOME", "ls\ntouch x", "ls *", "ls &"]
GIT_READ_ONLY = ["git status", "git diff", "git log --oneline", "git show HEAD", "git branch -a"]
GIT_UNSAFE = ["git push", "git -c core.pager=sh log", "git diff --output=x", "git diff --ext-diff",
              "git branch newbranch", "git branch -D main", "git commit -m x"]


@pytest.mark.parametrize("command", SAFE)
def test_safe_commands_run_without_approval(command: str | list[str]) -> None:
    assert not needs_approval(command, "on-request")
    assert not needs_approval(command, "untrusted")


@pytest.mark.parametrize("command", UNSAFE + METACHARACTERS + GIT_UNSAFE)
def test_unsafe_commands_need_approval(command: str) -> None:
    assert needs_approval(command, "on-request")
    assert needs_approval(command, "untrusted")


@pytest.mark.parametrize("command", UNSAFE + METACHARACTERS + GIT_UNSAFE + SAFE)
def test_never_policy_asks_for_nothing(command: str) -> None:
    assert not needs_approval(command, "never")
    assert not needs_approval(command, "never", is_escalated=True)


@pytest.mark.parametrize("command", GIT_READ_ONLY)
def test_read_only_git_is_safe_only_in_a_trusted_workspace(command: str) -> None:
    assert not needs_approval(command, ApprovalPolicy.ON_REQUEST)
    assert needs_approval(command, ApprovalPolicy.UNTRUSTED)  # .git/config can run programs


def test_metacharacters_count_even_when_quoted() -> None:
    assert not is_safe_command("echo 'a; b'")
    assert not is_safe_command(["echo", "a|b"])


def test_escalation_always_needs_approval_except_under_never() -> None:
    assert needs_approval("ls", "on-request", is_escalated=True)
    assert needs_approval("ls", "untrusted", is_escalated=True)


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="on-request"):
        ApprovalPolicy.from_config("sometimes")


def test_config_values_map_to_policies() -> None:
    assert {p.value for p in ApprovalPolicy} == {"never", "on-request", "untrusted"}
    assert ApprovalPolicy.from_config(HarnessConfig().approval) is ApprovalPolicy.ON_REQUEST


class RecordingApprover:
    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.requests: list[ToolCallRequest] = []

    async def __call__(self, request: ToolCallRequest) -> bool:
        self.requests.append(request)
        return self.answer


def _tool(root: Path, policy: str, approver: RecordingApprover | None) -> ShellTool:
    return ShellTool(ShellSandbox(root, timeout_s=5, max_output_bytes=4096), policy, approver)


@pytest.mark.parametrize("policy", ["on-request", "untrusted"])
def test_denied_command_never_runs(tmp_path: Path, policy: str) -> None:
    approver = RecordingApprover(answer=False)
    tool = _tool(tmp_path, policy, approver)
    result = asyncio.run(tool.call({"command": "touch created.txt"}))
    assert result.is_error and "denied" in result.text
    assert not (tmp_path / "created.txt").exists()
    assert approver.requests == [ToolCallRequest("shell", "touch created.txt", ".")]
    assert tool.statistics().num_denied == 1 and tool.statistics().num_ran == 0


def test_without_an_approver_unsafe_commands_are_denied(tmp_path: Path) -> None:
    result = asyncio.run(_tool(tmp_path, "on-request", None).call({"command": "touch created.txt"}))
    assert "denied" in result.text
    assert not (tmp_path / "created.txt").exists()


def test_approved_command_runs(tmp_path: Path) -> None:
    approver = RecordingApprover(answer=True)
    result = asyncio.run(_tool(tmp_path, "untrusted", approver).call({"command": "touch created.txt"}))
    assert not result.is_error and "exit_code: 0" in result.text
    assert (tmp_path / "created.txt").exists()


def test_safe_command_does_not_ask(tmp_path: Path) -> None:
    approver = RecordingApprover(answer=False)
    result = asyncio.run(_tool(tmp_path, "untrusted", approver).call({"command": "echo hello"}))
    assert "hello" in result.text and approver.requests == []


def test_never_policy_runs_without_asking(tmp_path: Path) -> None:
    approver = RecordingApprover(answer=False)
    asyncio.run(_tool(tmp_path, "never", approver).call({"command": "touch created.txt"}))
    assert (tmp_path / "created.txt").exists() and approver.requests == []


def test_approved_escalation_runs_with_network_and_never_ignores_escalation(tmp_path: Path) -> None:
    approver = RecordingApprover(answer=True)
    escalated = asyncio.run(_tool(tmp_path, "on-request", approver).execute({"command": "ls", "escalate": True}))
    ignored = asyncio.run(_tool(tmp_path, "never", None).execute({"command": "ls", "escalate": True}))
    assert approver.requests == [ToolCallRequest("shell", "ls", ".", is_escalated=True)]
    assert escalated.result is not None and not escalated.result.network_isolated
    assert ignored.result is not None and ignored.result.network_isolated is network_isolation_works()  # sandbox default
