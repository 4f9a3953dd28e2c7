"""Responses input items -> chat messages -> prompt text (Hermes tool rendering, append-only)."""

from __future__ import annotations

import itertools
import json

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from loopstack.api.conversation import (
    ConversationError,
    FunctionTool,
    InvalidToolError,
    chat_messages,
    format_tool_call,
    items_to_messages,
    normalize_tools,
    render_prompt,
    template_supports_tools,
)
from loopstack.engine.text.tokenizer import Tokenizer

# SmolLM2-135M-Instruct's template, as its GGUF carries it: ChatML, no tools.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NATIVE_TEMPLATE = (
    "{% if tools %}[TOOLS]{{ tools | tojson }}[/TOOLS]{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[CALL {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def tokenizer(template: str = SMOLLM2_TEMPLATE) -> Tokenizer:
    return Tokenizer(BackendTokenizer(models.BPE()), bos_token_id=None, eos_token_ids=(), chat_template=template)


def call(call_id: str, city: str) -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": json.dumps({"city": city})}


def output(call_id: str, text: str) -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": text}


# -- items -> messages -------------------------------------------------------------------

def test_shorthand_message_without_type_is_a_message():
    assert items_to_messages(None, [{"role": "user", "content": "hi"}]) == [{"role": "user", "content": "hi"}]


def test_typed_message_joins_its_text_parts():
    item = {"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello "}, {"type": "output_text", "text": "there"}]}
    assert items_to_messages(None, [item]) == [{"role": "assistant", "content": "Hello there"}]


def test_input_text_parts_and_system_role():
    item = {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "rules"}]}
    assert items_to_messages(None, [item]) == [{"role": "system", "content": "rules"}]


def test_developer_role_maps_to_system():
    assert items_to_messages(None, [{"role": "developer", "content": "x"}]) == [{"role": "system", "content": "x"}]


def test_instructions_become_the_first_system_message():
    messages = items_to_messages("Be brief.", [{"role": "user", "content": "hi"}])
    assert messages[0] == {"role": "system", "content": "Be brief."}


def test_string_input_is_one_user_message():
    assert items_to_messages(None, "hi") == [{"role": "user", "content": "hi"}]


def test_function_call_after_user_opens_an_assistant_turn():
    [_, assistant] = items_to_messages(None, [{"role": "user", "content": "q"}, call("c1", "Paris")])
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}


def test_function_call_joins_the_assistant_message_before_it():
    items = [{"role": "assistant", "content": "Let me check."}, call("c1", "Paris")]
    [assistant] = items_to_messages(None, items)
    assert assistant["content"] == "Let me check." and [c["id"] for c in assistant["tool_calls"]] == ["c1"]


def test_consecutive_function_calls_merge_into_one_assistant_turn():
    messages = items_to_messages(None, [{"role": "user", "content": "q"}, call("c1", "Paris"), call("c2", "Rome")])
    assert len(messages) == 2 and [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]


def test_function_call_output_is_a_tool_message_named_after_its_call():
    messages = items_to_messages(None, [call("c1", "Paris"), output("c1", "18°C and sunny")])
    assert messages[1] == {"role": "tool", "tool_call_id": "c1", "content": "18°C and sunny", "name": "get_weather"}


def test_function_call_output_may_be_text_parts():
    item = {"type": "function_call_output", "call_id": "c9", "output": [{"type": "input_text", "text": "ok"}]}
    assert items_to_messages(None, [item]) == [{"role": "tool", "tool_call_id": "c9", "content": "ok"}]


def test_unparsable_arguments_are_kept_verbatim():
    [assistant] = items_to_messages(None, [{**call("c1", "x"), "arguments": "{not json"}])
    assert assistant["tool_calls"][0]["function"]["arguments"] == "{not json"


def test_unknown_item_type_names_the_index_the_type_and_the_allowed_types():
    with pytest.raises(ConversationError, match=r"input\[1\]: unknown item type 'reasoning'; allowed: message, "
                                                r"function_call, function_call_output"):
        items_to_messages(None, [{"role": "user", "content": "q"}, {"type": "reasoning", "summary": []}])


def test_unknown_role_and_non_text_parts_are_errors():
    with pytest.raises(ConversationError, match=r"input\[0\]: unknown role 'robot'"):
        items_to_messages(None, [{"role": "robot", "content": "x"}])
    with pytest.raises(ConversationError, match=r"input\[0\]\.content\[0\]: part type 'input_image'"):
        items_to_messages(None, [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])


def test_function_call_without_call_id_is_an_error():
    with pytest.raises(ConversationError, match=r"input\[0\]: a function call needs"):
        items_to_messages(None, [{"type": "function_call", "name": "f", "arguments": "{}"}])


def test_chat_messages_convert_tool_calls_and_tool_results():
    messages = chat_messages([
        {"role": "user", "content": [{"type": "text", "text": "q"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ])
    assert messages == items_to_messages(None, [{"role": "user", "content": "q"}, call("c1", "Paris"),
                                               output("c1", "sunny")])


# -- tools -------------------------------------------------------------------------------

def test_flat_and_chat_style_tools_normalize_to_the_same_function_tool():
    nested = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    assert normalize_tools([WEATHER]) == normalize_tools([nested]) == [FunctionTool(
        "get_weather", "Get the current weather in a city.", WEATHER["parameters"], None)]


def test_non_function_and_duplicate_tools_are_errors():
    with pytest.raises(InvalidToolError, match=r"tools\[0\]: type 'web_search'"):
        normalize_tools([{"type": "web_search"}])
    with pytest.raises(InvalidToolError, match="duplicate function names"):
        normalize_tools([WEATHER, WEATHER])


def test_template_support_for_tools_is_read_from_the_template_variables():
    assert not template_supports_tools(SMOLLM2_TEMPLATE)
    assert template_supports_tools(NATIVE_TEMPLATE)
    assert not template_supports_tools("{# tools #}{% for m in messages %}{{ m.tool_calls }}{% endfor %}")


# -- rendering ---------------------------------------------------------------------------

def test_hermes_tools_block_is_the_system_turn_when_the_template_lacks_tools():
    prompt = render_prompt(tokenizer(), [{"role": "user", "content": "q"}], [WEATHER])
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools\n")
    assert "<tools>\n" + json.dumps(normalize_tools([WEATHER])[0].to_chat_dict(), ensure_ascii=False) + "\n</tools>" in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert "SmolLM" not in prompt  # our system turn replaces the template's default one


def test_hermes_tools_block_follows_the_instructions():
    prompt = render_prompt(tokenizer(), items_to_messages("Be brief.", "q"), [WEATHER])
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")


def test_tool_calls_and_results_render_as_hermes_blocks():
    items = [{"role": "user", "content": "q"}, call("c1", "Paris"), call("c2", "Rome"), output("c1", "sunny")]
    prompt = render_prompt(tokenizer(), items_to_messages(None, items), [WEATHER], add_generation_prompt=False)
    blocks = format_tool_call("get_weather", {"city": "Paris"}) + format_tool_call("get_weather", {"city": "Rome"})
    assert f"<|im_start|>assistant\n{blocks}<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n")


def test_a_tool_call_block_is_written_as_the_grammar_writes_it():
    assert format_tool_call("get_weather", {"city": "Paris"}) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_native_template_gets_tools_and_tool_messages_as_they_are():
    messages = items_to_messages(None, [{"role": "user", "content": "q"}, call("c1", "Paris"), output("c1", "ok")])
    prompt = render_prompt(tokenizer(NATIVE_TEMPLATE), messages, [WEATHER], add_generation_prompt=False)
    assert prompt == (
        f"[TOOLS]{json.dumps([normalize_tools([WEATHER])[0].to_chat_dict()])}[/TOOLS]<user>q</user>"
        '<assistant>[CALL get_weather {"city": "Paris"}]</assistant><tool>ok</tool>'
    )


def multi_turn_items() -> list[tuple[bool, list[dict]]]:
    """A tool conversation as the server sees it: (is the model's output, items) per step."""
    return [
        (False, [{"role": "user", "content": "Weather in Paris and Rome?"}]),
        (True, [call("c1", "Paris"), call("c2", "Rome")]),
        (False, [output("c1", "18°C and sunny"), output("c2", "22°C, clear")]),
        (True, [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}]),
        (False, [{"role": "user", "content": "And Oslo?"}]),
        (True, [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                call("c3", "Oslo")]),
        (False, [output("c3", "3°C, snow")]),
    ]


def all_items() -> list[dict]:
    return [item for _, step in multi_turn_items() for item in step]


@pytest.mark.parametrize("instructions", [None, "You are terse."])
def test_rendering_is_append_only_across_a_multi_turn_tool_conversation(instructions):
    tok, items, previous = tokenizer(), [], ""
    for is_output, step in multi_turn_items():
        prompt = render_prompt(tok, items_to_messages(instructions, items), [WEATHER]) if items else ""
        items = items + step
        rendered = render_prompt(tok, items_to_messages(instructions, items), [WEATHER], add_generation_prompt=False)
        assert rendered.startswith(previous)
        if is_output:
            assert rendered.startswith(prompt)  # the model's output re-renders as an extension of its prompt
        previous = rendered


def test_rendering_is_append_only_message_by_message():
    messages = items_to_messages("sys", all_items())
    renders = [render_prompt(tokenizer(), messages[:n], [WEATHER], add_generation_prompt=False)
               for n in range(1, len(messages) + 1)]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(renders))


def test_rendering_is_deterministic():
    items = all_items()
    first = render_prompt(tokenizer(), items_to_messages(None, items), [WEATHER])
    again = render_prompt(tokenizer(), items_to_messages(None, json.loads(json.dumps(items))), [dict(WEATHER)])
    assert first == again
