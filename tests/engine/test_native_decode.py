"""The C++ decode layer loops (native_decode) against the Python layers they replace.

Two loops: torch's int4pack projections run the Python layers' ATen ops in the same order (equal
to 1e-5); q4q8 projections run plain loops whose float operations differ in order from the Python
layers' (equal to rounding: a 15-bit activation digit can round the other way), and whose rows do
not depend on the batch, bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

from loopstack.engine.model.attention import AttentionMetadata
from loopstack.engine.model.extension import has_q4q8
from loopstack.engine.model.native_decode import NativeDecoder, load_extension
from loopstack.engine.model.quant import quantize_model
from loopstack.engine.model_runner import resolve_kv_cache_dtype
from tests.engine.support import PagedRunner, build_tiny_model

pytestmark = pytest.mark.skipif(
    load_extension() is None, reason="the native decode extension could not be built here (see the log)"
)
KERNELS = ["int4pack", pytest.param("q4q8", marks=pytest.mark.skipif(not has_q4q8(), reason="no AVX-512 VNNI here"))]
# the caches the C++ loops read: float32, and float16 (the default under them: half the bytes)
KV_DTYPES = pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["kv-float32", "kv-float16"])


def quantized_pair(kernel="q4q8", head=None, **overrides):
    """The same int4 model twice: one on the Python layers, one on the C++ loop."""
    python = build_tiny_model(**overrides)
    quantize_model(python, "int4", head=head, dense_dtype=torch.bfloat16, int4_kernel=kernel)
    native = copy.deepcopy(python)
    native.native_decoder = NativeDecoder.for_model(native)
    assert native.native_decoder is not None and native.native_decoder.is_q4q8 == (kernel == "q4q8")
    return python, native


def assert_matches(actual, expected, kernel):
    if kernel == "int4pack":
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:  # the same math in another order of float operations
        torch.testing.assert_close(actual, expected, atol=2e-3 * expected.abs().max().item(), rtol=0)


@KV_DTYPES
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": True}], ids=["llama", "qwen2-bias"])
def test_decode_steps_match_the_python_layers(overrides, kernel, kv_dtype):
    python, native = quantized_pair(kernel, **overrides)
    # same seed: the same shuffled block tables; the same cache dtype on both
    runners = PagedRunner(python, kv_dtype=kv_dtype), PagedRunner(native, kv_dtype=kv_dtype)
    prompts = {"a": [5, 9, 14, 3, 7, 11, 2 + 1], "b": [8, 1, 22, 4], "c": [30, 31, 32, 33, 34, 35, 36, 37, 38]}
    for runner in runners:  # prefill (more rows than the C++ loop takes): Python on both
        runner.step(prompts)
    for step in range(6):
        batch = {"a": [10 + step]} if step % 2 else {"a": [10 + step], "b": [20 + step], "c": [40 + step]}
        expected, actual = (runner.step(batch) for runner in runners)
        assert_matches(actual, expected, kernel)
    # the caches hold the same K/V afterwards
    assert_matches(runners[1].kv_cache, runners[0].kv_cache, kernel)


@KV_DTYPES
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", ["one", "two"])
def test_several_new_tokens_per_sequence_match_the_python_layers(shape, kernel, kv_dtype):
    """A speculative verification: k + 1 new tokens per sequence over its cached context, causal
    among themselves (and a short fresh prompt, which takes the same path)."""
    python, native = quantized_pair(kernel)
    runners = PagedRunner(python, kv_dtype=kv_dtype), PagedRunner(native, kv_dtype=kv_dtype)
    prompts = {"a": [5, 9, 14, 3, 7, 11, 3]} if shape == "one" else {"a": [5, 9, 14, 3, 7, 11, 3], "b": [8, 1, 22, 4]}
    for runner in runners:
        runner.step(prompts)
    for step in range(3):
        batch = {seq_id: [10 + step, 11, 12, 13] for seq_id in prompts}  # 4 rows each: the C++ loop
        expected, actual = (runner.step(batch, all_logits=True) for runner in runners)
        assert_matches(actual, expected, kernel)
    fresh = [runner.step({"fresh": [3, 1, 4, 1, 5]}, all_logits=True) for runner in runners]
    assert_matches(fresh[1], fresh[0], kernel)
    assert_matches(runners[1].kv_cache, runners[0].kv_cache, kernel)


@KV_DTYPES
@pytest.mark.parametrize("kernel", KERNELS)
def test_contiguous_single_sequence_reads_its_context_in_place(kernel, kv_dtype):
    python, native = quantized_pair(kernel)
    caches = [model.allocate_kv_cache(num_blocks=8, block_size=4, dtype=kv_dtype) for model in (python, native)]
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
    assert_matches(results[1], results[0], kernel)


@pytest.mark.skipif(not has_q4q8(), reason="no AVX-512 VNNI here")
def test_a_q4q8_rows_logits_do_not_depend_on_the_batch():
    """What greedy speculative decoding relies on: a sequence's decode step gives the same bits
    alone or beside others, and a verified draft position the bits its plain decode step gives
    (with the engine's head: a float matmul's blocking depends on its row count)."""
    _, native = quantized_pair("q4q8", head="int8_rescored")
    assert native.lm_head.q8 is not None
    prompts = {"a": [5, 9, 14, 3, 7, 11, 3], "b": [8, 1, 22, 4], "c": [30, 31, 32, 33, 34, 35, 36, 37, 38]}
    together, alone = PagedRunner(native), {seq_id: PagedRunner(native) for seq_id in prompts}
    for seq_id, runner in alone.items():  # the same prefills (how many rows a prefill has picks its path)
        runner.step({seq_id: prompts[seq_id]})
        together.step({seq_id: prompts[seq_id]})
    batch = {seq_id: [40 + i] for i, seq_id in enumerate(prompts)}
    rows = together.step(batch)
    for i, seq_id in enumerate(prompts):
        assert torch.equal(rows[i], alone[seq_id].step({seq_id: batch[seq_id]})[0])
    # a verification of [a's next, 7, 8] gives row 0 what a decode step of a's next gives
    verify, plain = PagedRunner(native), PagedRunner(native)
    for runner in (verify, plain):
        runner.step({"a": prompts["a"]})
    assert torch.equal(verify.step({"a": [40, 7, 8]}, all_logits=True)[0], plain.step({"a": [40]})[0])


@pytest.mark.skipif(not has_q4q8(), reason="no AVX-512 VNNI here")
@pytest.mark.parametrize("rows", ["decode", "verify"])
def test_a_step_split_by_sequences_over_the_threads_gives_the_same_bits(rows):
    """A step of several sequences may run one group of whole sequences per thread, every layer
    without a section in between (q4q8_row_split): the same logits and the same cache, bit for bit."""
    _, native = quantized_pair("q4q8", head="int8_rescored")
    kernels = native.native_decoder._ext
    prompts = {name: [3 + i, 9, 14, 3 + 2 * i, 7] for i, name in enumerate("abcde")}  # five: an uneven split
    new = {name: ([40 + i] if rows == "decode" else [40 + i, 7, 8]) for i, name in enumerate(prompts)}
    threads = torch.get_num_threads()
    before = kernels.q4q8_row_split(-1)
    results, caches = [], []
    try:
        torch.set_num_threads(2)
        for split in (0, 4):
            kernels.q4q8_row_split(split)
            runner = PagedRunner(native)
            runner.step(prompts)
            grouped = kernels.q4q8_row_group_steps()
            results.append(runner.step(new, all_logits=True))
            assert kernels.q4q8_row_group_steps() - grouped == (1 if split else 0)  # the path compared ran
            caches.append(runner.kv_cache)
    finally:
        kernels.q4q8_row_split(before)
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])
    assert torch.equal(caches[0], caches[1])


def test_its_cache_is_float16_by_default_and_float32_on_request():
    python, native = quantized_pair("int4pack")
    assert python.kv_cache_dtype == torch.float32  # the Python layers: the model's dtype
    assert native.kv_cache_dtype == torch.float16 and native.allocate_kv_cache(2, 4).dtype == torch.float16
    assert resolve_kv_cache_dtype("auto", native) == torch.float16
    assert resolve_kv_cache_dtype("float32", native) == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, float16, bfloat16; got 'fp8'"):
        resolve_kv_cache_dtype("fp8", native)


def test_it_applies_only_where_it_is_exact():
    assert NativeDecoder.for_model(build_tiny_model()) is None  # float projections
    windowed = build_tiny_model(sliding_window=8)
    quantize_model(windowed, "int4", dense_dtype=torch.bfloat16)
    assert NativeDecoder.for_model(windowed) is None
    _, native = quantized_pair("int4pack")
    decoder = native.native_decoder
    one = AttentionMetadata.build([1], [5], [[0, 1]], 4)
    verify = AttentionMetadata.build([4, 4], [9, 6], [[0, 1, 2], [3, 4]], 4)  # the same new tokens per sequence
    ragged = AttentionMetadata.build([3, 1], [3, 5], [[0], [1, 2]], 4)
    too_many = AttentionMetadata.build([9], [9], [[0, 1, 2]], 4)
    assert decoder.applies(one) and decoder.applies(verify)
    assert not decoder.applies(ragged) and not decoder.applies(too_many)
    assert copy.deepcopy(native).native_decoder is None  # a copy must not run the original's weights


def attend_each_row(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lengths: list[int], block_size: int,
                    scale: float) -> None:
    """``attend_rows`` of every row of one sequence together, asserting that each row's result is
    the same bits as attending it alone and is softmax attention over its context (KV heads
    shared by groups of query heads)."""
    ext = load_extension()
    rows, num_heads, head_dim = q.shape
    num_kv_heads = kv.shape[2]
    together = ext.attend_rows(q, kv, tables, lengths, [rows], -1, block_size, scale)
    alone = torch.cat([ext.attend_rows(q[j : j + 1], kv, tables, [lengths[j]], [1], -1, block_size, scale)
                       for j in range(rows)])
    assert torch.equal(together, alone)  # bit for bit
    blocks = kv.view(2, -1, block_size, num_kv_heads, head_dim)[:, tables[0]]
    k, v = blocks.reshape(2, -1, num_kv_heads, head_dim).transpose(1, 2).float()  # [Hkv, C, D]
    for j, length in enumerate(lengths):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[j].view(num_kv_heads, num_heads // num_kv_heads, head_dim), k[:, :length], v[:, :length],
            scale=scale).reshape(-1)
        torch.testing.assert_close(together[j], ref, atol=1e-5, rtol=1e-5)


@KV_DTYPES
def test_each_row_attends_alone_so_its_result_does_not_depend_on_the_batch(kv_dtype):
    kv = torch.randn(2, 20 * 4, 3, 16).to(kv_dtype)  # [2, slots, Hkv, D]
    q = torch.randn(5, 6, 16)  # 5 rows of one sequence, 6 heads
    tables = torch.randperm(20).view(1, -1)
    attend_each_row(q, kv, tables, [60 + j for j in range(5)], 4, 0.25)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [
    (4, 4, 64), (8, 4, 64), (12, 3, 64), (24, 3, 64), (10, 2, 64), (16, 2, 128), (6, 1, 256), (6, 2, 32),
], ids=["group-1", "group-2", "group-4", "group-8", "group-5", "group-8-dim-128", "group-6-dim-256", "group-3-dim-32"])
@KV_DTYPES
def test_the_query_heads_of_a_kv_group_attend_together_for_any_group_size(num_heads, num_kv_heads, head_dim, kv_dtype):
    """A KV group's query heads read each key and value together, a few heads a pass (4, 3, 2 or
    1, by the group and head size): every split is softmax attention with shared KV heads."""
    torch.manual_seed(1)
    block_size, num_blocks = 16, 24
    kv = torch.randn(2, num_blocks * block_size, num_kv_heads, head_dim).to(kv_dtype)
    q = torch.randn(3, num_heads, head_dim)
    tables = torch.randperm(num_blocks).view(1, -1)
    attend_each_row(q, kv, tables, [5, 200, 300], block_size, head_dim ** -0.5)


@KV_DTYPES
@pytest.mark.parametrize("head_dim", [64, 48], ids=["vectorized-64", "generic-48"])
def test_long_contexts_split_into_spans_match_attention_and_each_other(head_dim, kv_dtype):
    """Contexts longer than a span (256 positions) are attended span by span and merged; the
    result is softmax attention, a row's bits do not depend on the batch, and a contiguous
    sequence read in place gives the same bits as through its block table."""
    ext = load_extension()
    torch.manual_seed(0)
    block_size, num_blocks = 16, 80
    kv = torch.randn(2, num_blocks * block_size, 3, head_dim).to(kv_dtype)
    q = torch.randn(5, 9, head_dim)  # 9 query heads over 3 KV heads
    lengths = [255, 256, 257, 700, 1030]
    tables = torch.randperm(num_blocks).view(1, -1)
    scale = head_dim ** -0.5
    attend_each_row(q, kv, tables, lengths, block_size, scale)
    in_order = torch.arange(num_blocks).view(1, -1)
    paged = ext.attend_rows(q[4:], kv, in_order, [1030], [1], -1, block_size, scale)
    in_place = ext.attend_rows(q[4:], kv, in_order, [1030], [1], 0, block_size, scale)
    assert torch.equal(paged, in_place)


@pytest.mark.skipif(not has_q4q8(), reason="no AVX-512 VNNI here")
def test_a_float16_cache_holds_the_new_keys_and_values_rounded_to_nearest():
    """The C++ loop writes a decode step's K/V into a float16 cache as torch's ``.half()`` rounds
    them (to nearest, ties to even): layer 0's new entries, which no cache read precedes, equal the
    float32 cache's rounded, bit for bit."""
    _, native = quantized_pair("q4q8")
    runners = PagedRunner(native, kv_dtype=torch.float32), PagedRunner(native, kv_dtype=torch.float16)
    prompts = {"a": [5, 9, 14, 3, 7, 11], "b": [8, 1, 22, 4, 6]}
    for runner in runners:
        runner.step(prompts)
        runner.step({"a": [12], "b": [13]})  # the decode step: the C++ loop
    for seq, position in (("a", 6), ("b", 5)):
        table = runners[0].block_tables[seq]
        block, offset = table[position // 4], position % 4
        written32 = runners[0].kv_cache[0, :, block, offset]  # [2, Hkv, D]: K and V of layer 0
        written16 = runners[1].kv_cache[0, :, runners[1].block_tables[seq][position // 4], offset]
        assert written16.abs().sum() > 0
        assert torch.equal(written16, written32.half())
