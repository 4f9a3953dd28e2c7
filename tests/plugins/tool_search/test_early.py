"""embed_early: a search's query is embedded while the model still writes the call.

The model double streams its output the way the server does (the real tool-call stream
parser and response builder turn Hermes text into Responses events) and hands each event
to the harness's ``observe_stream_event``, as the embedded, WebSocket and streaming HTTP
clients do. With the real SmolLM2 engine, the quick bench test
(``test_tool_search_bench``) checks that every search of the ``embed_early`` arm found its
query already embedded, and none of the other arm's.
"""

from __future__ import annotations

import json
import threading

import anyio
import pytest

from loopstack.api.response_builder import ResponseBuilder
from loopstack.api.tool_calls.parser import ToolCallStreamParser
from loopstack.harness.agent import Agent
from loopstack.harness.call_stream import StreamedCall, observe_stream_event
from loopstack.plugins.tool_search.early import streamed_query
from loopstack.plugins.tool_search.search import SEARCH_TOOL_NAME
from loopstack.plugins.tool_search.state import REQUEST_TOOLS
from tests.plugins.tool_search.support import ON, github_tools, needs_minilm, runtime_with

QUERY = "open a new issue"


def test_the_query_is_found_once_the_model_has_written_all_of_it():
    assert streamed_query("") is None
    assert streamed_query('{"query": "open an iss') is None
    assert streamed_query('{"query": "open an issue"') == "open an issue"
    assert streamed_query('{"limit": 3, "query": "say \\"hi\\" \\\\ now", "x') == 'say "hi" \\ now'
    assert streamed_query('{"query": 5, "limit": 2') is None  # not a string: the search will say so
    # "query" inside another argument's string is not the key
    assert streamed_query('{"note": "a, \\"query\\": \\"b\\"", "li') is None


class StreamingModel:
    """Writes each scripted Hermes text a few characters at a time through the server's
    parser and builder, passes every event to ``observe_stream_event`` like a streaming
    client, and returns the final response. ``before_done`` runs when the stream reaches a
    call's ``.done`` event (the model has finished writing the call)."""

    def __init__(self, texts: list[str], tool_names: set[str], before_done=None) -> None:
        self.texts = list(texts)
        self.tool_names = tool_names
        self.before_done = before_done

    async def create(self, request, ctx, **_):
        builder = ResponseBuilder("resp_1", {})
        parser = ToolCallStreamParser(self.tool_names, stream_arguments=True)
        text = self.texts.pop(0) if self.texts else "done"
        events = builder.start()
        for start in range(0, len(text), 3):
            for kind, value in parser.feed(text[start : start + 3]):
                events += builder.apply(kind, value)
        for kind, value in parser.close():
            events += builder.apply(kind, value)
        final, response = builder.finish({"input_tokens": 1, "output_tokens": 1}, truncated=False)
        for event in [*events, *final]:
            if event["type"] == "response.function_call_arguments.done" and self.before_done is not None:
                await self.before_done()
            observe_stream_event(ctx, event)
        return response


def search_call(query: str) -> str:
    body = {"name": SEARCH_TOOL_NAME, "arguments": {"query": query, "limit": 2}}
    return f"<tool_call>\n{json.dumps(body)}\n</tool_call>"


def _run(tmp_path, stack: str, name: str):
    runtime = runtime_with(tmp_path, stack + 'vector_cache = ""\n', name=name)
    plugin = runtime.instance("tool_search")
    embedder = plugin.embedder()
    if embedder is not None:
        embedder.clear_cache()  # the process shares one embedder: forget earlier tests' queries
        seen: dict[str, object] = {"query_hits": embedder.statistics().num_query_hits}
    else:
        seen = {}

    async def before_done():  # wait for the search thread's queue, then look at the query cache
        await plugin.worker.run(lambda: None)
        embedder = plugin.embedder()
        seen["cached_before_the_call_closed"] = embedder is not None and embedder.has_query(QUERY)

    model = StreamingModel([search_call(QUERY), "done"], {SEARCH_TOOL_NAME}, before_done)
    agent = Agent(model, github_tools(), instructions="", runtime=runtime)
    result = anyio.run(agent.run, "open an issue about the crash")
    metrics = {m["name"]: m for m in runtime.metrics.snapshot()["metrics"]}
    early = sum(s["value"] for s in metrics.get("tool_search_early_embeds_total", {}).get("series", []))
    if embedder is not None:  # searches that found their query's vector in the cache
        seen["query_hits"] = embedder.statistics().num_query_hits - seen["query_hits"]
    return plugin, result, early, seen


@needs_minilm
def test_the_query_is_embedded_before_the_call_is_complete_and_the_search_reuses_it(tmp_path):
    _, result, early, seen = _run(tmp_path, ON, "on")
    assert "create_issue" in result.items[2]["output"]  # the search found the tool as usual
    assert early == 1 and seen["cached_before_the_call_closed"]
    assert seen["query_hits"] == 1  # the search took the vector from the cache


@needs_minilm
def test_embed_early_off_and_bm25_wait_for_the_complete_call(tmp_path):
    _, result, early, seen = _run(tmp_path, ON + "embed_early = false\n", "off")
    assert "create_issue" in result.items[2]["output"]
    assert early == 0 and not seen["cached_before_the_call_closed"] and seen["query_hits"] == 0
    _, result, early, _ = _run(tmp_path, ON + 'retriever = "bm25"\n', "bm25")
    assert "create_issue" in result.items[2]["output"] and early == 0


class _HybridCatalog:
    """Stands in for a hybrid catalog: records what the hook asks it to embed."""

    retriever = "hybrid"

    def __init__(self) -> None:
        self.embedded: list[str] = []
        self.done = threading.Event()

    def embed_query(self, query: str) -> bool:
        self.embedded.append(query)
        self.done.set()
        return True


@pytest.mark.parametrize("arguments", ['{"query": "', '{"query": "open', '{"limit": 2}'])
def test_an_incomplete_query_starts_nothing(tmp_path, arguments):
    runtime = runtime_with(tmp_path, ON + 'retriever = "bm25"\n')
    plugin = runtime.instance("tool_search")
    ctx = runtime.context()
    catalog = ctx.state(REQUEST_TOOLS).catalog = _HybridCatalog()  # past the hook's other checks
    call = StreamedCall("c1", SEARCH_TOOL_NAME, arguments, [arguments])
    plugin.loopstack_tool_call_delta(call=call, ctx=ctx)
    assert plugin.worker.num_runs == 0
    assert ctx.state(REQUEST_TOOLS).embedded_early == set()  # nothing submitted (set before a submit)
    # the same call once the query is complete: embedded once, as the search will cut it
    complete = StreamedCall("c1", SEARCH_TOOL_NAME, "", ['{"query": "  open an issue ", "li'])
    plugin.loopstack_tool_call_delta(call=complete, ctx=ctx)
    plugin.loopstack_tool_call_delta(call=complete, ctx=ctx)  # a later delta of that call: nothing more
    assert catalog.done.wait(10) and catalog.embedded == ["open an issue"]
    plugin.worker.close()


def test_the_server_side_search_ranks_a_requests_deferred_tools(tmp_path):
    """``loopstack_search_deferred_tools`` through the stack's hooks: the names of the best
    matches among flat Responses tools (a namespace's function by its qualified name)."""
    runtime = runtime_with(tmp_path, ON + 'retriever = "bm25"\n')
    ctx = runtime.context()
    tools = [
        {"type": "function", "name": "github.create_issue", "namespace": "github",
         "description": "Open a new issue in a GitHub repository", "parameters": {"type": "object"}},
        {"type": "function", "name": "github.merge_pull_request", "namespace": "github",
         "description": "Merge a pull request", "parameters": {"type": "object"}},
        {"type": "function", "name": "read_weather", "description": "Today's weather for a city"},
    ]
    assert ctx.hooks.serves("loopstack_search_deferred_tools")
    names = ctx.hooks.search_deferred_tools(tools, "open an issue about a crash", 2, ctx)
    assert names and names[0] == "github.create_issue" and len(names) <= 2
    assert ctx.hooks.search_deferred_tools([], "anything", 2, ctx) == []
    runtime.instance("tool_search").worker.close()
