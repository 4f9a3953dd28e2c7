"""Gemma 3 against transformers' Gemma3ForCausalLM, on a tiny random model whose sliding window (4)
is shorter than the prompts, with local and global layers (5:1), a linear RoPE scaling on the
global layers and query_pre_attn_scalar != head_dim: each difference from Llama shows."""

from __future__ import annotations

import dataclasses
import json

import gguf
import pytest
import torch

from loopstack.engine.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from loopstack.engine.errors import UnsupportedArchitectureError
from loopstack.engine.llm_engine import EngineOptions, LLMEngine
from loopstack.engine.loaders import load_model
from loopstack.engine.loaders.safetensors_loader import save_hf_directory
from loopstack.engine.model.gemma3 import Gemma3CausalLM
from loopstack.engine.model.native_decode import NativeDecoder
from loopstack.engine.model.quant import quantize_model
from loopstack.engine.sampling_params import SamplingParams
from tests.engine.hf_reference import (
    gguf_writer,
    hf_logits,
    randomize,
    saved_with_byte_tokenizer,
    write_gguf_tensors,
)
from tests.engine.support import PagedRunner, byte_tokenizer

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 42, 99, 3, 250, 7, 7, 128, 64, 31, 200, 11, 0, 255, 90, 45]
ATOL = 2e-4
TINY_GEMMA = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, sliding_window=4, query_pre_attn_scalar=24, max_position_embeddings=256,
    rope_scaling={"rope_type": "linear", "factor": 4.0}, rms_norm_eps=1e-6,
)


@pytest.fixture(scope="module")
def hf_gemma():
    config = transformers.Gemma3TextConfig(**TINY_GEMMA)
    return randomize(transformers.Gemma3ForCausalLM(config), norm_mean=0.0)


@pytest.fixture(scope="module")
def gemma_dir(hf_gemma, tmp_path_factory):
    return saved_with_byte_tokenizer(hf_gemma, tmp_path_factory.mktemp("gemma3"), "Gemma3ForCausalLM")


@pytest.fixture(scope="module")
def gemma(gemma_dir):
    return load_model(gemma_dir, device="cpu", dtype="float32").model


def test_config_reads_layer_types_local_rope_and_scale(gemma):
    c = gemma.config
    assert isinstance(gemma, Gemma3CausalLM)
    assert c.layer_types == (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION, SLIDING_ATTENTION)
    assert (c.sliding_window, c.rope_theta, c.rope_local_theta) == (4, 1e6, 1e4)
    assert (c.query_pre_attn_scalar, c.hidden_act, c.qk_norm, c.tie_word_embeddings) == (24, "gelu_pytorch_tanh",
                                                                                         True, True)
    assert [kind.window for kind in gemma.layer_kinds] == [4, None]


def test_older_config_keys_give_the_same_config():
    """transformers 4.x wrote rope_local_base_freq, rope_scaling and sliding_window_pattern."""
    old = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "sliding_window": 4, "sliding_window_pattern": 6, "rope_theta": 1e6,
           "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
           "query_pre_attn_scalar": 24, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 256}
    new = transformers.Gemma3TextConfig(**TINY_GEMMA).to_dict()
    new["architectures"] = ["Gemma3ForCausalLM"]
    parsed_old, parsed_new = ModelConfig.from_hf_config(old), ModelConfig.from_hf_config(new)
    assert dataclasses.replace(parsed_old, bos_token_id=2, eos_token_ids=(1,)) == dataclasses.replace(
        parsed_new, rope_scaling={"rope_type": "linear", "factor": 4.0})


def test_logit_softcapping_is_refused():
    hf = {**transformers.Gemma3TextConfig(**TINY_GEMMA).to_dict(), "final_logit_softcapping": 30.0}
    with pytest.raises(UnsupportedArchitectureError, match="final_logit_softcapping"):
        ModelConfig.from_hf_config(hf)


def test_prefill_matches_transformers(gemma, hf_gemma):
    logits = PagedRunner(gemma).step({"a": PROMPT}, all_logits=True)
    torch.testing.assert_close(logits, hf_logits(hf_gemma, PROMPT), atol=ATOL, rtol=0)


def test_decode_steps_match_transformers(gemma, hf_gemma):
    runner = PagedRunner(gemma)
    runner.step({"a": PROMPT[:3]})
    steps = [runner.step({"a": [token]})[0] for token in PROMPT[3:]]  # contexts 4 .. 17: past the window
    torch.testing.assert_close(torch.stack(steps), hf_logits(hf_gemma, PROMPT)[3:], atol=ATOL, rtol=0)


def test_chunked_prefill_over_cached_context_matches_transformers(gemma, hf_gemma):
    runner = PagedRunner(gemma, seed=1)
    runner.step({"a": PROMPT[:5]})
    runner.step({"a": PROMPT[5:11]})
    last = runner.step({"a": PROMPT[11:]}, all_logits=True)
    torch.testing.assert_close(last, hf_logits(hf_gemma, PROMPT)[11:], atol=ATOL, rtol=0)


def test_a_ragged_batch_matches_transformers(gemma, hf_gemma):
    """A decode, a chunk over its cached past and a fresh prefill in one forward (one mask per layer kind)."""
    other = PROMPT[::-1]
    runner = PagedRunner(gemma)
    runner.step({"d": PROMPT[:12], "c": other[:6]})
    rows = runner.step({"d": PROMPT[12:13], "c": other[6:14], "f": PROMPT[2:9]})
    expected = [hf_logits(hf_gemma, PROMPT[:13])[-1], hf_logits(hf_gemma, other[:14])[-1],
                hf_logits(hf_gemma, PROMPT[2:9])[-1]]
    for row, want in zip(rows, expected, strict=True):
        torch.testing.assert_close(row, want, atol=ATOL, rtol=0)


def test_engine_greedy_with_a_prefix_hit_matches_transformers(gemma, hf_gemma):
    engine = LLMEngine(gemma, byte_tokenizer(), EngineOptions(num_kv_blocks=64, block_size=4,
                                                              max_num_batched_tokens=8))  # chunked prefill
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.generate([PROMPT], params)
    [hit] = engine.generate([PROMPT[:13] + [77, 78]], params)
    assert hit.num_cached_prompt_tokens == 13  # three full blocks, and the fourth's first token copied
    tokens = PROMPT[:13] + [77, 78]
    for _ in range(6):
        tokens.append(int(hf_logits(hf_gemma, tokens)[-1].argmax()))
    assert hit.output_token_ids == tokens[15:]


def test_bfloat16_prefill_is_close_to_transformers(gemma_dir, hf_gemma):
    model = load_model(gemma_dir, device="cpu", dtype="bfloat16").model
    logits = PagedRunner(model).step({"a": PROMPT}, all_logits=True)
    reference = hf_logits(hf_gemma, PROMPT)
    assert (logits - reference).abs().max() < 0.05 * reference.abs().max()


def test_int4_quantized_model_stays_close_and_takes_the_python_layers(gemma_dir, hf_gemma):
    model = load_model(gemma_dir, device="cpu", dtype="float32").model
    assert quantize_model(model, "int4", head="int8_rescored") == 7 * 4 + 1
    assert NativeDecoder.for_model(model) is None  # the C++ loop has no q/k norms nor local RoPE
    reference = hf_logits(hf_gemma, PROMPT)
    runner = PagedRunner(model)
    runner.step({"a": PROMPT[:10]})
    steps = torch.stack([runner.step({"a": [token]})[0] for token in PROMPT[10:]])
    probs, want = steps.log_softmax(-1), reference[10:].log_softmax(-1)
    kl = (want.exp() * (want - probs)).sum(-1)
    # random Gaussian weights are far from a 4-bit grid (real GGUF sources sit on one); a broken
    # path would be nats away
    assert kl.mean() < 0.1, kl


def test_hf_directory_round_trip_keeps_the_norm_convention(gemma, tmp_path):
    save_hf_directory(gemma, tmp_path, tokenizer_json=byte_tokenizer().backend.to_str())
    reloaded = load_model(tmp_path, device="cpu", dtype="float32").model
    assert reloaded.config == gemma.config
    config = json.loads((tmp_path / "config.json").read_text())
    assert transformers.Gemma3TextConfig(**config).layer_types == list(gemma.config.layer_types)
    torch.testing.assert_close(PagedRunner(reloaded).step({"a": PROMPT}), PagedRunner(gemma).step({"a": PROMPT}),
                               atol=1e-6, rtol=0)


def write_gemma3_gguf(model: Gemma3CausalLM, path) -> None:
    """A GGUF as llama.cpp's converter writes Gemma 3: norms stored as weight + 1, Q/K not permuted,
    a SentencePiece vocabulary of byte pieces."""
    c = model.config
    writer = gguf_writer(path, "gemma3", c)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_sliding_window(c.sliding_window)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(4.0)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(252)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([3, 3, 3, 2] + [6] * 252)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    write_gguf_tensors(writer, model.hf_state_dict(), names,  # the converter stores Gemma's norms as 1 + weight
                       lambda gguf_name, module, tensor: tensor + 1 if gguf_name.endswith("norm.weight") else tensor)


def test_gguf_round_trip_matches_transformers(gemma, hf_gemma, tmp_path):
    write_gemma3_gguf(gemma, tmp_path / "tiny.gguf")
    loaded, tokenizer, chat_template, config = load_model(tmp_path / "tiny.gguf", device="cpu")
    assert config == dataclasses.replace(gemma.config, query_pre_attn_scalar=16.0, eos_token_ids=(1,),
                                         rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert chat_template is not None and "<start_of_turn>" in chat_template  # Gemma's, the file has none
    hf_config = dataclasses.replace(config, query_pre_attn_scalar=24.0)  # GGUF leaves it to the model size
    loaded.config = hf_config
    for layer in loaded.layers:
        layer.attn.scale = hf_config.attention_scale
    logits = PagedRunner(loaded).step({"a": PROMPT}, all_logits=True)
    torch.testing.assert_close(logits, hf_logits(hf_gemma, PROMPT), atol=ATOL, rtol=0)
