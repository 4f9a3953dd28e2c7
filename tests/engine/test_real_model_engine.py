"""The engine on the real default model (SmolLM2-135M-Instruct, loaded once per session)."""

from __future__ import annotations

import json

import pytest

from loopstack.engine.llm_engine import EngineOptions, LLMEngine
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.sequence import FinishReason
from loopstack.engine.text.grammar import InvalidGrammarError

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(default_model):
    model, tokenizer, _, _ = default_model
    return LLMEngine(model, tokenizer, EngineOptions(num_kv_blocks=256, max_num_batched_tokens=256))


def chat(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def test_capital_of_france(engine):
    [seq] = engine.generate([chat(engine, "What is the capital of France?")], SamplingParams(temperature=0, max_tokens=20))
    assert "Paris" in seq.output_text
    assert seq.finish_reason is FinishReason.STOP


def test_json_schema_constrained_output_validates(engine):
    jsonschema = pytest.importorskip("jsonschema")
    params = SamplingParams(temperature=0, max_tokens=40, grammar={"type": "json_schema", "schema": WEATHER_SCHEMA})
    [seq] = engine.generate([chat(engine, "What's the weather in Paris right now?")], params)
    value = json.loads(seq.output_text)
    jsonschema.validate(value, WEATHER_SCHEMA)
    assert value == {"city": "Paris"}
    assert seq.finish_reason is FinishReason.STOP


def test_structural_tag_forces_a_tool_call(engine):
    tool_call = {
        "type": "triggered_tags",
        "triggers": ["<tool_call>"],
        "tags": [{
            "type": "tag",
            "begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
            "content": {"type": "json_schema", "json_schema": WEATHER_SCHEMA},
            "end": "}\n</tool_call>",
        }],
        "at_least_one": True,
        "stop_after_first": True,
    }
    params = SamplingParams(temperature=0, max_tokens=60, grammar={"type": "structural_tag", "format": tool_call})
    [seq] = engine.generate([chat(engine, "What's the weather in Paris right now?")], params)
    body = seq.output_text.split("<tool_call>\n", 1)[1].rsplit("\n</tool_call>", 1)[0]
    assert json.loads(body) == {"name": "get_weather", "arguments": {"city": "Paris"}}


def test_invalid_schema_is_a_clear_error_and_the_engine_keeps_serving(engine):
    bad = SamplingParams(grammar={"type": "json_schema", "schema": {"type": "object", "properties": {"x": {"type": "nope"}}}})
    with pytest.raises(InvalidGrammarError, match="does not compile"):
        engine.add_request("bad", chat(engine, "hi"), bad)
    with pytest.raises(InvalidGrammarError, match="grammar.type must be one of"):
        engine.add_request("bad2", chat(engine, "hi"), SamplingParams(grammar={"type": "yaml"}))
    [seq] = engine.generate([chat(engine, "What is the capital of France?")], SamplingParams(temperature=0, max_tokens=12))
    assert "Paris" in seq.output_text


def test_chat_prefix_is_served_from_the_cache(engine):
    prompt = chat(engine, "Name three colours.")
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4))
    [again] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4))
    assert again.num_cached_prompt_tokens >= len(prompt) - engine.block_manager.block_size


def test_a_repeated_prompt_samples_from_unmasked_kept_logits(engine):
    """The same prompt three times: plain, then under a grammar, then plain. The second and third
    sample from the logits the first kept; the grammar masks a copy, so the third is the first."""
    prompt = chat(engine, "Name a colour.")
    plain = SamplingParams(temperature=0, max_tokens=8)
    hits = engine.kept_logits.num_hits
    [first] = engine.generate([prompt], plain)
    [digits] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                        grammar={"type": "regex", "pattern": "[0-9]{3}"}))
    [third] = engine.generate([prompt], plain)
    assert engine.kept_logits.num_hits - hits == 2
    assert len(digits.output_text) == 3 and digits.output_text.isdigit()
    assert third.output_token_ids == first.output_token_ids
    assert third.num_cached_prompt_tokens == len(prompt)
