"""tool_search in the agent loop: deferral, search results appended at the end, the deferred-
call fallback, bad input, incremental catalog updates, metrics."""

from __future__ import annotations

import itertools
import json

import anyio

from loopstack.context import Session
from loopstack.harness.agent import Agent
from loopstack.plugins.tool_search.search import SEARCH_TOOL_NAME
from tests.plugins.tool_search.support import (
    ON,
    ScriptedModel,
    answer,
    call,
    github_tools,
    runtime_with,
)


def _run(tmp_path, outputs, *, stack=ON, tools=None, session=None, items=None):
    model = ScriptedModel(outputs)
    agent = Agent(model, tools or github_tools(), instructions="Use tools.", runtime=runtime_with(tmp_path, stack),
                  session=session, items=items, max_turns=8)
    result = anyio.run(agent.run, "open an issue about the crash in acme/app")
    return model, agent, result


def _names(request):
    return [tool["name"] for tool in request.get("tools", [])]


def test_mcp_tools_are_deferred_behind_one_search_tool(tmp_path):
    model, _, _ = _run(tmp_path, [[answer("ok")]])
    [request] = model.requests
    assert _names(request) == ["read_notes", SEARCH_TOOL_NAME]  # local tool stays, github ones wait
    description = request["tools"][1]["description"]
    assert "- github (4 tools:" in description and "issue" in description


def test_always_loaded_and_defer_modes(tmp_path):
    stack = ON + 'always_loaded = ["list_issues"]\n'
    model, _, _ = _run(tmp_path, [[answer("ok")]], stack=stack)
    assert _names(model.requests[0]) == ["list_issues", "read_notes", SEARCH_TOOL_NAME]
    model, _, _ = _run(tmp_path, [[answer("ok")]], stack=ON + 'defer = "all"\nalways_loaded = ["read_notes"]\n')
    assert _names(model.requests[0]) == ["read_notes", SEARCH_TOOL_NAME]
    model, _, _ = _run(tmp_path, [[answer("ok")]], stack=ON + 'defer = "marked"\n')
    assert SEARCH_TOOL_NAME not in _names(model.requests[0])  # nothing deferred: no search tool
    assert len(_names(model.requests[0])) == 5


def test_search_loads_schemas_at_the_end_and_they_are_callable(tmp_path):
    outputs = [
        [call(SEARCH_TOOL_NAME, {"query": "open a new issue", "limit": 2}, "c1")],
        [call("create_issue", {"owner": "acme", "repo": "app", "title": "crash"}, "c2")],
        [answer("filed")],
    ]
    model, agent, result = _run(tmp_path, outputs)
    assert result.final_text == "filed"
    search_item = next(i for i in agent.items if i.get("call_id") == "c1" and i["type"] != "function_call")
    assert search_item["type"] == "tool_search_output"
    loaded = [tool["name"] for tool in search_item["tools"]]
    assert loaded[0] == "create_issue" and len(loaded) == 2
    assert search_item["tools"][0]["parameters"]["required"] == ["owner", "repo", "title"]
    created = next(i for i in agent.items if i.get("call_id") == "c2" and i["type"] == "function_call_output")
    assert json.loads(created["output"])["created"] == "acme/app#1"
    # prefix preservation: each request extends the previous one; the tool list never changes
    for before, after in itertools.pairwise(model.requests):
        assert after["tools"] == before["tools"] and after["instructions"] == before["instructions"]
        assert after["input"][: len(before["input"])] == before["input"]
        head = json.dumps([before["instructions"], before["tools"], before["input"]])[:-2]
        assert json.dumps([after["instructions"], after["tools"], after["input"]]).startswith(head)


def test_finding_a_loaded_tool_again_adds_nothing(tmp_path):
    outputs = [
        [call(SEARCH_TOOL_NAME, {"query": "open a new issue", "limit": 1}, "c1")],
        [call(SEARCH_TOOL_NAME, {"query": "create_issue", "limit": 1}, "c2")],
        [answer("ok")],
    ]
    _, agent, _ = _run(tmp_path, outputs)
    first, second = (next(i for i in agent.items if i.get("call_id") == c and i["type"] != "function_call")
                     for c in ("c1", "c2"))
    assert first["type"] == "tool_search_output" and [t["name"] for t in first["tools"]] == ["create_issue"]
    assert second["type"] == "function_call_output" and "Already loaded: create_issue" in second["output"]


def test_calling_a_deferred_tool_by_name_without_a_search_runs_and_loads_it(tmp_path):
    outputs = [[call("list_issues", {"owner": "acme", "repo": "app"}, "c1")], [answer("one issue")]]
    model, agent, result = _run(tmp_path, outputs)
    item = next(i for i in agent.items if i.get("call_id") == "c1" and i["type"] != "function_call")
    assert item["type"] == "tool_search_output"  # the result, plus the schema for next time
    assert json.loads(item["output"])[0]["title"] == "crash on start"
    assert [t["name"] for t in item["tools"]] == ["list_issues"]
    assert result.final_text == "one issue" and "list_issues" not in _names(model.requests[-1])


def test_bad_input_comes_back_as_readable_results(tmp_path):
    huge = "merge the pull request " + "lorem ipsum " * 5000  # cut to max_query_chars, still found
    outputs = [[
        call(SEARCH_TOOL_NAME, {"query": "   "}, "empty"),
        call(SEARCH_TOOL_NAME, {"query": huge}, "huge"),
        call(SEARCH_TOOL_NAME, {"query": "quantum teleportation of cats"}, "nothing"),
        call(SEARCH_TOOL_NAME, {"query": "issue", "limit": 0}, "limit"),
        call(SEARCH_TOOL_NAME, {"q": "issue"}, "extra"),
        call("delete_everything", {}, "unknown"),
    ], [answer("ok")]]
    _, _, result = _run(tmp_path, outputs)
    results = {e.call_id: e for e in result.events if hasattr(e, "call_id") and hasattr(e, "is_error")}
    empty = results["empty"]
    assert empty.is_error and "non-empty query" in empty.result_text and "- github" in empty.result_text
    assert not results["huge"].is_error and "merge_pull_request" in results["huge"].result_text
    assert not results["nothing"].is_error and "No tools match" in results["nothing"].result_text
    assert "- github (4 tools)" in results["nothing"].result_text
    assert results["limit"].is_error and "limit" in results["limit"].result_text
    assert results["extra"].is_error and "query" in results["extra"].result_text
    assert results["unknown"].is_error and "unknown tool 'delete_everything'" in results["unknown"].result_text


def test_a_resumed_conversation_remembers_what_it_loaded(tmp_path):
    _, agent, _ = _run(tmp_path, [[call(SEARCH_TOOL_NAME, {"query": "open a new issue", "limit": 1}, "c1")],
                                  [answer("ok")]])
    _, resumed, _ = _run(tmp_path, [[call(SEARCH_TOOL_NAME, {"query": "create_issue", "limit": 1}, "c9")],
                                    [answer("ok")]], items=agent.items, session=Session())
    item = next(i for i in resumed.items if i.get("call_id") == "c9" and i["type"] != "function_call")
    assert item["type"] == "function_call_output" and "Already loaded" in item["output"]


def test_a_changed_server_list_updates_the_index_incrementally(tmp_path):
    runtime = runtime_with(tmp_path, ON)
    plugin = runtime.instance("tool_search")
    session = Session()

    def turn(tools, query):
        model = ScriptedModel([[call(SEARCH_TOOL_NAME, {"query": query, "limit": 1}, "c")], [answer("ok")]])
        agent = Agent(model, tools, instructions="", runtime=runtime, session=session)
        anyio.run(agent.run, "go")
        return next(i for i in agent.items if i.get("call_id") == "c" and i["type"] != "function_call")

    turn(github_tools(), "read a file")
    [catalog] = plugin.catalogs.catalogs()
    built = catalog.index.statistics()
    assert built.num_docs == 4 and built.num_upserts == 4
    item = turn(github_tools(" or a security advisory"), "security advisory")  # the server changed one tool
    after = catalog.index.statistics()
    assert after.num_upserts == built.num_upserts + 1 and after.num_removes == built.num_removes + 1
    assert [t["name"] for t in item["tools"]] == ["create_issue"]
    turn(github_tools(" or a security advisory"), "merge")  # unchanged list: no index work
    assert catalog.index.statistics().num_upserts == after.num_upserts


def test_metrics_count_searches_loads_and_sessions(tmp_path):
    outputs = [[call(SEARCH_TOOL_NAME, {"query": "open a new issue", "limit": 2}, "c1")],
               [call("merge_pull_request", {"owner": "a", "repo": "b", "number": 3}, "c2")], [answer("ok")]]
    _, agent, _ = _run(tmp_path, outputs)
    metrics = {m["name"]: m for m in agent.runtime.metrics.snapshot()["metrics"]}

    def total(name):
        return sum(s["value"] for s in metrics[name]["series"])

    assert total("tool_search_searches_total") == 1
    assert total("tool_search_loaded_tools_total") == 3  # two found, one called directly
    assert total("tool_search_direct_loads_total") == 1
    assert total("tool_search_sessions_total") == 1


def test_requests_with_different_tool_lists_share_a_catalog_safely(tmp_path):
    """Two sessions see different versions of one server (its list changed in between): a
    request never gets a tool it does not have, even after the other synced the catalog."""
    from loopstack.harness.tools.tool import python_tool
    from loopstack.plugins.tool_search.search import ToolSearchTool, search_tools
    from loopstack.tools import ToolSet

    runtime = runtime_with(tmp_path, ON + 'retriever = "bm25"\n')
    plugin = runtime.instance("tool_search")

    def list_security_advisories(owner: str, repo: str) -> list:
        return []

    advisories = python_tool(list_security_advisories, description="List the security advisories of a repository",
                             namespace="github")

    def request(tools):
        ctx = runtime.context(session=Session())
        tool_set = ToolSet([*(t.info for t in tools), ToolSearchTool(ctx, top_k=5, max_query_chars=2000).info])
        plugin.loopstack_visible_tools(tools=tool_set, ctx=ctx)
        return ctx

    newer = [t for t in github_tools() if t.info.name != "merge_pull_request"] + [advisories]
    old, new = request(github_tools()), request(newer)
    assert "create_issue" in search_tools(old, "open a new issue", limit=5).text  # old's request syncs
    assert "list_security_advisories" in search_tools(new, "security advisories", limit=5).text  # new's
    later = search_tools(old, "list security advisories", limit=5)  # same request as old's first search
    assert not later.is_error and "list_security_advisories" not in later.text
    assert all(tool["name"] != "list_security_advisories" for tool in later.loaded_tools)
    assert "merge_pull_request" in search_tools(old, "merge a pull request", limit=1).text  # gone from new's
    assert "merge_pull_request" not in search_tools(new, "merge a pull request", limit=5).text
