"""The paged decoder against a dense reference, on tiny random models."""

from __future__ import annotations

import pytest
import torch

from loopstack.engine.config import ModelConfig
from loopstack.engine.model import int8_dynamic
from loopstack.engine.model.attention import AttentionMetadata, build_attention_mask
from loopstack.engine.model.llama import RMSNorm, rope_inv_freq
from loopstack.engine.model.quant import DynamicInt8Linear, Int4Linear, Int8RescoredHead, quantize_model

PROMPT = [5, 17, 42, 99, 3, 250, 7, 7, 128, 64, 31, 200, 11, 0, 255, 90, 45]
ATOL = 1e-4


def test_paged_prefill_matches_dense_reference(tiny_model, paged_runner, reference_forward):
    logits = paged_runner(tiny_model).step({"a": PROMPT}, all_logits=True)
    torch.testing.assert_close(logits, reference_forward(tiny_model, PROMPT), atol=ATOL, rtol=0)


def test_chunked_prefill_matches_one_shot(tiny_model, paged_runner):
    one_shot = paged_runner(tiny_model).step({"a": PROMPT})
    runner = paged_runner(tiny_model, seed=1)
    runner.step({"a": PROMPT[:5]})
    runner.step({"a": PROMPT[5:11]})
    chunked = runner.step({"a": PROMPT[11:]})
    torch.testing.assert_close(chunked, one_shot, atol=ATOL, rtol=0)


def test_decode_steps_match_dense_reference(tiny_model, paged_runner, reference_forward):
    runner = paged_runner(tiny_model)
    runner.step({"a": PROMPT[:6]})
    steps = [runner.step({"a": [token]})[0] for token in PROMPT[6:]]
    expected = reference_forward(tiny_model, PROMPT)[6:]
    torch.testing.assert_close(torch.stack(steps), expected, atol=ATOL, rtol=0)


def test_mixed_batch_matches_each_sequence_alone(tiny_model, paged_runner):
    prompts = {"a": PROMPT, "b": PROMPT[3:8], "c": PROMPT[::-1][:11]}
    alone = {k: paged_runner(tiny_model).step({k: v})[0] for k, v in prompts.items()}
    runner = paged_runner(tiny_model)
    runner.step({"a": PROMPT[:9]})
    batched = runner.step({"a": PROMPT[9:], "b": prompts["b"], "c": prompts["c"]})  # chunk + 2 prefills
    for row, key in zip(batched, prompts, strict=True):
        torch.testing.assert_close(row, alone[key], atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", [None, 4])
def test_a_ragged_batch_with_a_decode_matches_the_dense_reference(make_tiny_model, paged_runner, reference_forward,
                                                                  window):
    """A decode, a prefill chunk over its cached past and a fresh prefill in one step: each
    sequence attends over exactly its own context (the ragged path), with a sliding window too."""
    model = make_tiny_model(sliding_window=window)
    runner = paged_runner(model)
    runner.step({"d": PROMPT[:12], "c": PROMPT[::-1][:6]})
    rows = runner.step({"d": PROMPT[12:13], "c": PROMPT[::-1][6:14], "f": PROMPT[2:9]})
    expected = [reference_forward(model, PROMPT[:13])[-1], reference_forward(model, PROMPT[::-1][:14])[-1],
                reference_forward(model, PROMPT[2:9])[-1]]
    for row, want in zip(rows, expected, strict=True):
        torch.testing.assert_close(row, want, atol=ATOL, rtol=0)


def test_batched_decode_matches_each_sequence_alone(tiny_model, paged_runner, reference_forward):
    prompts = {"a": PROMPT[:3], "b": PROMPT[:10], "c": PROMPT[4:17]}
    runner = paged_runner(tiny_model)
    runner.step(prompts)
    decoded = runner.step({key: [77] for key in prompts})  # one decode step, three contexts
    for row, prompt in zip(decoded, prompts.values(), strict=True):
        torch.testing.assert_close(row, reference_forward(tiny_model, [*prompt, 77])[-1], atol=ATOL, rtol=0)


def test_qkv_bias_path_matches_reference(make_tiny_model, paged_runner, reference_forward):
    model = make_tiny_model(architecture="qwen2", qkv_bias=True)
    assert model.layers[0].attn.qkv_proj.bias is not None
    logits = paged_runner(model).step({"a": PROMPT}, all_logits=True)
    torch.testing.assert_close(logits, reference_forward(model, PROMPT), atol=ATOL, rtol=0)


def test_untied_lm_head_matches_reference(make_tiny_model, paged_runner, reference_forward):
    model = make_tiny_model(tie_word_embeddings=False)
    logits = paged_runner(model).step({"a": PROMPT})
    torch.testing.assert_close(logits[0], reference_forward(model, PROMPT)[-1], atol=ATOL, rtol=0)


def test_sliding_window_matches_reference(make_tiny_model, paged_runner, reference_forward):
    model = make_tiny_model(sliding_window=4)
    runner = paged_runner(model)
    runner.step({"a": PROMPT[:8]})
    logits = runner.step({"a": PROMPT[8:]}, all_logits=True)
    torch.testing.assert_close(logits, reference_forward(model, PROMPT)[8:], atol=ATOL, rtol=0)


def test_last_token_indices_select_verification_logits(tiny_model, reference_forward):
    cache = tiny_model.allocate_kv_cache(num_blocks=8, block_size=4)
    meta = AttentionMetadata.build([len(PROMPT)], [len(PROMPT)], [[6, 2, 0, 4, 1]], block_size=4)
    with torch.inference_mode():
        logits = tiny_model(torch.tensor(PROMPT), meta.positions(), cache, meta, meta.last_token_indices(3))
    torch.testing.assert_close(logits, reference_forward(tiny_model, PROMPT)[-3:], atol=ATOL, rtol=0)


def test_last_token_indices_of_a_batch():
    meta = AttentionMetadata.build([3, 3], [11, 7], [[0, 1, 2], [3, 4]], block_size=4)
    assert meta.last_token_indices(2).tolist() == [1, 2, 4, 5]
    with pytest.raises(ValueError, match="exceeds the shortest query"):
        meta.last_token_indices(4)


def test_bfloat16_model_stays_close_to_float32(tiny_model, paged_runner):
    expected = paged_runner(tiny_model).step({"a": PROMPT})
    logits = paged_runner(tiny_model.to(torch.bfloat16)).step({"a": PROMPT})
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=0.15, rtol=0.05)


def test_fresh_single_prefill_skips_the_mask():
    fresh = AttentionMetadata.build([5], [5], [[3, 1]], block_size=4)
    cached = AttentionMetadata.build([2], [5], [[3, 1]], block_size=4)
    assert build_attention_mask(fresh) is None
    mask = build_attention_mask(cached)
    assert mask is not None and mask.shape == (1, 1, 2, 8)
    assert (mask[0, 0] == 0).sum(-1).tolist() == [4, 5]  # query positions 3 and 4 see 4 and 5 keys


def test_single_sequence_decode_needs_no_mask():
    decode = AttentionMetadata.build([1], [7], [[3, 1]], block_size=4)
    assert build_attention_mask(decode) is None
    assert build_attention_mask(decode, sliding_window=7) is None
    assert build_attention_mask(decode, sliding_window=4).shape == (1, 1, 1, 8)  # the window cuts


def test_contiguous_blocks_are_read_in_place():
    assert AttentionMetadata.build([1], [7], [[4, 5, 9]], block_size=4).contiguous_first_block == 4
    assert AttentionMetadata.build([1], [7], [[5, 4]], block_size=4).contiguous_first_block is None
    assert AttentionMetadata.build([1, 1], [3, 3], [[0], [1]], block_size=4).contiguous_first_block is None


@pytest.mark.parametrize("table", [list(range(2, 8)), [7, 3, 5, 2, 6, 4]], ids=["contiguous", "shuffled"])
def test_single_sequence_decode_matches_dense_reference(tiny_model, reference_forward, table):
    block_size, prefix = 4, 6
    cache = tiny_model.allocate_kv_cache(num_blocks=8, block_size=block_size)
    rows = []
    with torch.inference_mode():
        for end in range(prefix, len(PROMPT) + 1):
            start = 0 if end == prefix else end - 1
            meta = AttentionMetadata.build([end - start], [end], [table], block_size)
            rows.append(tiny_model(torch.tensor(PROMPT[start:end]), meta.positions(), cache, meta)[0])
    torch.testing.assert_close(torch.stack(rows), reference_forward(tiny_model, PROMPT)[prefix - 1 :], atol=ATOL, rtol=0)


def test_rms_norm_matches_the_hf_formula_and_follows_weight_updates():
    torch.manual_seed(0)
    norm, x = RMSNorm(48, eps=1e-5), torch.randn(3, 48)
    for _ in range(2):
        expected = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(48))  # a reload: the cached scaled weight must follow


def test_slot_mapping_follows_block_table():
    meta = AttentionMetadata.build([2, 1], [6, 3], [[7, 2], [5]], block_size=4)
    assert meta.slot_mapping.tolist() == [2 * 4 + 0, 2 * 4 + 1, 5 * 4 + 2]
    assert meta.positions().tolist() == [4, 5, 2]


def test_short_block_table_is_rejected():
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        AttentionMetadata.build([1], [9], [[0, 1]], block_size=4)


def test_llama3_rope_scaling_keeps_high_and_divides_low_frequencies():
    base = ModelConfig("llama", 10, 64, 64, 1, 1, 1, 64, rope_theta=500000.0)
    scaled = ModelConfig(
        "llama", 10, 64, 64, 1, 1, 1, 64, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )
    plain, adjusted = rope_inv_freq(base), rope_inv_freq(scaled)
    assert torch.equal(adjusted[:4], plain[:4])
    torch.testing.assert_close(adjusted[-1], plain[-1] / 8.0)


def q4_weight(out_features: int, in_features: int, group_size: int = 32) -> torch.Tensor:
    """Weights exactly on a 4-bit grid per group (as dequantized GGUF Q4_1 weights are),
    with bfloat16-exact scales and zeros: int4 quantization must reproduce them exactly."""
    groups = in_features // group_size
    scale = torch.rand(out_features, groups, 1).mul(0.1).add(0.01).bfloat16().float()
    zero = torch.randn(out_features, groups, 1).mul(0.1).bfloat16().float()
    codes = torch.randint(0, 16, (out_features, groups, group_size)).float()
    codes[..., 0], codes[..., 1] = 0, 15  # the group's min and max sit on the grid ends
    return ((codes - 8) * scale + zero).reshape(out_features, in_features)


def test_int4_linear_is_exact_on_a_4bit_grid():
    torch.manual_seed(0)
    weight = q4_weight(64, 96)
    layer = Int4Linear(weight, dense_dtype=torch.float32)
    x = torch.randn(3, 96)
    expected = x @ weight.T
    # the kernel rounds activations and its output to bfloat16: ~2**-8 relative
    torch.testing.assert_close(layer(x), expected, atol=0.01 * expected.abs().max().item(), rtol=0)
    many_rows = torch.randn(layer.dense_above_rows + 1, 96)  # past the kernel's rows: the float32 weights, exactly
    torch.testing.assert_close(layer(many_rows), many_rows @ weight.T, atol=1e-5, rtol=0)


def snap_to_4bit_grid(weight: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """Round weights to a 4-bit min/max grid per group, like a dequantized GGUF Q4_1 tensor."""
    groups = weight.reshape(weight.shape[0], -1, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low) / 15
    return (torch.round((groups - low) / scale) * scale + low).reshape(weight.shape)


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantized_tiny_model_stays_close_on_both_paths(tiny_model, paged_runner, mode):
    with torch.no_grad():
        for param in tiny_model.parameters():
            if param.dim() == 2:
                param.copy_(snap_to_4bit_grid(param))
    expected = paged_runner(tiny_model).step({"a": PROMPT}, all_logits=True)
    assert quantize_model(tiny_model, mode, head=mode, dense_dtype=torch.float32) == 2 * 4 + 1
    prefill = paged_runner(tiny_model).step({"a": PROMPT}, all_logits=True)  # 17 rows: float path
    runner = paged_runner(tiny_model)
    decode = torch.cat([runner.step({"a": [t]}) for t in PROMPT])  # 1 row: quantized kernel
    torch.testing.assert_close(prefill, expected, atol=1e-4, rtol=0)
    assert (decode.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    # bfloat16 activations and kernel outputs: ~2**-8 of the logit scale
    torch.testing.assert_close(decode, expected, atol=0.02 * expected.abs().max().item(), rtol=0)


def test_quantize_refuses_unknown_modes(tiny_model):
    with pytest.raises(ValueError, match="int3"):
        quantize_model(tiny_model, "int3")  # type: ignore[arg-type]


@pytest.mark.parametrize("cheap_pass", ["dynamic_int8", "int8pack"])
def test_rescored_head_keeps_the_top_logits_exact(cheap_pass, monkeypatch):
    if cheap_pass == "int8pack":  # the fallback where torch lacks fbgemm's dynamic int8 linear
        monkeypatch.setattr(int8_dynamic, "available", lambda: False)
    elif not int8_dynamic.available():
        pytest.skip("this torch build has no fbgemm dynamic int8 linear")
    torch.manual_seed(0)
    weight, x = torch.randn(300, 64), torch.randn(3, 64)
    head = Int8RescoredHead(weight, num_exact=16, dense_dtype=torch.bfloat16)
    assert (head.packed is not None) == (cheap_pass == "dynamic_int8")
    expected, logits = x @ weight.T, head(x)
    top = expected.topk(8, dim=-1).indices  # well inside the 16 rescored: the int8 ranking may swap the 16th
    torch.testing.assert_close(logits.gather(1, top), expected.gather(1, top), atol=1e-5, rtol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    # the int8 tail, within the rounding bound: half a weight step (1/127 of the row's largest
    # weight) times |x|_1, plus for the dynamic kernel half an activation step (the input's range
    # over 255 levels, or 127 where the CPU lacks an int8 dot and fbgemm drops a bit) times |w|_1
    weight_step = weight.abs().amax(-1) / 127  # [N]
    bound = 0.5 * x.abs().sum(-1, keepdim=True) * weight_step  # [M, N]
    if cheap_pass == "dynamic_int8":
        levels = 127 if int8_dynamic._REDUCE_RANGE else 255
        activation_step = (x.max().clamp(min=0) - x.min().clamp(max=0)) / levels
        bound = bound + 0.5 * activation_step * weight.abs().sum(-1) + 0.25 * x.shape[1] * weight_step * activation_step
    else:
        bound = bound + 0.01 * expected.abs()  # bfloat16 activations: 8 significant bits
    assert ((logits - expected).abs() <= bound).all(), ((logits - expected).abs() / bound).max()
    for num_rows in (3, 9):  # the int8 pass, then (int8pack only) the bfloat16 one
        rows = torch.randn(num_rows, 64)
        expected, logits = rows @ weight.T, head(rows)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
        torch.testing.assert_close(logits.max(-1).values, expected.max(-1).values, atol=1e-5, rtol=0)
    many_rows = torch.randn(20, 64)  # past MAX_RESCORED_ROWS: the float weights, exactly
    torch.testing.assert_close(head(many_rows), many_rows @ weight.T, atol=1e-5, rtol=0)


@pytest.mark.skipif(not int8_dynamic.available(), reason="this torch build has no fbgemm dynamic int8 linear")
def test_dynamic_int8_linear_matches_float_at_decode_and_prefill_sizes():
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64) * 0.05, torch.randn(96)
    layer = DynamicInt8Linear(weight, bias, dense_dtype=torch.float32)
    for num_rows in (1, 8, 9):  # the int8 kernel, then the float weights past DENSE_ABOVE_ROWS
        rows = torch.randn(num_rows, 64)
        expected, actual = rows @ weight.T + bias, layer(rows)
        assert actual.dtype == torch.float32 and actual.shape == expected.shape
        # 8-bit weights (per channel) and 8-bit activations (per call): ~1% of the output range
        torch.testing.assert_close(actual, expected, atol=0.02 * expected.abs().max().item(), rtol=0)


def test_quantized_model_with_bfloat16_projections_stays_close(tiny_model, paged_runner):
    with torch.no_grad():
        for param in tiny_model.parameters():
            if param.dim() == 2:
                param.copy_(snap_to_4bit_grid(param))
    expected = paged_runner(tiny_model).step({"a": PROMPT}, all_logits=True)
    quantize_model(tiny_model, "int4", head="int8_rescored", dense_dtype=torch.bfloat16)
    is_q4q8 = tiny_model.layers[0].attn.qkv_proj.kernel == "q4q8"  # q4q8 takes float32, int4pack bfloat16
    assert tiny_model.layers[0].projection_dtype == (None if is_q4q8 else torch.bfloat16)
    prefill = paged_runner(tiny_model).step({"a": PROMPT}, all_logits=True)  # dense bfloat16 path
    runner = paged_runner(tiny_model)
    decode = torch.cat([runner.step({"a": [t]}) for t in PROMPT])  # the int4 kernel path
    for logits in (prefill, decode):
        assert logits.dtype == torch.float32
        assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
        torch.testing.assert_close(logits, expected, atol=0.03 * expected.abs().max().item(), rtol=0)
