"""Streamed tool calls: the response builder's call events and the harness's
``loopstack_tool_call_delta`` hook (``observe_stream_event``)."""

from __future__ import annotations

import logging
from typing import ClassVar

from loopstack.api.response_builder import ResponseBuilder
from loopstack.catalog import PluginCatalog
from loopstack.harness.call_stream import CALL_STREAMS, observe_stream_event
from loopstack.hookspecs import hookimpl
from loopstack.plugin import Layer, Plugin, PluginConfig
from loopstack.runtime import StackRuntime
from loopstack.stack.loader import StackLoader


def test_a_streamed_call_opens_at_once_and_closes_with_normalized_arguments():
    builder = ResponseBuilder("resp_1", {})
    events = builder.text("Sure.") + builder.function_call_begin("get_weather")
    events += builder.function_call_arguments('{"city": ') + builder.function_call_arguments('"Paris"}')
    events += builder.function_call("get_weather", '{"city":"Paris"}')
    _, response = builder.finish({}, truncated=False)
    kinds = [e["type"] for e in events]
    assert kinds[-7:] == ["response.content_part.done", "response.output_item.done",  # the message closes first
                          "response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.delta", "response.function_call_arguments.done",
                          "response.output_item.done"]
    added = next(e for e in events if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call")
    assert added["output_index"] == 1 and added["item"]["status"] == "in_progress"
    [call] = [item for item in response["output"] if item["type"] == "function_call"]
    assert call == {**added["item"], "arguments": '{"city":"Paris"}', "status": "completed"}
    assert [e["output_index"] for e in events if e["type"].startswith("response.function_call")] == [1, 1, 1]


def test_an_abandoned_call_ends_incomplete_and_leaves_the_output():
    builder = ResponseBuilder("resp_1", {})
    events = builder.function_call_begin("get_weather") + builder.function_call_arguments('{"city": "Pa')
    events += builder.function_call_abandon() + builder.text('<tool_call>{"name": "get_weather", ... oops')
    _, response = builder.finish({}, truncated=False)
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert done[0]["item"]["status"] == "incomplete" and done[0]["output_index"] == 0
    # the text after it is a new item with a new index: a client never sees an index twice
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1]
    assert [item["type"] for item in response["output"]] == ["message"]  # the response leaves it out
    assert builder.function_call_abandon() == [] and builder.function_call_arguments("x") == []  # nothing open


class Recorder(Plugin):
    name = "call_recorder"
    layers = (Layer.HARNESS,)
    Config = PluginConfig
    summary = "records streamed calls"
    seen: ClassVar[list[tuple[str, str, str]]] = []
    fail = False

    @hookimpl
    def loopstack_tool_call_delta(self, call, ctx):
        if Recorder.fail:
            raise RuntimeError("boom")
        Recorder.seen.append((call.call_id, call.name, call.arguments))


def _runtime(tmp_path, enabled: bool) -> StackRuntime:
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    catalog.add_plugin(Recorder, source=__name__)
    path = tmp_path / "s.toml"
    path.write_text(f"[plugins.call_recorder]\nenabled = {str(enabled).lower()}\n")
    return StackRuntime(StackLoader(catalog).load(path), catalog)


def _stream() -> list[dict]:
    builder = ResponseBuilder("resp_1", {})
    events = builder.function_call_begin("get_weather")
    for piece in ('{"ci', 'ty": "Pa', 'ris"}'):
        events += builder.function_call_arguments(piece)
    return events + builder.function_call("get_weather", '{"city":"Paris"}')


def test_each_delta_reaches_the_hook_with_the_arguments_so_far(tmp_path, caplog):
    Recorder.seen, Recorder.fail = [], False
    ctx = _runtime(tmp_path, True).context()
    events = _stream()
    call_id = events[0]["item"]["call_id"]
    for event in events:
        observe_stream_event(ctx, event)
    assert Recorder.seen == [(call_id, "get_weather", '{"ci'), (call_id, "get_weather", '{"city": "Pa'),
                             (call_id, "get_weather", '{"city": "Paris"}')]
    Recorder.seen, Recorder.fail = [], True  # a failing plugin is logged once; the stream goes on
    ctx = _runtime(tmp_path, True).context()
    with caplog.at_level(logging.WARNING, logger="loopstack.harness.call_stream"):
        for event in _stream():
            observe_stream_event(ctx, event)
    assert len([r for r in caplog.records if "loopstack_tool_call_delta" in r.getMessage()]) == 1


def test_without_a_listening_plugin_nothing_is_kept(tmp_path):
    Recorder.seen, Recorder.fail = [], False
    ctx = _runtime(tmp_path, False).context()
    for event in _stream():
        observe_stream_event(ctx, event)
    assert Recorder.seen == [] and ctx.state(CALL_STREAMS).open == {}
