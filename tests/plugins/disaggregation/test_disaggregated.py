"""Disaggregated serving with real worker processes on a tiny model: one prefill and one decode
worker joined by the shared-memory or the TCP connector, behind the router. Output equals the
colocated engine's token for token; every failure ends the request (failed or retried) with every
block back on both sides."""

from __future__ import annotations

import asyncio
import functools
import os
import time

import pytest

from loopstack.engine.llm_engine import EngineOptions
from loopstack.engine.loaders.safetensors_loader import save_hf_directory
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.sequence import FinishReason
from loopstack.inference.disaggregated import DisaggregationOptions
from loopstack.inference.fleet import start_disaggregated_router, start_embedded_router
from loopstack.inference.topology import Disaggregated
from loopstack.plugins.disaggregation.shm import SharedMemoryConnector
from loopstack.plugins.disaggregation.tcp import TcpConnector
from loopstack.testing.tiny_model import build_tiny_model, tiny_tokenizer_json

OPTIONS = EngineOptions(block_size=4, num_kv_blocks=256, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9] * 4, [10, 11, 12], list(range(30, 70)), [3] * 7]
CONNECTORS = {"shm": SharedMemoryConnector, "tcp": functools.partial(TcpConnector, idle_timeout=2.0)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    save_hf_directory(build_tiny_model(vocab_size=260), directory, tokenizer_json=tiny_tokenizer_json())
    return str(directory)


def start(model_dir, connector="shm", *, decode_workers=1, prefill_workers=1, **options):
    topology = Disaggregated(prefill_workers, decode_workers, CONNECTORS[connector],
                             DisaggregationOptions(**options), threads_per_worker=1)
    return start_disaggregated_router(model_dir, topology, OPTIONS, dtype="float32")


async def collect(router, prompt, params=GREEDY, request_id=None):
    tokens, last = [], None
    async for output in router.stream(prompt, params, request_id=request_id):
        tokens += output.new_token_ids
        last = output
    return tokens, last


def run(router, coro, timeout=120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def settled(router, timeout=10.0):
    """Both sides' statistics once nothing is in flight: blocks, held requests, leases, imports."""
    view = router.disaggregation
    deadline = time.monotonic() + timeout
    while True:
        stats = router.loop.run(view.prefill.statistics()) + router.loop.run(view.decode.statistics())
        live = [s for s in stats if s.is_alive]
        busy = [s for s in live if s.blocks.num_used_blocks or s.num_held or s.num_importing or s.num_running
                or (s.connector or {}).get("leases_held")]
        if not busy or time.monotonic() > deadline:
            return live, busy
        time.sleep(0.05)


@pytest.fixture(scope="module")
def colocated(model_dir):
    router = start_embedded_router(model_dir, 1, OPTIONS, dtype="float32", threads_per_replica=1)
    try:
        yield [run(router, collect(router, p))[0] for p in PROMPTS]
    finally:
        router.shutdown()


@pytest.mark.parametrize("connector", ["shm", "tcp"])
def test_disaggregated_greedy_output_is_colocated_output(model_dir, colocated, connector):
    router = start(model_dir, connector)
    try:
        alone = [run(router, collect(router, p))[0] for p in PROMPTS]

        async def together():
            return await asyncio.gather(*(collect(router, p) for p in PROMPTS))

        at_once = [tokens for tokens, _ in run(router, together())]
        assert alone == colocated and at_once == colocated
        log = router.disaggregation.log
        assert log.num_handoffs == log.num_imported == 2 * len(PROMPTS) and log.num_failed == 0
        assert min(log.bytes[: len(PROMPTS)]) > 0
        # the second time, the decode worker caches the prompts' full blocks: only the tails move
        assert sum(log.bytes[len(PROMPTS) :]) < sum(log.bytes[: len(PROMPTS)])
        live, busy = settled(router)
        assert len(live) == 2 and not busy, busy
        prefill_connector = live[0].connector
        assert prefill_connector["num_offered"] == prefill_connector["num_released"] == 2 * len(PROMPTS)
    finally:
        router.shutdown()


def test_a_first_token_that_ends_the_request_is_not_handed_off(model_dir):
    router = start(model_dir)
    try:
        tokens, last = run(router, collect(router, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=1)))
        assert len(tokens) == 1 and last.finish_reason is FinishReason.LENGTH
        assert router.disaggregation.log.num_handoffs == 0
    finally:
        router.shutdown()


def test_no_shared_memory_is_left_behind(model_dir):
    before = set(os.listdir("/dev/shm"))
    router = start(model_dir)
    try:
        run(router, collect(router, PROMPTS[2]))
        settled(router)
    finally:
        router.shutdown()
    assert not [name for name in set(os.listdir("/dev/shm")) - before if name.startswith("lsk")]
