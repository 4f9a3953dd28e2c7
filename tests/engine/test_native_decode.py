"""The C++ decode layer loop (native_decode) against the Python layers it replaces."""

from __future__ import annotations

import copy

import pytest
import torch

from loopstack.engine.model.attention import AttentionMetadata
from loopstack.engine.model.native_decode import NativeDecoder, load_extension
from loopstack.engine.model.quant import quantize_model
from tests.engine.support import PagedRunner, build_tiny_model

pytestmark = pytest.mark.skipif(
    load_extension() is None, reason="the native decode extension could not be built here (see the log)"
)


def quantized_pair(**overrides):
    """The same int4 model twice: one on the Python layers, one on the C++ loop."""
    python = build_tiny_model(**overrides)
    quantize_model(python, "int4", dense_dtype=torch.bfloat16)
    native = copy.deepcopy(python)
    native.native_decoder = NativeDecoder.for_model(native)
    assert native.native_decoder is not None
    return python, native


@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": True}], ids=["llama", "qwen2-bias"])
def test_decode_steps_match_the_python_layers(overrides):
    python, native = quantized_pair(**overrides)
    runners = PagedRunner(python), PagedRunner(native)  # same seed: the same shuffled block tables
    prompts = {"a": [5, 9, 14, 3, 7, 11, 2 + 1], "b": [8, 1, 22, 4], "c": [30, 31, 32, 33, 34, 35, 36, 37, 38]}
    for runner in runners:  # prefill (more rows than the C++ loop takes): Python on both
        runner.step(prompts)
    for step in range(6):
        batch = {"a": [10 + step]} if step % 2 else {"a": [10 + step], "b": [20 + step], "c": [40 + step]}
        expected, actual = (runner.step(batch) for runner in runners)
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    # the caches hold the same K/V afterwards
    torch.testing.assert_close(runners[1].kv_cache, runners[0].kv_cache, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape", ["one", "two"])
def test_several_new_tokens_per_sequence_match_the_python_layers(shape):
    """A speculative verification: k + 1 new tokens per sequence over its cached context, causal
    among themselves (and a short fresh prompt, which takes the same path)."""
    python, native = quantized_pair()
    runners = PagedRunner(python), PagedRunner(native)
    prompts = {"a": [5, 9, 14, 3, 7, 11, 3]} if shape == "one" else {"a": [5, 9, 14, 3, 7, 11, 3], "b": [8, 1, 22, 4]}
    for runner in runners:
        runner.step(prompts)
    for step in range(3):
        batch = {seq_id: [10 + step, 11, 12, 13] for seq_id in prompts}  # 4 rows each: the C++ loop
        expected, actual = (runner.step(batch, all_logits=True) for runner in runners)
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    fresh = [runner.step({"fresh": [3, 1, 4, 1, 5]}, all_logits=True) for runner in runners]
    torch.testing.assert_close(fresh[1], fresh[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runners[1].kv_cache, runners[0].kv_cache, atol=1e-6, rtol=1e-6)


def test_contiguous_single_sequence_reads_its_context_in_place():
    python, native = quantized_pair()
    caches = [model.allocate_kv_cache(num_blocks=8, block_size=4) for model in (python, native)]
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    with torch.inference_mode():
        for model, cache in zip((python, native), caches):
            meta = AttentionMetadata.build([len(tokens)], [len(tokens)], [list(range(8))], 4)
            model(torch.tensor(tokens), meta.positions(), cache, meta)
        results = []
        for model, cache in zip((python, native), caches):
            meta = AttentionMetadata.build([1], [len(tokens) + 1], [list(range(8))], 4)
            assert meta.contiguous_first_block == 0
            results.append(model(torch.tensor([7]), meta.positions(), cache, meta))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)


def test_it_applies_only_where_it_is_exact():
    assert NativeDecoder.for_model(build_tiny_model()) is None  # float projections
    windowed = build_tiny_model(sliding_window=8)
    quantize_model(windowed, "int4", dense_dtype=torch.bfloat16)
    assert NativeDecoder.for_model(windowed) is None
    _, native = quantized_pair()
    decoder = native.native_decoder
    one = AttentionMetadata.build([1], [5], [[0, 1]], 4)
    verify = AttentionMetadata.build([4, 4], [9, 6], [[0, 1, 2], [3, 4]], 4)  # the same new tokens per sequence
    ragged = AttentionMetadata.build([3, 1], [3, 5], [[0], [1, 2]], 4)
    too_many = AttentionMetadata.build([9], [9], [[0, 1, 2]], 4)
    assert decoder.applies(one) and decoder.applies(verify)
    assert not decoder.applies(ragged) and not decoder.applies(too_many)
    assert copy.deepcopy(native).native_decoder is None  # a copy must not run the original's weights


def test_each_row_attends_alone_so_its_result_does_not_depend_on_the_batch():
    ext = load_extension()
    kv = torch.randn(2, 20 * 4, 3, 16)  # [2, slots, Hkv, D]
    q = torch.randn(5, 6, 16)  # 5 rows of one sequence, 6 heads
    tables = torch.randperm(20).view(1, -1)
    lengths = [60 + j for j in range(5)]
    together = ext.attend_rows(q, kv, tables, lengths, [5], -1, 4, 0.25)
    alone = torch.cat([ext.attend_rows(q[j : j + 1], kv, tables, [lengths[j]], [1], -1, 4, 0.25) for j in range(5)])
    assert torch.equal(together, alone)  # bit for bit
    blocks = kv.view(2, 20, 4, 3, 16)[:, tables[0]].reshape(2, -1, 3, 16)
    k, v = blocks.transpose(1, 2)  # [Hkv, C, D]
    for j, length in enumerate(lengths):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[j].view(3, 2, 16), k[:, :length], v[:, :length], scale=0.25).reshape(-1)
        torch.testing.assert_close(together[j], ref, atol=1e-5, rtol=1e-5)
