"""The ``code-mode`` benchmark workload: its scripted model, and a quick run on the real data."""

from __future__ import annotations

import json

import anyio
import pytest

from loopstack import PluginCatalog, StackLoader
from loopstack.bench import BenchOptions, run_bench
from loopstack.plugins import code_mode
from loopstack.plugins.code_mode.bench.tasks import Call, Task
from loopstack.plugins.code_mode.bench.workload import CodeModeWorkload, TaskModel
from tests.plugins.code_mode.support import run
from tests.support import REPO, SHARED_DATA

STACKS = REPO / "plugins" / "code_mode" / "stacks"


def two_step_task() -> Task:
    return Task(
        name="demo",
        question="?",
        levels=(lambda _: [Call("a", "first", {}), Call("b", "first", {"k": 1})],
                lambda out: [Call("c", "second", {"x": out["a"]["v"] + out["b"]["v"]})]),
        answer=lambda out: out["c"],
        program="return 1",
    )


def request(tools: list[str], outputs: dict[str, str]) -> dict:
    items = [{"type": "function_call_output", "call_id": k, "output": v} for k, v in outputs.items()]
    return {"input": [{"type": "message", "role": "user", "content": "?"}, *items],
            "tools": [{"name": name} for name in tools]}


def calls(response: dict) -> list[tuple[str, str]]:
    return [(i["call_id"], i["name"]) for i in response["output"] if i["type"] == "function_call"]


def test_the_workload_is_registered_through_the_discovery_hook():
    [workload] = code_mode.loopstack_bench_workloads()
    assert isinstance(workload, CodeModeWorkload) and workload.name == "code-mode"


def test_scripted_model_makes_each_dependent_step_in_one_turn():
    model = TaskModel(two_step_task())

    async def main():
        first = await model.create(request(["first", "second"], {}), None)
        second = await model.create(request(["first", "second"], {"a": '{"v": 1}', "b": '{"v": 2}'}), None)
        final = await model.create(request(["first", "second"], {"a": '{"v": 1}', "b": '{"v": 2}', "c": '"done"'}), None)
        return first, second, final

    first, second, final = run(main)
    assert calls(first) == [("a", "first"), ("b", "first")]
    assert calls(second) == [("c", "second")] and json.loads(second["output"][0]["arguments"]) == {"x": 3}
    assert final["output"][0]["content"][0]["text"] == '"done"'


def test_scripted_model_one_call_per_turn_and_with_exec():
    sequential = TaskModel(two_step_task(), calls_per_turn=1)
    with_exec = TaskModel(two_step_task())

    async def main():
        return (await sequential.create(request(["first"], {}), None),
                await sequential.create(request(["first"], {"a": '{"v": 1}'}), None),
                await with_exec.create(request(["first", "exec"], {}), None),
                await with_exec.create(request(["first", "exec"], {"exec": "[1]"}), None))

    one, two, program, answer = run(main)
    assert calls(one) == [("a", "first")] and calls(two) == [("b", "first")]
    assert calls(program) == [("exec", "exec")] and json.loads(program["output"][0]["arguments"]) == {"code": "return 1"}
    assert answer["output"][0]["content"][0]["text"] == "[1]"


def test_columns_add_one_call_per_turn_for_stacks_without_code_mode():
    loader = StackLoader(PluginCatalog.discover(use_entry_points=False, env={}))
    stacks = [loader.load("baseline"), loader.load(STACKS / "code-mode.toml")]
    assert CodeModeWorkload().columns(stacks) == ["baseline", "baseline/one-call-per-turn", "code-mode"]


@pytest.mark.slow
@pytest.mark.needs_data
@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"real data not found at {SHARED_DATA}; skipping")
def test_quick_run_on_the_registry_data():
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    loader = StackLoader(catalog)
    stacks = [loader.load("baseline"), loader.load(STACKS / "code-mode.toml")]
    options = BenchOptions(quick=True, data_dir=SHARED_DATA)
    result = anyio.run(lambda: run_bench(CodeModeWorkload(), stacks, options, progress=False))
    m = result.metrics
    for task in ("fanout5", "fanout20", "chain_filter", "join"):
        for name in ("round_trips", "context_tokens", "prompt_tokens", "wall_s"):
            assert set(m[f"{name}.{task}"]) == {"baseline", "baseline/one-call-per-turn", "code-mode"}
    # every column reached the same answers (the step raises otherwise); the effect:
    assert m["round_trips.fanout20"] == {"baseline": 2, "baseline/one-call-per-turn": 21, "code-mode": 2}
    assert m["round_trips.chain_filter"]["code-mode"] == 2 and m["round_trips.chain_filter"]["baseline"] == 3
    for task in ("fanout20", "chain_filter"):
        assert m[f"context_tokens.{task}"]["code-mode"] * 10 < m[f"context_tokens.{task}"]["baseline"]
    assert m["wall_s.fanout20"]["code-mode"] < m["wall_s.fanout20"]["baseline/one-call-per-turn"] / 4
    assert set(m["exec_overhead_ms"]) == {"code-mode"} and m["exec_overhead_ms"]["code-mode"] > 0
    assert result.config["v8_cold_start_ms"] > 0
