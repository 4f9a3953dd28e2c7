"""Trajectories load in both formats; a replay reproduces the recorded calls and request sizes."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from loopstack.harness.agent import Agent
from loopstack.harness.clients.base import ModelClientError
from loopstack.harness.clients.replay import ReplayClient, replay
from loopstack.harness.trajectory import (
    TrajectoryError,
    conversation_chars,
    load_trajectory,
)
from tests.support import SHARED_DATA

TRAJECTORIES = SHARED_DATA / "trajectories" / "swebench_minisweagent"
needs_trajectories = pytest.mark.skipif(
    not TRAJECTORIES.is_dir(), reason=f"real trajectories live in {TRAJECTORIES} (../shared/data is absent)"
)


def _openai_session(path: Path) -> Path:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ]},
        {"role": "tool", "tool_call_id": "a", "content": "18C"},
        {"role": "tool", "tool_call_id": "b", "content": "24C"},
        {"role": "assistant", "content": "Paris 18C, Rome 24C."},
    ]
    path.write_text(json.dumps({"messages": messages}))
    return path


def test_openai_message_list_replays_calls_and_final_answer(tmp_path):
    trajectory = load_trajectory(_openai_session(tmp_path / "s.json"))
    assert trajectory.format == "openai-messages" and trajectory.instructions == "You are terse."
    assert [len(t.calls) for t in trajectory.turns] == [2, 0]
    report = anyio.run(replay, trajectory)
    assert report.calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert report.calls_match and report.sizes_match and len(report.rows) == 2
    assert report.rows[1].conversation_chars == len("You are terse.Weather in Paris and Rome?Checking both.18C24C")


def test_replay_notices_a_stack_that_changes_the_calls(tmp_path):
    trajectory = load_trajectory(_openai_session(tmp_path / "s.json"))
    client = ReplayClient(trajectory)
    tool = client.tools()[0]
    anyio.run(tool.call, {"city": "Oslo"})
    assert client.mismatches and "Oslo" in client.mismatches[0]


def test_replay_past_the_recording_is_a_clear_error(tmp_path):
    trajectory = load_trajectory(_openai_session(tmp_path / "s.json"))
    client = ReplayClient(trajectory)
    ctx = Agent(client, [], instructions="").runtime.context()

    async def main():
        for _ in range(3):
            await client.create({"input": "x"}, ctx)

    with pytest.raises(ModelClientError, match="has 2 turns") as caught:
        anyio.run(main)
    assert caught.value.code == "replay_exhausted"


@pytest.mark.parametrize("content,message", [
    (None, "no such trajectory"),
    ("{not json", "not a readable JSON"),
    ('{"hello": 1}', "unknown trajectory format"),
    ('[{"role": "assistant", "content": "x"}]', "user's task"),
    ('{"trajectory_format": "mini-swe-agent-1", "messages": []}', "starts with a system"),
])
def test_bad_trajectory_files_name_the_file_and_the_problem(tmp_path, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TrajectoryError, match=message) as caught:
        load_trajectory(path)
    assert "bad.json" in str(caught.value)


def test_conversation_chars_counts_texts_and_outputs_only():
    request = {"instructions": "abc", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]},
        {"type": "function_call", "call_id": "x", "name": "t", "arguments": '{"long": "ignored"}'},
        {"type": "function_call_output", "call_id": "x", "output": "12"},
    ]}
    assert conversation_chars(request) == 3 + 5 + 2


@pytest.mark.needs_data
@needs_trajectories
@pytest.mark.parametrize("path", sorted(TRAJECTORIES.glob("full_trajectories/*.traj.json")) or [None],
                         ids=lambda p: p.name.split(".")[0] if p else "none")
def test_real_swe_bench_session_replays_faithfully(path):
    trajectory = load_trajectory(path)
    report = anyio.run(replay, trajectory)
    lines = (TRAJECTORIES / "per_turn_usage.jsonl").read_text().splitlines()
    recorded = [json.loads(line) for line in lines if f'"{trajectory.id}"' in line]
    recorded = [r for r in recorded if r["instance_id"] == trajectory.id]
    # the same tool calls, in order, with the recorded commands (the dataset's own table)
    assert report.calls_match
    assert [args["command"][:500] for _, args in report.calls] == [r["command"] for r in recorded]  # table cuts at 500
    # and every request carries exactly the recorded prompt's characters
    assert [row.conversation_chars for row in report.rows] == [r["prompt_chars_before"] for r in recorded]
    assert [row.input_tokens for row in report.rows] == [r["prompt_tokens"] for r in recorded]
    sizes = [row.request_bytes for row in report.rows]
    assert sizes == sorted(sizes) and sizes[0] > 0  # append-only: every request is larger


@pytest.mark.needs_data
@needs_trajectories
def test_cut_replay_is_a_prefix_of_the_session():
    trajectory = load_trajectory(TRAJECTORIES / "full_trajectories" / "django__django-10097.traj.json")
    report = anyio.run(lambda: replay(trajectory, max_turns=5))
    assert len(report.rows) == 5 and report.calls_match and report.sizes_match
