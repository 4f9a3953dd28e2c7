"""Async middleware chains over synchronous pluggy hooks.

A handler is an async callable. A middleware factory takes the next handler and returns
a handler that wraps it (the ASGI pattern). Hooks return factories; the host composes
them once per combination of A/B arms and reuses the chain for every request that
has that combination.

Example::

    def timing(next_handler):
        async def handler(request, ctx):
            started = time.perf_counter()
            async for event in next_handler(request, ctx):
                yield event
            ctx.observe("model_call_seconds", time.perf_counter() - started)
        return handler
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

Handler = Callable[..., Any]
MiddlewareFactory = Callable[[Handler], Handler]


def compose(factories: Iterable[MiddlewareFactory | None], endpoint: Handler) -> Handler:
    """Wrap ``endpoint`` in ``factories``, the first one outermost.

    ``None`` entries (plugins that chose not to wrap this call) are skipped, so a
    plugin that is off or idle adds no frame to the hot path.
    """
    handler = endpoint
    for factory in reversed([f for f in factories if f is not None]):
        handler = factory(handler)
    return handler
