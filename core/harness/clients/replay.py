"""Replay a recorded session through a stack: the recording plays the model and the tools.

``ReplayClient`` answers the agent loop's n-th model call with the recording's n-th
assistant turn; :meth:`ReplayClient.tools` gives tools that answer each call with the
recorded output. The loop, the stack's plugins, serialization and (with ``forward``) the
API server and engine all run for real, so a real agent session can be re-run through any
stack: request sizes, prefix-cache hits and technique effects are measured on real
conversations while the content stays the recorded one.

With ``forward``, each request is also sent to another client (a server, the embedded
engine) with ``max_output_tokens=1``: the response's usage (prompt and cached tokens)
is that server's, the output is still the recording's.

Example::

    trajectory = load_trajectory("../shared/data/trajectories/.../django__django-10097.traj.json")
    report = await replay(trajectory, runtime=runtime)
    print(report.calls_match, [row.request_bytes for row in report.rows])
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loopstack.harness.clients.base import (
    ModelClient,
    ModelClientError,
    TextCallback,
    last_request_bytes,
    serialize_request,
)
from loopstack.harness.tools.tool import ToolResult
from loopstack.harness.trajectory import RecordedCall, Trajectory, conversation_chars
from loopstack.tools import ToolInfo

if TYPE_CHECKING:
    from loopstack.context import RequestContext
    from loopstack.runtime import StackRuntime

__all__ = ["ReplayClient", "ReplayReport", "ReplayRow", "ReplayTool", "replay"]

_BASH_PARAMETERS = {"type": "object", "properties": {"command": {"type": "string", "description": "a shell command"}},
                    "required": ["command"]}


@dataclass(frozen=True)
class ReplayRow:
    """One replayed model call: what was sent and what the usage says."""

    turn: int
    request_bytes: int
    conversation_chars: int
    recorded_chars: int
    input_tokens: int
    cached_tokens: int


@dataclass
class _Outputs:
    queues: dict[str, deque[RecordedCall]] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)

    def next(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        queue = self.queues.get(name)
        if not queue:
            self.mismatches.append(f"{name}: no recorded call left")
            return ToolResult(f"the recording has no further call of {name!r}", is_error=True)
        call = queue.popleft()
        if call.arguments != arguments:
            self.mismatches.append(f"{call.call_id} {name}: arguments {arguments!r} != recorded {call.arguments!r}")
        return ToolResult(call.output)


class ReplayTool:
    """A tool that returns the recorded outputs of its name's calls, in order."""

    is_concurrency_safe = False  # outputs are consumed in recorded order

    def __init__(self, info: ToolInfo, outputs: _Outputs) -> None:
        self.info = info
        self._outputs = outputs

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        return self._outputs.next(self.info.name, arguments)


def _parameters(name: str, calls: list[RecordedCall]) -> dict[str, Any]:
    if name == "bash":
        return _BASH_PARAMETERS
    keys = dict.fromkeys(k for c in calls if c.name == name for k in c.arguments)
    return {"type": "object", "properties": {k: {} for k in keys}}


class ReplayClient:
    """Plays a :class:`Trajectory`'s assistant turns as model responses.

    Args:
        trajectory: the recording.
        forward: also send each request here (``max_output_tokens=1``) and report its usage.
    """

    def __init__(self, trajectory: Trajectory, *, forward: ModelClient | None = None) -> None:
        self.trajectory = trajectory
        self.forward = forward
        self.rows: list[ReplayRow] = []
        self._outputs = _Outputs()
        self._recorded_chars = trajectory.prompt_chars()
        for call in trajectory.calls():
            self._outputs.queues.setdefault(call.name, deque()).append(call)
        calls = trajectory.calls()
        self._tools = [ReplayTool(ToolInfo(name, f"Recorded tool {name!r} (replay).", _parameters(name, calls)),
                                  self._outputs) for name in trajectory.tool_names()]

    def tools(self) -> list[ReplayTool]:
        """The tools to give the agent: each answers with the recorded outputs."""
        return list(self._tools)

    @property
    def mismatches(self) -> list[str]:
        """Tool calls whose name or arguments differed from the recording (empty: faithful)."""
        return list(self._outputs.mismatches)

    async def create(self, request: dict[str, Any], ctx: RequestContext, *,
                     on_text_delta: TextCallback | None = None) -> dict[str, Any]:
        """The next recorded turn as a response.

        Raises:
            ModelClientError: the loop asked for more turns than the recording has (409).
        """
        index = len(self.rows)
        if index >= len(self.trajectory.turns):
            raise ModelClientError(409, f"trajectory {self.trajectory.id!r} has {len(self.trajectory.turns)} turns; "
                                        f"the replay asked for turn {index + 1}", "replay_exhausted")
        turn = self.trajectory.turns[index]
        if self.forward is not None:
            forwarded = await self.forward.create({**request, "max_output_tokens": 1}, ctx)
            usage = forwarded.get("usage") or {}
        else:
            serialize_request(request, ctx)  # the bytes a remote client would send
            usage = {"input_tokens": turn.usage.get("prompt_tokens", 0),
                     "input_tokens_details": {"cached_tokens": turn.usage.get("cached_tokens", 0)},
                     "output_tokens": turn.usage.get("completion_tokens", 0)}
        details = usage.get("input_tokens_details") or {}
        self.rows.append(ReplayRow(index + 1, last_request_bytes(ctx) or 0, conversation_chars(request),
                                   self._recorded_chars[index], int(usage.get("input_tokens") or 0),
                                   int(details.get("cached_tokens") or 0)))
        if on_text_delta is not None and turn.text:
            on_text_delta(turn.text)
        return {"id": f"replay_{self.trajectory.id}_{index}", "object": "response", "status": "completed",
                "model": request.get("model", "replay"), "output": turn.output_items(), "usage": usage}


@dataclass
class ReplayReport:
    """What :func:`replay` measured."""

    trajectory: Trajectory
    rows: list[ReplayRow]
    calls: list[tuple[str, dict[str, Any] | str]]
    mismatches: list[str]

    @property
    def calls_match(self) -> bool:
        """The replay made the recording's tool calls, in order, with its arguments."""
        recorded = [(c.name, c.arguments) for c in self.trajectory.calls()]
        return not self.mismatches and self.calls == recorded

    @property
    def sizes_match(self) -> bool:
        """Every request carried exactly the recorded conversation's characters."""
        return all(row.conversation_chars == row.recorded_chars for row in self.rows)


async def replay(trajectory: Trajectory, *, runtime: StackRuntime | None = None, forward: ModelClient | None = None,
                 max_turns: int | None = None, model: str = "default") -> ReplayReport:
    """Run ``trajectory`` through an :class:`~loopstack.harness.agent.Agent` under ``runtime``.

    ``max_turns`` cuts the session after that many turns (a prefix of it: append-only).
    """
    from loopstack.harness.agent import Agent
    from loopstack.harness.events import ToolCalled

    client = ReplayClient(trajectory, forward=forward)
    turns = len(trajectory.turns) if max_turns is None else min(max_turns, len(trajectory.turns))
    agent = Agent(client, client.tools(), instructions=trajectory.instructions, runtime=runtime,
                  max_turns=max(turns, 1), model=model)
    calls: list[tuple[str, dict[str, Any] | str]] = []
    async for event in agent.stream(trajectory.task):
        if isinstance(event, ToolCalled):
            calls.append((event.name, event.arguments))
    if max_turns is not None and turns < len(trajectory.turns):
        # a cut replay: compare against the calls of the turns that ran
        trajectory = Trajectory(trajectory.id, trajectory.format, trajectory.instructions, trajectory.task,
                                trajectory.turns[:turns])
    return ReplayReport(trajectory, client.rows, calls, client.mismatches)

