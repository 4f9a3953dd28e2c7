"""Qwen3 against transformers' Qwen3ForCausalLM: per-head q/k RMSNorm before RoPE, head_dim from
the config (here 24, not hidden / heads = 16), no qkv bias."""

from __future__ import annotations

import pytest
import torch

from loopstack.engine.loaders import load_model
from loopstack.engine.model.native_decode import NativeDecoder
from loopstack.engine.model.quant import quantize_model
from tests.engine.hf_reference import hf_logits, randomize, saved_with_byte_tokenizer
from tests.engine.support import PagedRunner

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 42, 99, 3, 250, 7, 7, 128, 64, 31, 200, 11, 0, 255, 90, 45]
ATOL = 2e-4


@pytest.fixture(scope="module")
def hf_qwen3():
    config = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=256, rope_theta=1e6, tie_word_embeddings=False,
    )
    return randomize(transformers.Qwen3ForCausalLM(config))


@pytest.fixture(scope="module")
def qwen3_dir(hf_qwen3, tmp_path_factory):
    return saved_with_byte_tokenizer(hf_qwen3, tmp_path_factory.mktemp("qwen3"), "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    return load_model(qwen3_dir, device="cpu", dtype="float32").model


def test_config_has_qk_norm_and_its_head_dim(qwen3):
    c = qwen3.config
    assert (c.architecture, c.qk_norm, c.head_dim, c.qkv_bias, c.rope_theta) == ("qwen3", True, 24, False, 1e6)
    assert qwen3.layers[0].attn.head_norms is not None


def test_prefill_matches_transformers(qwen3, hf_qwen3):
    logits = PagedRunner(qwen3).step({"a": PROMPT}, all_logits=True)
    torch.testing.assert_close(logits, hf_logits(hf_qwen3, PROMPT), atol=ATOL, rtol=0)


def test_decode_steps_and_batched_decode_match_transformers(qwen3, hf_qwen3):
    runner = PagedRunner(qwen3)
    runner.step({"a": PROMPT[:6], "b": PROMPT[4:9]})
    steps = [runner.step({"a": [token], "b": [token]}) for token in PROMPT[6:]]
    torch.testing.assert_close(torch.stack([s[0] for s in steps]), hf_logits(hf_qwen3, PROMPT)[6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(steps[-1][1], hf_logits(hf_qwen3, PROMPT[4:9] + PROMPT[6:])[-1], atol=ATOL, rtol=0)


def test_quantized_qwen3_declines_the_native_decoder(qwen3_dir):
    model = load_model(qwen3_dir, device="cpu", dtype="float32").model
    quantize_model(model, "int4", head="int8_rescored")
    assert NativeDecoder.for_model(model) is None  # the C++ loop has no q/k norms
    assert PagedRunner(model).step({"a": PROMPT}).isfinite().all()
