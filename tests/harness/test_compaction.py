"""Compaction: explicit, counted, oldest first, never splitting a call from its output."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from loopstack.harness.agent import Agent
from loopstack.harness.compaction import compact, estimate_tokens
from loopstack.harness.events import Compacted, FinalAnswer
from loopstack.harness.tools.tool import python_tool


def _user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def _turn(n: int, output_chars: int) -> list[dict[str, Any]]:
    return [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"step {n}"}]},
        {"type": "function_call", "call_id": f"c{n}", "name": "read", "arguments": json.dumps({"n": n})},
        {"type": "function_call_output", "call_id": f"c{n}", "output": "x" * output_chars},
    ]


def _conversation(turns: int, output_chars: int = 3000) -> list[dict[str, Any]]:
    items = [_user("the task")]
    for n in range(turns):
        items += _turn(n, output_chars)
    return items


def _tokens(items: list[dict[str, Any]]) -> int:
    return sum(estimate_tokens(json.dumps(i)) for i in items)


def test_items_that_fit_come_back_unchanged():
    items = _conversation(3, 100)
    result = compact(items, fixed_tokens=10, budget=10_000)
    assert not result.changed and result.items == items and result.tokens_after == result.tokens_before


def test_old_tool_outputs_are_elided_first_and_recent_turns_kept():
    items = _conversation(6)
    budget = _tokens(items) - 1800  # eliding two ~975-token outputs suffices, one does not
    result = compact(items, fixed_tokens=0, budget=budget, keep_recent_turns=2)
    assert result.changed and result.num_dropped == 0 and result.num_elided == 2
    outputs = [i["output"] for i in result.items if i["type"] == "function_call_output"]
    assert outputs[0].startswith("[compacted: 3000 characters") and outputs[1].startswith("[compacted")
    assert outputs[2:] == ["x" * 3000] * 4  # only as much as needed, oldest first
    assert result.tokens_after <= budget < result.tokens_before
    assert items[3]["output"] == "x" * 3000  # the input list is not mutated


def test_whole_turns_are_dropped_when_elision_is_not_enough():
    items = _conversation(6) + [_user("a follow-up")] + _turn(6, 3000)
    result = compact(items, fixed_tokens=0, budget=2500, keep_recent_turns=2)
    assert result.num_dropped > 0
    kinds = [(i["type"], i.get("role")) for i in result.items]
    assert kinds.count(("message", "user")) == 2  # user messages survive
    calls = {i["call_id"] for i in result.items if i["type"] == "function_call"}
    outputs = {i["call_id"] for i in result.items if i["type"] == "function_call_output"}
    assert calls == outputs  # never a call without its output, nor an output without its call
    assert {"c5", "c6"} <= calls  # the last two turns are protected
    assert result.items[-3:] == _turn(6, 3000)


def test_protected_turns_are_never_touched_even_over_budget():
    items = _conversation(2)
    result = compact(items, fixed_tokens=0, budget=10, keep_recent_turns=2)
    assert not result.changed


class _BigOutputs:
    """A scripted model that reads a large file each turn, then answers."""

    def __init__(self, turns: int) -> None:
        self.turns = turns
        self.requests: list[dict[str, Any]] = []

    async def create(self, request: dict[str, Any], ctx: Any) -> dict[str, Any]:
        self.requests.append(json.loads(json.dumps(request)))
        n = len(self.requests)
        if n > self.turns:
            output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}]
        else:
            output = [{"type": "function_call", "call_id": f"c{n}", "name": "read_file", "arguments": '{"n": %d}' % n}]
        return {"output": output, "usage": {"input_tokens": 1, "output_tokens": 1}}


@python_tool
def read_file(n: int) -> str:
    """Read a big file."""
    return f"file {n}: " + "y" * 1500


def test_agent_compacts_near_the_window_as_one_counted_event():
    model = _BigOutputs(turns=14)
    agent = Agent(model, [read_file], instructions="Read files.", context_window=4096, max_turns=20,
                  max_output_tokens=64)
    result = anyio.run(agent.run, "read them all")
    compactions = [e for e in result.events if isinstance(e, Compacted)]
    assert compactions and agent.num_compactions == len(compactions)
    assert all(e.tokens_after < e.tokens_before for e in compactions)
    assert isinstance(result.events[-1], FinalAnswer)
    for request in model.requests:  # every request the model saw fits the trigger
        size = sum(estimate_tokens(json.dumps(i)) for i in request["input"])
        assert size <= 0.8 * 4096
    metrics = {m["name"]: m for m in agent.runtime.metrics.snapshot()["metrics"]}
    series = metrics["loopstack_harness_compactions_total"]["series"]
    assert series and all(s["value"] == len(compactions) for s in series)


def test_no_window_means_no_compaction_and_bad_settings_are_refused():
    model = _BigOutputs(turns=3)
    agent = Agent(model, [read_file], instructions="", max_turns=5)
    result = anyio.run(agent.run, "go")
    assert not any(isinstance(e, Compacted) for e in result.events)
    with pytest.raises(ValueError, match="compact_target"):
        Agent(model, [], instructions="", compact_at=0.5, compact_target=0.9)


def test_tools_loaded_by_a_search_survive_compaction():
    from loopstack.api.conversation import loaded_tools

    search = [
        {"type": "function_call", "call_id": "s1", "name": "tool_search", "arguments": '{"query": "deploy"}'},
        {"type": "tool_search_output", "call_id": "s1", "output": "found 1 " + "z" * 3000,
         "tools": [{"type": "function", "name": "deploy", "description": "Deploy.", "parameters": {"type": "object"}}]},
    ]
    items = [_user("the task"), *search, *_conversation(6)[1:]]
    result = compact(items, fixed_tokens=0, budget=500, keep_recent_turns=2)
    assert result.changed and result.num_dropped > 0
    assert [t.name for t in loaded_tools(result.items)] == ["deploy"]
    kept = {i["call_id"] for i in result.items if i["type"] in ("function_call", "tool_search_output")}
    assert "s1" in kept and str(next(i for i in result.items if i.get("call_id") == "s1" and
                                     i["type"] == "tool_search_output")["output"]).startswith("[compacted")
