"""prefix_pinning: byte-stable requests across turns; the detector's causes, metric, log and strict mode."""

from __future__ import annotations

import itertools
import json
import logging
import re

import anyio
import pytest
from pydantic import ValidationError

from loopstack import Layer, Plugin, PluginCatalog, StackLoader, StackRuntime, hookimpl
from loopstack.bench.registry import workloads
from loopstack.context import Session
from loopstack.harness.agent import Agent
from loopstack.harness.events import Compacted
from loopstack.harness.prefix_detector import (
    STRICT_ENV,
    PrefixBreakError,
    PrefixDetector,
    detector_for,
    prefix_form,
)
from loopstack.plugins.prefix_pinning import PrefixPinningConfig
from loopstack.plugins.prefix_pinning.bench.data import bench_tools, trajectory_paths
from loopstack.plugins.prefix_pinning.config import COUNTER_PATTERN
from loopstack.plugins.prefix_pinning.volatile import (
    CONTEXT_HEADER,
    round_times,
    split_volatile_lines,
)
from tests.plugins.prefix_pinning.support import (
    PINNED,
    UNPINNED,
    ScriptedModel,
    call_item,
    catalog_with_faults,
    mcp_tools,
    message_item,
    runtime_for,
    stack_file,
    tool_turns,
)
from tests.support import SHARED_DATA

INSTRUCTIONS = "You are a careful coding agent.\nUse the tools."


def run_session(runtime, *, turns: int = 5, session: Session | None = None, instructions: str = INSTRUCTIONS,
                **agent_kwargs):
    model = ScriptedModel(tool_turns(turns))
    agent = Agent(model, mcp_tools(), instructions=instructions, runtime=runtime, session=session,
                  max_turns=turns + 2, **agent_kwargs)
    result = anyio.run(agent.run, "Fix the failing test.")
    return model, agent, result


# -- byte stability -------------------------------------------------------------------------


def test_requests_are_byte_stable_and_append_only_with_tools_in_random_order(tmp_path):
    model, agent, _ = run_session(runtime_for(tmp_path, PINNED), turns=6)
    requests = model.requests
    assert len(requests) == 7
    tool_bytes = {json.dumps(r["tools"]) for r in requests}
    assert len(tool_bytes) == 1  # the fault injector shuffled them every turn; pinned, they never move
    names = [t["name"] for t in requests[0]["tools"]]
    assert names[:3] == ["list_directory", "read_file", "write_file"]  # filesystem < github < slack, then name
    for before, after in itertools.pairwise(requests):
        assert prefix_form(after).startswith(prefix_form(before))  # append-only, byte for byte
        assert after["instructions"] == before["instructions"]  # the clock moved out of the instructions
    assert "Current date and time" not in requests[0]["instructions"]
    # the clock's context item is appended where it changed and stays there
    context = [i for i in requests[3]["input"] if CONTEXT_HEADER in str(i.get("content"))]
    assert [c["content"].rsplit(" ", 1)[-1] for c in context] == [
        "2026-11-29T10:15:42Z", "2026-11-29T10:16:19Z", "2026-11-29T10:16:56Z", "2026-11-29T10:17:33Z"]
    assert requests[3]["input"][-1] == context[-1]
    assert detector_for(agent.session).statistics().num_breaks == 0


def test_sessions_with_different_tool_orders_send_identical_bytes(tmp_path):
    first, _, _ = run_session(runtime_for(tmp_path, PINNED + "seed = 1\n", name="a"), turns=2,
                              session=Session(id="same"))
    second, _, _ = run_session(runtime_for(tmp_path, PINNED + "seed = 2\n", name="b"), turns=2,
                               session=Session(id="same"))
    assert first.bodies == second.bodies


def test_body_is_canonical_json(tmp_path):
    model, _, _ = run_session(runtime_for(tmp_path, PINNED), turns=1)
    body = model.bodies[0]
    assert body == json.dumps(json.loads(body), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    schema = model.requests[0]["tools"][0]["parameters"]
    assert list(schema) == sorted(schema) and list(schema["properties"]) == sorted(schema["properties"])


def test_without_the_plugin_the_detector_names_every_break(tmp_path):
    _, agent, _ = run_session(runtime_for(tmp_path, UNPINNED), turns=4)
    stats = detector_for(agent.session).statistics()
    assert stats.num_requests == 5 and stats.num_breaks == 4  # every request after the first
    assert stats.breaks_by_cause == {"volatile_value": 4}  # the clock comes first in prompt order
    assert any(b.also == ("tool_order",) for b in detector_for(agent.session).breaks)  # and the shuffle after it
    _, agent, _ = run_session(runtime_for(tmp_path, UNPINNED + "clock_in_instructions = false\n", name="t"),
                                     turns=4)
    causes = [b.cause for b in detector_for(agent.session).breaks]
    assert causes and set(causes) == {"tool_order"}  # a shuffle may keep the order by chance: not every turn


def test_prompt_cache_key_defaults_to_the_session_id(tmp_path):
    model, _, _ = run_session(runtime_for(tmp_path, ""), turns=1, session=Session(id="sess-42"))
    assert {r["prompt_cache_key"] for r in model.requests} == {"sess-42"}


def test_first_seen_appends_new_tools(tmp_path):
    runtime = runtime_for(tmp_path, '[plugins.prefix_pinning]\nenabled = true\ntool_order = "first_seen"\n')
    session = Session()
    tools = mcp_tools()
    model = ScriptedModel([[message_item("a")], [message_item("b")]])
    agent = Agent(model, tools[3:], instructions="x", runtime=runtime, session=session)
    anyio.run(agent.run, "one")
    agent.tools = [*tools[3:], *tools[:3]]  # github's tools arrive (a server connected mid-session)
    anyio.run(agent.run, "two")
    first, second = ([t["name"] for t in r["tools"]] for r in model.requests)
    assert second[: len(first)] == first
    assert second[len(first):] == sorted(second[len(first):])  # new ones sorted among themselves
    [prefix_break] = detector_for(session).breaks
    assert prefix_break.cause == "tools_changed" and "added" in prefix_break.detail


# -- volatile values ------------------------------------------------------------------------


def test_volatile_lines_are_split_out():
    text = "Be brief.\nToday is 2026-11-29.\ncwd: /repo\nStep 3 of 20\nKeep going."
    split = split_volatile_lines(text, PrefixPinningConfig().volatile_patterns)
    assert split.stable == "Be brief.\nStep 3 of 20\nKeep going."  # counters only when asked for
    assert split.moved == ("Today is 2026-11-29.", "cwd: /repo")
    with_counters = split_volatile_lines(text, [*PrefixPinningConfig().volatile_patterns, COUNTER_PATTERN])
    assert with_counters.moved == ("Today is 2026-11-29.", "cwd: /repo", "Step 3 of 20")


@pytest.mark.parametrize("granularity,expected", [
    ("minute", "at 2026-11-29T10:15:00Z and 09:07:00"),
    ("hour", "at 2026-11-29T10:00:00Z and 09:00:00"),
    ("day", "at 2026-11-29T00:00:00Z and 00:00:00"),
])
def test_round_floors_times(granularity, expected):
    assert round_times("at 2026-11-29T10:15:42.5Z and 9:07:59", granularity) == expected


def test_round_mode_keeps_the_clock_in_place_but_stable(tmp_path):
    body = PINNED.replace("enabled = true\n", 'enabled = true\nvolatile = "round"\nround_to = "day"\n', 1)
    model, agent, _ = run_session(runtime_for(tmp_path, body), turns=3)
    assert {r["instructions"] for r in model.requests} == {INSTRUCTIONS + "\n\nCurrent date and time: 2026-11-29T00:00:00Z"}
    assert detector_for(agent.session).statistics().num_breaks == 0


def test_bad_volatile_pattern_is_a_config_error():
    with pytest.raises(ValidationError, match="not a valid regular expression"):
        PrefixPinningConfig(volatile_patterns=["(unclosed"])


# -- the detector on constructed breaks -----------------------------------------------------


def _tool(name: str, **properties: str) -> dict:
    return {"type": "function", "name": name, "description": f"does {name}",
            "parameters": {"type": "object", "properties": {k: {"type": v} for k, v in properties.items()}}}


BASE = {
    "model": "m",
    "instructions": "Be careful.\nNow: 2026-11-29T10:15:42Z",
    "tools": [_tool("a", x="string"), _tool("b", y="integer"), _tool("c")],
    "input": [{"type": "message", "role": "user", "content": "task"}, message_item("thinking"),
              call_item("a", {"x": "1"}, "c1"), {"type": "function_call_output", "call_id": "c1", "output": "42"}],
}


def _changed(**changes) -> dict:
    return json.loads(json.dumps({**BASE, **changes}))


def _extended(request: dict) -> dict:
    return {**request, "input": [*request["input"], message_item("more")]}


CASES = {
    "tool_order": (_changed(tools=[BASE["tools"][1], BASE["tools"][0], BASE["tools"][2]]), "tools[0].name"),
    "tools_changed": (_changed(tools=[*BASE["tools"], _tool("d")]), "input[0]"),
    "instructions_changed": (_changed(instructions="Be reckless.\nNow: 2026-11-29T10:15:42Z"), "instructions"),
    "volatile_value": (_changed(instructions="Be careful.\nNow: 2026-11-29T10:16:19Z"), "instructions"),
    "history_rewritten": (_changed(input=[*BASE["input"][:3], {**BASE["input"][3], "output": "41"}]),
                          "input[3].output"),
    "other": (_changed(model="other-model"), "model"),
}


@pytest.mark.parametrize("cause", sorted(CASES))
def test_detector_labels_constructed_breaks(cause):
    changed, field = CASES[cause]
    detector = PrefixDetector()
    assert detector.check(BASE, session_id="s") is None
    new = _extended(changed)
    prefix_break = detector.check(new, session_id="s")
    assert prefix_break is not None and prefix_break.cause == cause
    assert prefix_break.field.startswith(field), prefix_break.field
    old_form, new_form = prefix_form(BASE), prefix_form(new)
    offset = prefix_break.byte_offset
    assert old_form[:offset] == new_form[:offset] and old_form[offset] != new_form[offset]
    assert prefix_break.request_index == 2 and prefix_break.detail


def test_detector_on_removed_items_schema_key_order_and_compaction():
    removed = PrefixDetector()
    removed.check(BASE)
    assert removed.check({**BASE, "input": BASE["input"][:2]}).cause == "history_rewritten"
    reordered = PrefixDetector()
    reordered.check(BASE)
    schema = BASE["tools"][1]["parameters"]
    tools = [BASE["tools"][0], {**BASE["tools"][1], "parameters": {"properties": schema["properties"], "type": "object"}},
             BASE["tools"][2]]
    found = reordered.check({**BASE, "tools": tools})
    assert found.cause == "tools_changed" and found.field == "tools[1].parameters (key order)"
    compacted = PrefixDetector()
    compacted.check(BASE)
    assert compacted.check({**BASE, "input": BASE["input"][:1]}, is_compaction=True).cause == "compaction"


def test_appended_request_is_not_a_break_and_ephemeral_tail_is_ignored():
    detector = PrefixDetector()
    with_context = {**BASE, "input": [*BASE["input"], {"type": "message", "role": "developer", "content": "t=1"}]}
    detector.check(with_context, num_ephemeral_tail_items=1)
    assert detector.check(_extended(BASE)) is None
    strict = PrefixDetector()
    strict.check(with_context)  # not marked ephemeral: the next request must repeat it
    assert strict.check(_extended(BASE)).cause == "history_rewritten"


def test_token_offset_when_token_ids_are_given():
    detector = PrefixDetector()
    detector.check(BASE, token_ids=[1, 2, 3, 4, 5])
    found = detector.check(CASES["history_rewritten"][0], token_ids=[1, 2, 3, 9, 5, 6])
    assert found.token_offset == 3


# -- metric, log line, strict mode ----------------------------------------------------------


def test_breaks_are_counted_by_cause_and_logged(tmp_path, caplog):
    runtime = runtime_for(tmp_path, UNPINNED)
    with caplog.at_level(logging.WARNING, logger="loopstack.prefix"):
        _, agent, _ = run_session(runtime, turns=3)
    counter = runtime.metrics.counter("prefix_breaks_total", "", ("cause",))
    assert counter.value(plugin="kernel", arm="default", cause="volatile_value") == 3
    [first, *_] = [r for r in caplog.records if r.name == "loopstack.prefix"]
    assert first.levelno == logging.WARNING
    message = first.getMessage()
    assert re.search(rf"session {agent.session.id} request 2: volatile_value at byte \d+ \(instructions\)", message)
    assert 'volatile = \\"append\\"' in message or 'volatile = "append"' in message


def test_strict_session_raises_on_the_first_break(tmp_path):
    session = Session()
    detector_for(session).strict = True
    with pytest.raises(PrefixBreakError) as caught:
        run_session(runtime_for(tmp_path, UNPINNED), turns=3, session=session)
    assert caught.value.prefix_break.cause == "volatile_value" and caught.value.prefix_break.request_index == 2


def test_strict_env_raises(tmp_path, monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(PrefixBreakError):
        run_session(runtime_for(tmp_path, UNPINNED), turns=2)


class HistoryEditor(Plugin):
    """A third-party plugin that (wrongly) trims old tool outputs in place."""

    name = "history_editor"
    layers = (Layer.HARNESS,)

    @hookimpl
    def loopstack_prepare_request(self, request, ctx):
        outputs = [i for i in request["input"] if i.get("type") == "function_call_output"]
        for item in outputs[:-1]:
            item["output"] = item["output"][:5]


def test_strict_plugin_config_catches_a_third_party_plugin(tmp_path):
    catalog = catalog_with_faults()
    catalog.add_plugin(HistoryEditor, source="tests")
    path = stack_file(tmp_path, "strict", PINNED.replace("enabled = true\n", "enabled = true\nstrict = true\n", 1)
                      + "\n[plugins.history_editor]\nenabled = true\n")
    runtime = StackRuntime(StackLoader(catalog).load(path), catalog)
    with pytest.raises(PrefixBreakError) as caught:
        run_session(runtime, turns=4)
    found = caught.value.prefix_break
    assert found.cause == "history_rewritten" and found.field.endswith(".output")


def test_explicit_compaction_is_counted_never_raised(tmp_path):
    session = Session()
    detector_for(session).strict = True
    model = ScriptedModel(tool_turns(6))
    tools = mcp_tools()
    for tool in tools:
        tool.output = "x" * 3000
    agent = Agent(model, tools, instructions=INSTRUCTIONS, runtime=runtime_for(tmp_path, PINNED),
                  session=session, max_turns=8, context_window=4000, keep_recent_turns=1)
    result = anyio.run(agent.run, "go")
    assert any(isinstance(e, Compacted) for e in result.events)
    assert "compaction" in detector_for(session).statistics().breaks_by_cause


def test_a_break_names_what_else_changed_further_on():
    detector = PrefixDetector()
    detector.check(BASE)
    both = _changed(instructions="Be careful.\nNow: 2026-11-29T11:00:00Z", tools=BASE["tools"][::-1])
    found = detector.check(_extended(both))
    assert (found.cause, found.also) == ("volatile_value", ("tool_order",))
    assert "also further on: tool_order" in found.log_line()


def test_a_context_item_is_appended_only_when_the_value_changes(tmp_path):
    body = PINNED + "seconds_per_turn = 0\n"  # the clock stands still
    model, _, _ = run_session(runtime_for(tmp_path, body), turns=3)
    counts = [sum(CONTEXT_HEADER in str(i.get("content")) for i in r["input"]) for r in model.requests]
    assert counts == [1, 1, 1, 1]
    assert model.requests[0]["input"][-1]["role"] == "developer"  # after the task, before the first answer
    assert CONTEXT_HEADER in model.requests[3]["input"][1]["content"]


# -- the bench's pieces ---------------------------------------------------------------------


def test_prefix_workload_is_registered_with_two_columns():
    workload = workloads(PluginCatalog.discover(use_entry_points=False, env={}))["prefix"]
    assert workload.columns([]) == ["unpinned", "pinned"]


@pytest.mark.needs_data
@pytest.mark.skipif(not (SHARED_DATA / "github_mcp_tools").is_dir(), reason=f"needs {SHARED_DATA} (absent)")
def test_bench_lists_real_tools_of_two_mcp_servers_and_finds_the_sessions():
    tools = bench_tools(SHARED_DATA)
    assert [t.info.namespace for t in tools] == ["github"] * 6 + ["clickhouse"] * 3
    assert all(t.info.parameters.get("type") == "object" for t in tools)
    assert len(trajectory_paths(SHARED_DATA)) == 5
