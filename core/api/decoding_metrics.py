"""How a request was decoded, in the metrics registry, labelled by its arms.

The engine counts per request (its forwards and, when it speculated, its
:class:`~loopstack.engine.speculator.SpeculationStatistics`, on the request's last output's
usage); the API records them here once the response is done, so ``loopstack ab report`` compares
the ``spec_decode`` arms on tokens per forward as on latency.
Engine-wide totals (every request together) stay in ``engine.statistics()["speculation"]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loopstack.context import RequestContext
    from loopstack.engine.speculator import SpeculationStatistics

__all__ = ["record_decoding"]

COUNT_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)  # accepted tokens per verify
PER_FORWARD_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0, 33.0)


def record_decoding(ctx: RequestContext, completion_tokens: int, forwards: int | None,
                    stats: SpeculationStatistics | None) -> None:
    """Record one finished request under ``ctx``'s plugin and arm labels: its tokens per target
    forward (embedded engines report ``forwards``; plain decoding is 1.0, so the arms of a
    ``spec_decode`` experiment compare on it) and, when it speculated, its speculation ``stats``."""
    if forwards:
        ctx.observe("engine_tokens_per_forward", completion_tokens / forwards, buckets=PER_FORWARD_BUCKETS,
                    help="output tokens per target forward that appended any, per request (1 without speculation)")
    if stats is None:
        return
    ctx.count("engine_speculation_requests_total", help="requests that decoded speculatively")
    ctx.count("engine_speculation_draft_tokens_total", stats.num_proposed, help="draft tokens verified")
    ctx.count("engine_speculation_accepted_tokens_total", stats.num_accepted, help="draft tokens accepted")
    ctx.count("engine_speculation_verifies_total", stats.num_verifies, help="target forwards that verified a draft")
    ctx.count("engine_speculation_off_steps_total", stats.num_off_steps,
              help="decode steps that did not speculate: the batch was above max_batch_size")
    if stats.num_verifies:
        ctx.observe("engine_speculation_tokens_per_verify", stats.tokens_per_forward, buckets=PER_FORWARD_BUCKETS,
                    help="tokens appended per target forward that verified a draft, per request")
    for length, count in enumerate(stats.acceptance_lengths):
        for _ in range(count):
            ctx.observe("engine_speculation_acceptance_length", length, buckets=COUNT_BUCKETS,
                        help="draft tokens accepted per verify")
