"""A shortened Mooncake replay served by real replicas: the prompts, the driver, the figures.

:func:`build_replay` keeps the trace's first multi-turn conversations (a conversation: requests
sharing their first block after the common system prompt), at most ``max_turns`` turns each, and
turns every 512-token hash id into ``block_tokens`` token ids drawn from a generator seeded by that id,
so equal ids give equal token blocks and a turn's prompt extends its previous turn's, as in the
trace. Prompts keep at most ``max_blocks`` blocks, outputs at most ``max_output_tokens`` tokens, and
arrival times are the trace's, compressed into ``span_s`` seconds.

:func:`drive` sends every request at its arrival time (concurrently, as traffic arrives) through a
``send`` function and measures, per request, the time to the first output with text and whether
it finished; it returns TTFT p50/p99, output tokens per second over the replay, and the cached
share of prompt tokens where the replicas report it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from loopstack.plugins.cache_routing.bench.replay import quantile
from loopstack.plugins.cache_routing.bench.trace import TraceRequest

__all__ = ["LiveRequest", "LiveResult", "build_replay", "drive"]


@dataclass(frozen=True)
class LiveRequest:
    at_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    key: str  # the conversation: sent as prompt_cache_key


@dataclass(frozen=True)
class Chunk:
    """What a driver's ``send`` yields per output: text, and usage when known (else None)."""

    text: str
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None


@dataclass(frozen=True)
class LiveResult:
    num_requests: int
    num_failed: int
    ttft_p50_s: float
    ttft_p99_s: float
    output_tokens_per_s: float
    hit_rate: float | None  # cached / prompt tokens; None when the replicas do not report it
    wall_s: float


def build_replay(
    requests: Sequence[TraceRequest], *, num_conversations: int, max_turns: int = 4, block_tokens: int = 16,
    max_blocks: int = 40, max_output_tokens: int = 16, span_s: float = 60.0, vocab: tuple[int, int] = (200, 40000),
) -> list[LiveRequest]:
    conversations: dict[int, list[TraceRequest]] = {}
    for request in requests:
        if len(request.hash_ids) > 1:
            conversations.setdefault(request.hash_ids[1], []).append(request)
    chosen = [turns[:max_turns] for turns in conversations.values() if len(turns) >= 3][:num_conversations]
    picked = sorted(((r, str(turns[0].hash_ids[1])) for turns in chosen for r in turns), key=lambda p: p[0].arrival_s)
    if not picked:
        raise ValueError("the trace has no conversation of three or more turns")
    start = picked[0][0].arrival_s
    scale = span_s / max(1e-9, picked[-1][0].arrival_s - start)
    blocks: dict[int, tuple[int, ...]] = {}

    def block(hash_id: int) -> tuple[int, ...]:
        if hash_id not in blocks:
            rng = random.Random(hash_id)
            blocks[hash_id] = tuple(rng.randrange(*vocab) for _ in range(block_tokens))
        return blocks[hash_id]

    return [
        LiveRequest(
            (request.arrival_s - start) * scale,
            tuple(token for hash_id in request.hash_ids[:max_blocks] for token in block(hash_id)),
            max(1, min(max_output_tokens, request.output_length)),
            key,
        )
        for request, key in picked
    ]


async def drive(replay: Sequence[LiveRequest], send: Callable[[LiveRequest], AsyncIterator[Chunk]]) -> LiveResult:
    started = time.perf_counter()

    async def one(request: LiveRequest) -> tuple[float | None, Chunk | None, int]:
        await asyncio.sleep(max(0.0, started + request.at_s - time.perf_counter()))
        sent, first, last, num_chunks = time.perf_counter(), None, None, 0
        try:
            async for chunk in send(request):
                if first is None and chunk.text:
                    first = time.perf_counter() - sent
                last = chunk
                num_chunks += 1
        except Exception:
            return None, None, 0
        return first, last, num_chunks

    results = await asyncio.gather(*(one(request) for request in replay))
    wall = time.perf_counter() - started
    ttfts = sorted(first for first, _, _ in results if first is not None)
    finals = [last for first, last, _ in results if first is not None and last is not None]
    outputs = sum(last.completion_tokens or chunks for (_, last, chunks) in results if last is not None)
    reported = [f for f in finals if f.prompt_tokens and f.cached_tokens is not None]
    hit_rate = (sum(f.cached_tokens or 0 for f in reported) / sum(f.prompt_tokens or 0 for f in reported)
                if reported and len(reported) == len(finals) else None)
    return LiveResult(
        num_requests=len(replay), num_failed=len(replay) - len(ttfts),
        ttft_p50_s=quantile(ttfts, 0.5), ttft_p99_s=quantile(ttfts, 0.99),
        output_tokens_per_s=outputs / wall if wall else 0.0, hit_rate=hit_rate, wall_s=wall,
    )

