"""Tokenizer: GGUF-built BPE of the real model, tokenizer.json, streaming detokenization, chat templates."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer

from loopstack.engine.errors import ChatTemplateError, UnsupportedTokenizerError
from loopstack.engine.text.tokenizer import Tokenizer

# SmolLM2's byte-level vocabulary lacks a few bytes (0x04, 0x06, 0x13, 0x14, 0x16, 0x1d and the
# UTF-8 lead bytes 0xf1/0xf2 of U+40000..U+BFFFF); text using them cannot round trip, in HF too.
SMOLLM2_TEXT = st.text(
    alphabet=st.characters(
        max_codepoint=0x3FFFF, exclude_categories=("Cs",), exclude_characters="\x04\x06\x13\x14\x16\x1d"
    ),
    max_size=40,
).filter(lambda text: "<|" not in text)  # special tokens' text encodes to the special token (tested above)
SMOLLM2_FRANCE_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture
def tiny_tokenizer(tiny_tokenizer_json) -> Tokenizer:
    """Byte-level tokenizer where (almost) every byte is its own token."""
    return Tokenizer(BackendTokenizer.from_str(tiny_tokenizer_json), bos_token_id=None, eos_token_ids=[258])


def with_template(tokenizer: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(
        tokenizer.backend, bos_token_id=None, eos_token_ids=tokenizer.eos_token_ids, chat_template=template
    )


def test_smollm2_special_and_plain_tokens_have_their_ids(default_model):
    tokenizer = default_model.tokenizer
    assert tokenizer.encode("<|im_start|>system\n") == [1, 9690, 198]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.pad_token_id) == (1, (2,), 2)


def test_smollm2_digits_are_split_one_per_token(default_model):
    assert len(default_model.tokenizer.encode("2024")) == 4


def test_smollm2_decode_skips_special_tokens_unless_asked(default_model):
    tokenizer = default_model.tokenizer
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=SMOLLM2_TEXT)
def test_smollm2_round_trips_any_text(default_model, text):
    tokenizer = default_model.tokenizer
    assert tokenizer.decode(tokenizer.encode(text)) == text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=SMOLLM2_TEXT)
def test_streamed_pieces_join_to_the_full_text(default_model, text):
    tokenizer = default_model.tokenizer
    stream = tokenizer.incremental_decoder()
    pieces = [stream.step(token_id) for token_id in tokenizer.encode(text)]
    assert "".join(pieces) + stream.flush() == text
    assert not any("\ufffd" in piece for piece in pieces) or "\ufffd" in text


def test_stream_holds_back_an_incomplete_character(tiny_tokenizer):
    stream = tiny_tokenizer.incremental_decoder(tiny_tokenizer.encode("ok "))
    pieces = [stream.step(token_id) for token_id in tiny_tokenizer.encode("é🙂")]  # 2 + 4 bytes
    assert pieces == ["", "é", "", "", "", "🙂"]


def test_stream_flush_releases_a_dangling_byte(tiny_tokenizer):
    stream = tiny_tokenizer.incremental_decoder()
    assert stream.step(tiny_tokenizer.encode("é")[0]) == ""
    assert stream.flush() == "\ufffd"


def test_smollm2_chat_template_renders_its_format(default_model):
    prompt = default_model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    assert prompt == SMOLLM2_FRANCE_PROMPT


def test_chat_template_gets_tools_through_tojson_without_html_escaping(tiny_tokenizer):
    tokenizer = with_template(tiny_tokenizer, "{{ tools | tojson }}|{{ messages[0] | tojson(indent=1) }}")
    tools = [{"name": "a<b", "description": "x & y"}]
    rendered = tokenizer.apply_chat_template([{"role": "user"}], tools=tools)
    assert rendered == json.dumps(tools, ensure_ascii=False) + '|{\n "role": "user"\n}'


def test_chat_template_raise_exception_becomes_chat_template_error(tiny_tokenizer):
    tokenizer = with_template(tiny_tokenizer, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_is_sandboxed(tiny_tokenizer):
    tokenizer = with_template(tiny_tokenizer, "{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template([])


def test_missing_chat_template_is_an_error(tiny_tokenizer):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_tokenizer_from_hf_directory_reads_template_and_eos(tmp_path, tiny_tokenizer_json):
    (tmp_path / "tokenizer.json").write_text(tiny_tokenizer_json)
    config = {"chat_template": "{{ messages[0]['content'] }}{{ eos_token }}", "eos_token": {"content": "<|im_end|>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_hf_directory(tmp_path, eos_token_ids=[256])
    assert tokenizer.eos_token_ids == (258, 256)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi<|im_end|>"


def test_unsupported_gguf_tokenizer_model_is_rejected_clearly():
    # "llama" (SentencePiece BPE) is supported now: see test_spm_tokenizer.py
    with pytest.raises(UnsupportedTokenizerError, match=r"'t5'.*tokenizer\.json"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
