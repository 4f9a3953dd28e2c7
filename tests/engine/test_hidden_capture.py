"""Hidden-state capture: the mean residual stream over prompt spans, taken from the prefill."""

from __future__ import annotations

import asyncio

import pytest
import torch

from loopstack.engine import AsyncEngine
from loopstack.engine.capture import HiddenCapture, InvalidHiddenCaptureError
from loopstack.engine.model.llama import CausalLM
from loopstack.engine.sampling_params import SamplingParams
from tests.engine.support import dense_residual, make_engine

PROMPT = list(range(30, 90))  # 60 tokens: 15 blocks of 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
SPANS = ((9, 27), (40, 55))


def reference_hidden(model: CausalLM, token_ids: list[int], num_layers: int) -> torch.Tensor:
    """``[S, hidden]`` residual stream after ``num_layers`` layers, from the dense reference."""
    return dense_residual(model, token_ids, num_layers)


def span_mean(hidden: torch.Tensor, spans) -> torch.Tensor:
    return torch.cat([hidden[start:end] for start, end in spans]).mean(0)


def captured(engine, prompt=PROMPT, spans=SPANS, num_layers=1, request_id="r"):
    """(hidden state, outputs, sequence) of one request run to the end."""
    seq = engine.add_request(request_id, prompt, PARAMS, capture=HiddenCapture(num_layers=num_layers, spans=spans))
    outputs = []
    while not seq.is_finished:
        outputs += [o for o in engine.step() if o.request_id == request_id]
    states = [o.hidden_state for o in outputs if o.hidden_state is not None]
    assert len(states) == 1  # delivered exactly once
    return states[0], outputs, seq


@pytest.mark.parametrize("num_layers", [1, 2])
def test_capture_equals_the_mean_of_a_dense_reference(num_layers):
    engine = make_engine(max_num_batched_tokens=256)
    hidden, _, _ = captured(engine, num_layers=num_layers)
    expected = span_mean(reference_hidden(engine.model, PROMPT, num_layers), SPANS)
    assert hidden.dtype == torch.float32 and hidden.shape == (engine.model.config.hidden_size,)
    torch.testing.assert_close(hidden, expected, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_equals_one_shot_and_reports_before_the_prompt_ends():
    spans = ((9, 27), (30, 40))
    one_shot, _, _ = captured(make_engine(max_num_batched_tokens=256), spans=spans)
    chunked, outputs, _ = captured(make_engine(max_num_batched_tokens=16), spans=spans)
    torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=1e-5)
    # the spans end at 40, inside the third 16-token chunk: an output without tokens carries it
    first = next(o for o in outputs if o.hidden_state is not None)
    assert first.new_token_ids == [] and not first.finished and outputs.index(first) == 0


def test_a_prefix_cache_hit_stops_at_the_first_span():
    cold, _, _ = captured(make_engine())
    engine = make_engine()
    engine.generate([PROMPT], PARAMS)  # caches the prompt's blocks (the last token is never reused)
    hit, _, seq = captured(engine, request_id="hit")
    # two blocks of four and the third's first token (copied): the first span starts at 9
    assert seq.num_cached_prompt_tokens == 9
    torch.testing.assert_close(hit, cold, atol=1e-5, rtol=1e-5)
    again = engine.add_request("plain", PROMPT, PARAMS)
    engine.step()
    assert again.num_cached_prompt_tokens == 60  # without a capture the whole prompt (and its kept logits)


def test_preemption_restarts_an_unfinished_capture():
    expected, _, _ = captured(make_engine())
    engine = make_engine(max_num_batched_tokens=16)
    seq = engine.add_request("p", PROMPT, PARAMS, capture=HiddenCapture(num_layers=1, spans=SPANS))
    engine.step()  # tokens 0..15: the first 7 captured positions
    assert seq.capture.num_captured_tokens == 7
    engine.scheduler.preempt(seq)
    assert seq.capture.num_captured_tokens == 0 and seq.capture.running_sum is None
    states = []
    while not seq.is_finished:
        states += [o.hidden_state for o in engine.step() if o.hidden_state is not None]
    assert len(states) == 1 and seq.num_preemptions == 1
    torch.testing.assert_close(states[0], expected, atol=1e-5, rtol=1e-5)


def test_captures_survive_preemption_under_block_pressure():
    prompts = [PROMPT[:24], PROMPT[10:30], PROMPT[:7]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(engine):
        seqs = [engine.add_request(f"s{i}", p, params, capture=HiddenCapture(num_layers=2, spans=((1, len(p)),)))
                for i, p in enumerate(prompts)]
        states: dict[str, torch.Tensor] = {}
        while any(not s.is_finished for s in seqs):
            for output in engine.step():
                if output.hidden_state is not None:
                    assert output.request_id not in states
                    states[output.request_id] = output.hidden_state
        return [states[s.request_id] for s in seqs]

    tight = make_engine(num_kv_blocks=14, max_num_batched_tokens=32)
    for got, want in zip(run(tight), run(make_engine()), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert tight.scheduler.statistics().num_preemptions > 0


def test_an_unfinished_capture_is_dropped_on_abort_and_costs_nothing_after():
    engine = make_engine(max_num_batched_tokens=16)
    engine.add_request("a", PROMPT, PARAMS, capture=HiddenCapture(num_layers=1, spans=SPANS))
    engine.step()
    assert engine.statistics()["pending_captures"] == 1
    assert engine.abort("a").hidden_state is None
    assert engine.statistics()["pending_captures"] == 0
    assert engine.block_manager.statistics().num_used_blocks == 0


@pytest.mark.parametrize("capture, message", [
    ({"num_layers": 3, "spans": ((0, 4),)}, "the model has 2"),
    ({"num_layers": 1, "spans": ((50, 61),)}, "past the prompt's 60 tokens"),
])
def test_a_capture_that_does_not_fit_is_refused_when_added(capture, message):
    with pytest.raises(InvalidHiddenCaptureError, match=message):
        make_engine().add_request("x", PROMPT, PARAMS, capture=HiddenCapture(**capture))


@pytest.mark.parametrize("values, message", [
    ({"num_layers": 0, "spans": ((0, 4),)}, "num_layers"),
    ({"num_layers": 1, "spans": ()}, "spans"),
    ({"num_layers": 1, "spans": ((4, 4),)}, r"span \(4, 4\) must be non-empty"),
    ({"num_layers": 1, "spans": ((0, 8), (6, 9))}, "previous span's end"),
])
def test_malformed_captures_name_the_problem(values, message):
    with pytest.raises(InvalidHiddenCaptureError, match=message):
        HiddenCapture.make(**values)


def test_the_async_engine_delivers_the_capture_through_stream_and_generate():
    expected, _, _ = captured(make_engine(max_num_batched_tokens=16))
    engine = AsyncEngine(make_engine(max_num_batched_tokens=16))
    capture = HiddenCapture(num_layers=1, spans=SPANS)

    async def scenario():
        streamed = [o.hidden_state async for o in engine.stream(PROMPT, PARAMS, capture=capture)
                    if o.hidden_state is not None]
        result = await engine.generate(PROMPT, PARAMS, capture=capture)
        return streamed, result

    try:
        streamed, result = asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        engine.shutdown()
    assert len(streamed) == 1 and engine.hidden_state_model == engine.engine.model.config
    torch.testing.assert_close(streamed[0], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.hidden_state, expected, atol=1e-5, rtol=1e-5)
