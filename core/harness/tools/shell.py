"""The built-in ``shell`` tool: approval policy in front of a :class:`ShellSandbox`.

Every outcome the model can cause is a tool result, never an exception: bad arguments, a
denied command, a working directory outside the jail, a timeout. A denied command never runs.

Example::

    tool = ShellTool.from_config(stack.harness, base_dir=stack_dir, approver=ask_person)
    result = await tool.call({"command": "ls -la"})  # a ToolResult, as every harness tool returns
    send_to_model(result.text)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loopstack.harness.tools.approval import ApprovalPolicy, Approver, ToolCallRequest, needs_approval
from loopstack.harness.tools.sandbox import SandboxViolation, ShellResult, ShellSandbox
from loopstack.harness.tools.tool import ToolResult
from loopstack.stack.schema import HarnessConfig
from loopstack.tools import ToolInfo

SHELL_TOOL_NAME = "shell"
_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "description": "a shell command line, run with /bin/sh -c"},
        "workdir": {"type": "string", "description": "working directory relative to the workspace root (default '.')"},
        "escalate": {
            "type": "boolean",
            "description": "ask a person to allow network access for this one command",
        },
    },
    "required": ["command"],
    "additionalProperties": False,
}


class ShellArguments(BaseModel):
    """The arguments the model sends (validated: they come from the model)."""

    model_config = ConfigDict(extra="forbid")

    command: str = Field(min_length=1, description="a shell command line, run with /bin/sh -c")
    workdir: str = Field(".", description="working directory, relative to the sandbox root")
    escalate: bool = Field(
        False, description="ask a person to allow network access for this command (policy 'on-request')"
    )


@dataclass(frozen=True)
class ShellToolOutput:
    """One call's outcome.

    Attributes:
        text: the tool result sent back to the model.
        is_denied: approval was refused (the command did not run).
        is_error: the call did not run for another reason (bad arguments, workdir outside the jail).
        result: the sandbox result when the command ran.
    """

    text: str
    is_denied: bool = False
    is_error: bool = False
    result: ShellResult | None = None


class ShellToolStatistics(NamedTuple):
    num_calls: int
    num_ran: int
    num_asked: int  # calls that needed a person's decision
    num_denied: int
    num_invalid: int  # bad arguments or workdir outside the jail


class ShellTool:
    """The ``shell`` tool the model calls (a :class:`loopstack.harness.tools.tool.Tool`).

    Args:
        sandbox: where approved commands run.
        policy: when a person must approve (:class:`ApprovalPolicy` or its config value).
        approver: asked for every command that needs approval; ``None`` denies them all.
    """

    def __init__(self, sandbox: ShellSandbox, policy: ApprovalPolicy | str, approver: Approver | None = None) -> None:
        self.sandbox = sandbox
        self.policy = ApprovalPolicy.from_config(policy)
        self.approver = approver
        self.is_concurrency_safe = False  # commands may write the files other calls read
        self.info = ToolInfo(
            name=SHELL_TOOL_NAME,
            description=(
                "Run a shell command in the workspace and return its exit code and output. "
                f"Commands time out after {sandbox.timeout_s} s; output is capped at "
                f"{sandbox.max_output_bytes} bytes. Some commands need a person's approval."
            ),
            parameters=_PARAMETERS,
        )
        self._num_calls = self._num_ran = self._num_asked = self._num_denied = self._num_invalid = 0

    @classmethod
    def from_config(cls, config: HarnessConfig, *, base_dir: Path, approver: Approver | None = None) -> ShellTool:
        """Build from the ``[harness]`` table; a relative ``sandbox_dir`` is taken from ``base_dir``."""
        sandbox = ShellSandbox(
            Path(base_dir) / config.sandbox_dir,
            timeout_s=config.shell_timeout_s,
            max_output_bytes=config.max_tool_output_bytes,
        )
        return cls(sandbox, config.approval, approver)

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Run one call; a denial or an error comes back as ``ToolResult(is_error=True)``."""
        output = await self.execute(arguments)
        return ToolResult(output.text, is_error=output.is_denied or output.is_error)

    async def execute(self, arguments: str | dict[str, Any]) -> ShellToolOutput:
        """Validate, ask for approval when the policy says so, run, and format the result."""
        self._num_calls += 1
        try:
            args = _parse_arguments(arguments)
        except (ValueError, ValidationError) as exc:
            self._num_invalid += 1
            return ShellToolOutput(f"error: invalid arguments for the shell tool: {exc}", is_error=True)
        request = ToolCallRequest(SHELL_TOOL_NAME, args.command, args.workdir, is_escalated=args.escalate)
        is_escalation_granted = False
        if needs_approval(args.command, self.policy, is_escalated=args.escalate):
            self._num_asked += 1
            if self.approver is None or not await self.approver(request):
                self._num_denied += 1
                return ShellToolOutput(f"denied: a person did not approve running {args.command!r}", is_denied=True)
            is_escalation_granted = args.escalate
        try:
            result = await self.sandbox.run(
                args.command, args.workdir, allow_network=True if is_escalation_granted else None
            )
        except SandboxViolation as exc:
            self._num_invalid += 1
            return ShellToolOutput(f"error: {exc}", is_error=True)
        self._num_ran += 1
        return ShellToolOutput(format_result(result, self.sandbox.max_output_bytes), result=result)

    def statistics(self) -> ShellToolStatistics:
        return ShellToolStatistics(self._num_calls, self._num_ran, self._num_asked, self._num_denied, self._num_invalid)


def _parse_arguments(arguments: str | dict[str, Any]) -> ShellArguments:
    if isinstance(arguments, str):
        arguments = json.loads(arguments)  # json.JSONDecodeError is a ValueError
    return ShellArguments.model_validate(arguments)


def format_result(result: ShellResult, max_output_bytes: int) -> str:
    """The tool result text for the model: exit code, markers, then stdout and stderr."""
    lines = [f"exit_code: {result.exit_code}"]
    if result.timed_out:
        lines.append(f"[timed out after {result.duration_s:.1f} s; the command and its children were killed]")
    if result.truncated:
        lines.append(f"[output truncated: only the first {max_output_bytes} bytes of stdout+stderr are shown]")
    lines += ["stdout:", result.stdout.rstrip("\n"), "stderr:", result.stderr.rstrip("\n")]
    return "\n".join(lines)
