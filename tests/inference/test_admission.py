"""The router's prefill admission: budgets, shortest-first release, aging, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from loopstack.inference.admission import PrefillAdmission


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def held(admission: PrefillAdmission, key: str, num_tokens: int, order: list[str], index: int = 0) -> None:
    await admission.wait(key, index, num_tokens)
    order.append(key)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_under_the_budget_requests_go_at_once():
    async def run() -> None:
        admission = PrefillAdmission(2, budget_tokens=100)
        await admission.wait("a", 0, 60)
        await admission.wait("b", 0, 40)
        await admission.wait("c", 1, 500)  # alone on its replica: larger than the budget, still sent
        stats = admission.statistics()
        assert stats.num_outstanding_tokens == (100, 500)
        assert stats.num_admitted_at_once == 3 and stats.num_held == (0, 0)

    asyncio.run(run())


def test_the_shortest_prefill_goes_first_once_the_budget_frees():
    async def run() -> None:
        admission = PrefillAdmission(1, budget_tokens=100, max_wait_s=None)
        order: list[str] = []
        await admission.wait("long", 0, 500)
        tasks = [asyncio.create_task(held(admission, key, n, order)) for key, n in
                 [("300", 300), ("50", 50), ("60", 60), ("10", 10)]]
        await settle()
        assert order == [] and admission.statistics().num_held == (4,)
        admission.prefilled("long")  # its first output: the budget is free
        await settle()
        assert order == ["10", "50"]  # 10 + 50 fit in 100; 60 would not
        admission.prefilled("10")
        admission.prefilled("50")
        await settle()
        assert order == ["10", "50", "60"]
        admission.finished("60")  # ended before its first output (an error): its tokens come back too
        await settle()
        assert order == ["10", "50", "60", "300"]  # alone, though over the budget
        await asyncio.gather(*tasks)

    asyncio.run(run())


def test_a_request_that_waited_max_wait_goes_before_shorter_ones():
    async def run() -> None:
        clock = Clock()
        admission = PrefillAdmission(1, budget_tokens=100, max_wait_s=5.0, clock=clock)
        order: list[str] = []
        await admission.wait("running", 0, 100)
        old = asyncio.create_task(held(admission, "old", 80, order))
        await settle()
        clock.now = 6.0  # "old" has waited past max_wait_s
        young = asyncio.create_task(held(admission, "young", 10, order))
        await settle()
        admission.prefilled("running")
        await settle()
        assert order[0] == "old"
        assert admission.statistics().num_aged == 1
        await asyncio.gather(old, young)

    asyncio.run(run())


def test_a_cancelled_wait_leaves_nothing_behind():
    async def run() -> None:
        admission = PrefillAdmission(1, budget_tokens=100, max_wait_s=None)
        order: list[str] = []
        await admission.wait("running", 0, 100)
        cancelled = asyncio.create_task(held(admission, "gone", 10, order))
        waiting = asyncio.create_task(held(admission, "next", 20, order))
        await settle()
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        admission.finished("gone")  # the router's finally: a no-op for a request never sent
        admission.prefilled("running")
        await waiting
        assert order == ["next"]
        stats = admission.statistics()
        assert stats.num_held == (0,) and stats.num_outstanding_tokens == (20,)

    asyncio.run(run())


def test_replicas_have_budgets_of_their_own():
    async def run() -> None:
        admission = PrefillAdmission(2, budget_tokens=100, max_wait_s=None)
        order: list[str] = []
        await admission.wait("busy", 0, 100)
        tasks = [asyncio.create_task(held(admission, "on 0", 10, order, 0)),
                 asyncio.create_task(held(admission, "on 1", 10, order, 1))]
        await settle()
        assert order == ["on 1"]
        admission.sent_now("unordered", 1, 95)  # counted, not held: replica 1 is now over budget
        assert admission.statistics().num_outstanding_tokens == (100, 105)
        admission.finished("busy")
        await asyncio.gather(*tasks)
        assert order == ["on 1", "on 0"]

    asyncio.run(run())


def test_the_budget_must_be_positive():
    with pytest.raises(ValueError, match="budget_tokens"):
        PrefillAdmission(1, budget_tokens=0)


# -- through the router --------------------------------------------------------------------------


class FifoReplica:
    """A replica that prefills one request at a time, first come first served, 0.5 ms a token: a
    test double standing in for an engine queue (the real replicas are in test_router.py)."""

    publishes_kv_events = False

    def __init__(self, name: str) -> None:
        self.name, self.where = name, "in-process"
        self._prefill = asyncio.Lock()

    def is_up(self) -> bool:
        return True

    async def ping(self) -> bool:
        return True

    async def restart(self) -> bool:
        return False

    async def stream(self, prompt_token_ids, params, *, request_id, salt, capture, speculation=None, retention=None):
        from loopstack.engine.llm_engine import RequestOutput, Usage
        from loopstack.engine.sequence import FinishReason

        async with self._prefill:
            await asyncio.sleep(0.0005 * len(prompt_token_ids))
        usage = Usage(len(prompt_token_ids), 0, 1, None)
        yield RequestOutput(request_id, [7], "x", False, None, usage)
        yield RequestOutput(request_id, [], "", True, FinishReason.STOP, usage)


def first_output_order(write_stack, admission_mode: str) -> list[str]:
    from loopstack import PluginCatalog, StackLoader, StackRuntime
    from loopstack.inference.loop_thread import LoopThread
    from loopstack.inference.router import Router
    from loopstack.inference.types import RouteHints

    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    path = write_stack("admission", f"""
        [plugins.cache_routing]
        enabled = true
        policy = "session_affinity"
        admission = "{admission_mode}"
        admission_budget_tokens = 16
        """)
    runtime = StackRuntime(StackLoader(catalog).load(path), catalog)
    router = Router([FifoReplica("a"), FifoReplica("b")], tokenizer=None, max_model_len=4096, block_size=4,
                    loop=LoopThread(), hooks_of=lambda: runtime.hooks)
    router.loop.run(router.started())
    order: list[str] = []

    async def send(name: str, num_tokens: int, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        async for output in router.stream(list(range(num_tokens)), hints=RouteHints("one conversation")):
            if output.new_text:
                order.append(name)

    async def burst() -> None:  # one key: every request goes to the same replica
        await asyncio.gather(send("long 1", 400, 0.0), send("long 2", 400, 0.02), send("short", 8, 0.04))

    try:
        asyncio.run(burst())
        admission = router.statistics().admission
        assert (admission is not None) == (admission_mode == "shortest_first")
    finally:
        router.shutdown()
        runtime.close()
    return order


def test_without_admission_the_replica_serves_in_arrival_order(write_stack):
    assert first_output_order(write_stack, "off") == ["long 1", "long 2", "short"]


def test_with_shortest_first_admission_the_short_request_passes_the_queued_long_one(write_stack):
    assert first_output_order(write_stack, "shortest_first") == ["long 1", "short", "long 2"]
