"""The draft_model proposer on tiny random models saved as Hugging Face directories: the target
and its draft (the same model truncated to one layer, so drafts are often rejected) share a
tokenizer; greedy output is plain output, sampling keeps the target's distribution, and both
KV caches come back to their start."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from loopstack.engine.llm_engine import EngineOptions, LLMEngine
from loopstack.engine.loaders import load_model
from loopstack.engine.loaders.safetensors_loader import save_hf_directory
from loopstack.engine.sampler import sampling_probs
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.seams.speculation import ProposerContext, SpeculationSpec
from loopstack.plugins.spec_decode.draft_model import (
    DraftModelOptions,
    DraftModelProposer,
    DraftTokenizerMismatchError,
)
from loopstack.testing.tiny_model import build_tiny_model, tiny_tokenizer_json

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9] * 4, [10, 11, 12], list(range(30, 70))]
# the 0.999 quantile of chi-square by degrees of freedom (scipy.stats.chi2.ppf(0.999, df))
CHI2_999 = {5: 20.5, 6: 22.5, 7: 24.3, 8: 26.1, 9: 27.9, 10: 29.6, 11: 31.3, 12: 32.9, 13: 34.5, 14: 36.1,
            15: 37.7, 16: 39.3, 17: 40.8, 18: 42.3, 19: 43.8, 20: 45.3, 21: 46.8, 22: 48.3, 23: 49.7, 24: 51.2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-target")
    model = build_tiny_model(vocab_size=260, num_layers=3, tie_word_embeddings=False)
    save_hf_directory(model, directory, tokenizer_json=tiny_tokenizer_json(),
                      tokenizer_config={"eos_token": "<|im_end|>", "bos_token": None})
    return directory


def target(model_dir) -> LLMEngine:
    model, tokenizer, _, _ = load_model(model_dir, device="cpu", dtype="float32")
    return LLMEngine(model, tokenizer, EngineOptions(num_kv_blocks=128, block_size=4, max_num_batched_tokens=64))


def draft_spec(model_dir, *, num_layers=1, k=4, adaptive=False, **options) -> SpeculationSpec:
    opts = DraftModelOptions(model=str(model_dir), num_layers=num_layers, quantization="none", block_size=4,
                             num_kv_blocks=options.pop("num_kv_blocks", 64), **options)
    return SpeculationSpec(functools.partial(DraftModelProposer, options=opts), key=f"draft:{opts!r}",
                           num_speculative_tokens=k, adaptive=adaptive)


def run(engine, prompts, params, spec=None, tag="r"):
    engine.block_manager.reset_prefix_cache()
    seqs = [engine.add_request(f"{tag}-{i}", p, params, speculation=spec) for i, p in enumerate(prompts)]
    while any(not s.is_finished for s in seqs):
        engine.step()
    return [s.output_token_ids for s in seqs]


def draft_of(engine, spec) -> DraftModelProposer:
    proposer = engine.speculator.proposers[spec.key]
    assert isinstance(proposer, DraftModelProposer)
    return proposer


@pytest.mark.parametrize("num_layers", [1, None])  # a poor draft (many rollbacks) and the target itself
def test_greedy_output_is_plain_output_and_both_caches_come_back(model_dir, num_layers):
    engine = target(model_dir)
    plain = [run(engine, [p], GREEDY, tag=f"plain{i}")[0] for i, p in enumerate(PROMPTS)]
    spec = draft_spec(model_dir, num_layers=num_layers)
    alone = [run(engine, [p], GREEDY, spec, tag=f"spec{i}")[0] for i, p in enumerate(PROMPTS)]
    assert alone == plain
    mixed = run(engine, PROMPTS, GREEDY, spec, tag="mixed")
    assert mixed == plain
    stats = engine.speculator.statistics
    assert stats.num_proposed > 0
    if num_layers is None:  # the target as its own draft: (nearly) every draft token is kept
        assert stats.num_accepted / stats.num_proposed > 0.9
    else:
        assert stats.num_accepted < stats.num_proposed  # rejections happened: rollbacks ran
    draft = draft_of(engine, spec)
    assert engine.block_manager.statistics().num_used_blocks == 0
    assert draft.block_manager.statistics().num_used_blocks == 0
    assert draft.block_manager.statistics().num_sequences == 0


def test_after_rollbacks_the_draft_cache_holds_exactly_the_kept_tokens(model_dir):
    """Every draft forward, run from the draft's paged cache after its rollbacks, gives the
    logits of a fresh forward over the same tokens (a stale or misplaced KV entry would not)."""
    engine = target(model_dir)
    spec = draft_spec(model_dir)
    engine.add_request("warm", PROMPTS[1], GREEDY, speculation=spec)
    engine.step()
    draft = draft_of(engine, spec)
    checked = []
    forward = draft._forward

    def checking_forward(items):
        logits = forward(items)
        for row, (_, tokens, _) in enumerate(items):
            fresh = forward_alone(draft.model, tokens)
            torch.testing.assert_close(logits[row], fresh, atol=1e-4, rtol=1e-4)
        checked.extend(items)
        return logits

    draft._forward = checking_forward
    run(engine, PROMPTS, GREEDY, spec, tag="check")
    assert len(checked) > 20 and engine.speculator.statistics.num_accepted < engine.speculator.statistics.num_proposed


def forward_alone(model, tokens) -> torch.Tensor:
    from loopstack.engine.model.attention import AttentionMetadata

    blocks = -(-len(tokens) // 4)
    cache = model.allocate_kv_cache(blocks, 4)
    meta = AttentionMetadata.build([len(tokens)], [len(tokens)], [list(range(blocks))], 4, device=model.device)
    with torch.inference_mode():
        return model(torch.tensor(tokens), meta.positions(), cache, meta)[0]


def test_an_aborted_request_frees_its_draft_blocks(model_dir):
    engine = target(model_dir)
    spec = draft_spec(model_dir)
    free_at_start = engine.block_manager.statistics().num_free_blocks
    seq = engine.add_request("a", PROMPTS[2], GREEDY, speculation=spec)
    for _ in range(3):
        engine.step()
    draft = draft_of(engine, spec)
    assert "a" in draft.block_manager
    engine.abort(seq.request_id)
    assert "a" not in draft.block_manager
    assert draft.block_manager.statistics().num_used_blocks == 0
    engine.block_manager.reset_prefix_cache()
    assert engine.block_manager.statistics().num_free_blocks == free_at_start


def test_a_full_draft_cache_only_shortens_drafts(model_dir):
    engine = target(model_dir)
    plain = run(engine, PROMPTS, GREEDY, tag="plain")
    spec = draft_spec(model_dir, num_kv_blocks=12)  # 48 slots: not enough for the three prompts at once
    assert run(engine, PROMPTS, GREEDY, spec, tag="small") == plain
    assert draft_of(engine, spec).block_manager.statistics().num_used_blocks == 0


def test_a_draft_as_costly_as_the_target_switches_itself_off(model_dir):
    engine = target(model_dir)
    spec = draft_spec(model_dir, num_layers=None, adaptive=True)
    run(engine, PROMPTS, GREEDY, spec)
    draft = draft_of(engine, spec)
    assert draft.cost_per_token == pytest.approx(1.0)
    # it drafts once per sequence to learn, then only when its evidence has faded
    assert engine.speculator.statistics.num_verifies < 0.5 * sum(GREEDY.max_tokens for _ in PROMPTS)


def test_sampling_with_a_draft_model_keeps_the_target_distribution(model_dir):
    """The second output token is drafted (the first comes from the prefill); its frequencies over
    many seeded runs match the target's exact marginal (chi-square; a draft distribution off by
    a factor, say, fails it by far)."""
    engine = target(model_dir)
    params = SamplingParams(temperature=1.0, top_k=5, max_tokens=3, ignore_eos=True)  # room for one draft
    spec = draft_spec(model_dir, k=1)
    prompt = [40, 41, 42, 43]
    n = 1600
    seqs = []
    for start in range(0, n, 4):  # speculation is on in steps of up to 4 sequences
        batch = [engine.add_request(f"s{i}", prompt, params.model_copy(update={"seed": i}), speculation=spec)
                 for i in range(start, start + 4)]
        while any(not s.is_finished for s in batch):
            engine.step()
        seqs += batch
    stats = engine.speculator.statistics
    assert stats.num_verifies == n and 0 < stats.num_accepted < n  # the second token was verified, both ways
    counts = Counter(s.output_token_ids[1] for s in seqs)
    expected = exact_second_token(engine, prompt, params)
    chi2 = 0.0
    for token, p in expected.items():
        chi2 += (counts.get(token, 0) - n * p) ** 2 / (n * p)
    assert sum(c for t, c in counts.items() if t not in expected) == 0
    df = len(expected) - 1
    assert df >= 5 and chi2 < CHI2_999[df]  # the seeds are fixed: a pass is a pass for good


def exact_second_token(engine, prompt, params) -> dict[int, float]:
    def probs(ids):
        return sampling_probs(forward_alone(engine.model, ids)[None], params)[0]

    first = probs(prompt)
    marginal: Counter[int] = Counter()
    for t1 in torch.nonzero(first).flatten().tolist():
        second = probs(prompt + [t1])
        for t2 in torch.nonzero(second).flatten().tolist():
            marginal[t2] += float(first[t1] * second[t2])
    return dict(marginal)


def test_a_draft_with_another_tokenizer_is_refused(model_dir):
    from loopstack.testing.tiny_model import byte_tokenizer

    context = ProposerContext(260, (255,), torch.device("cpu"), byte_tokenizer())
    with pytest.raises(DraftTokenizerMismatchError, match="does not share the target's tokenizer"):
        DraftModelProposer(context, DraftModelOptions(model=str(model_dir), quantization="none"))
