"""A/B: an experiment splits sessions between Code Mode on and off; `loopstack ab report` shows the effect."""

from __future__ import annotations

import json
from typing import Any

from loopstack import Session
from loopstack.cli.ab_report import compare_arms
from loopstack.cli.main import main
from loopstack.harness.agent import Agent
from loopstack.harness.events import ModelCalled
from loopstack.harness.tools.tool import python_tool
from tests.plugins.code_mode.support import ScriptedModel, call_item, exec_item, run, runtime_for, text_item

AB_STACK = """
[plugins.code_mode]
enabled = true

[experiments.code]
plugin = "code_mode"
arms = { on = 0.5, off = 0.5 }
unit = "session"
"""

REPOS = [{"name": f"repo-{i}", "stars": (i * 37) % 1000, "description": f"project number {i} " + "lorem " * 20}
         for i in range(120)]


@python_tool(is_concurrency_safe=True)
def list_repos() -> list[dict]:
    """Every repository with its star count and description."""
    return REPOS


@python_tool(is_concurrency_safe=True)
def repo_owner(name: str) -> dict:
    """The owner of one repository."""
    return {"name": name, "owner": f"owner-of-{name}", "members": [f"user-{k}" for k in range(40)]}


class TaskModel(ScriptedModel):
    """Plays one task: "who owns the two most-starred repositories?". With ``exec`` it writes
    one program; without, it makes the calls one dependent step per round trip."""

    async def create(self, request: dict[str, Any], ctx: Any, **_: Any) -> dict[str, Any]:
        self.requests.append(request)
        tools = {t["name"] for t in request.get("tools", [])}
        outputs = [i for i in request["input"] if i.get("type") == "function_call_output"]
        if "exec" in tools:
            program = """
                const top = (await tools.list_repos({})).sort((a, b) => b.stars - a.stars).slice(0, 2);
                return await Promise.all(top.map(r => tools.repo_owner({name: r.name}).then(o => o.owner)));
            """
            output = [exec_item(program)] if not outputs else [text_item(outputs[-1]["output"])]
        elif not outputs:
            output = [call_item("list_repos", {}, "c-list")]
        elif len(outputs) == 1:
            top = sorted(json.loads(outputs[0]["output"]), key=lambda r: -r["stars"])[:2]
            output = [call_item("repo_owner", {"name": r["name"]}, f"c-{r['name']}") for r in top]
        else:
            output = [text_item(json.dumps([json.loads(o["output"])["owner"] for o in outputs[1:]], separators=(",", ":")))]
        return {"output": output, "usage": {"input_tokens": 1, "output_tokens": 1}}


def test_ab_report_shows_fewer_round_trips_and_context_bytes_with_code_mode(tmp_path, capsys):
    runtime = runtime_for(tmp_path, AB_STACK)
    answers: dict[str, set[str]] = {}

    async def session(index: int) -> None:
        one = Session(id=f"session-{index}")
        result = await Agent(TaskModel([]), [list_repos, repo_owner], instructions="", runtime=runtime,
                             session=one).run("Who owns the two most-starred repositories?")
        # the harness's per-session figures, labelled with the session's arm like every metric
        ctx = runtime.context(session=one)
        context_bytes = max(e.request_bytes for e in result.events if isinstance(e, ModelCalled))
        ctx.observe("session_round_trips", result.turns)
        ctx.observe("session_context_bytes", context_bytes)
        answers.setdefault(ctx.arm("code_mode"), set()).add(result.final_text)

    async def sessions() -> None:
        for index in range(40):
            await session(index)

    run(sessions, timeout_s=60)
    assert set(answers) == {"on", "off"}
    assert answers["on"] == answers["off"] == {'["owner-of-repo-27","owner-of-repo-54"]'}

    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps(runtime.metrics.snapshot()))
    comparisons = {c.metric: c for c in compare_arms(json.loads(path.read_text()))}
    round_trips = comparisons["session_round_trips"].ratios["on"]
    assert round_trips[0] == 2 / 3 and round_trips[1] == round_trips[2] == 2 / 3
    _, _, high = comparisons["session_context_bytes"].ratios["on"]
    assert high < 0.2  # the 120 repository records never enter the context

    assert main(["ab", "report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "code_mode / session_round_trips (histogram" in out and "reference arm: off" in out
    assert "ratio: 0.667 [0.667, 0.667]" in out
    assert "code_mode / session_context_bytes" in out
