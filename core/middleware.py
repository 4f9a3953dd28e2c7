"""Async middleware chains over synchronous pluggy hooks.

A handler is an async callable; a middleware factory takes the next handler and returns a
handler that wraps it (the ASGI pattern; the types are in :mod:`loopstack.types`). Hooks return
factories; the kernel collects them once per combination of A/B arms into a
:class:`MiddlewareStack`, and a host composes that stack around its endpoint once per
combination with a :class:`Chain`, so every request with the same arms reuses one chain.

Example::

    class Agent:
        def __init__(self, client):
            self.client = client
            self._model_chain = Chain("model", self._call_model)  # the endpoint may be a bound method

        async def _call_model(self, request, ctx):
            ...

        async def turn(self, request, ctx):
            async for event in self._model_chain.handler(ctx)(request, ctx):
                ...
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Generic, TypeVar

from loopstack.types import Handler, MiddlewareFactory

if TYPE_CHECKING:
    from loopstack.context import RequestContext

__all__ = ["Chain", "Handler", "MiddlewareFactory", "MiddlewareStack", "compose"]

H = TypeVar("H", bound=Handler)


def compose(factories: Iterable[MiddlewareFactory | None], endpoint: Handler) -> Handler:
    """Wrap ``endpoint`` in ``factories``, the first one outermost.

    ``None`` entries (plugins that chose not to wrap this call) are skipped, so a
    plugin that is off or idle adds no frame to the hot path.
    """
    handler = endpoint
    for factory in reversed([f for f in factories if f is not None]):
        handler = factory(handler)
    return handler


def _is_module_level(endpoint: object) -> bool:
    """A plain function defined at a module's top level (not a closure, lambda or method)."""
    return (isinstance(endpoint, types.FunctionType) and "<locals>" not in endpoint.__qualname__
            and endpoint.__name__ != "<lambda>")


class MiddlewareStack:
    """The middleware factories of one chain kind for one combination of arms, outermost first.

    Made once per combination by the kernel and immutable; a :class:`Chain` keys its composed
    handlers on it weakly, so a retired stack's chains go with it.
    """

    __slots__ = ("kind", "factories", "_around", "__weakref__")

    def __init__(self, kind: str, factories: Iterable[MiddlewareFactory]) -> None:
        self.kind = kind
        self.factories: tuple[MiddlewareFactory, ...] = tuple(factories)
        # module-level endpoint -> composed chain (the chain holds its endpoint: weak keys would
        # never be freed, so only functions that live for the whole process are cached)
        self._around: dict[Handler, Handler] = {}

    def around(self, endpoint: H) -> H:
        """This stack composed around ``endpoint``, cached for module-level functions (they live
        as long as the process, so the cache stays small); any other endpoint (a closure or
        lambda made per call, a bound method, a partial) is composed anew on every call: hold a
        :class:`Chain` for those."""
        if not _is_module_level(endpoint):
            return compose(self.factories, endpoint)  # type: ignore[return-value]
        chain = self._around.get(endpoint)
        if chain is None:
            chain = self._around[endpoint] = compose(self.factories, endpoint)
        return chain  # type: ignore[return-value]

    def cached_endpoints(self) -> tuple[Handler, ...]:
        """The endpoints :meth:`around` keeps a composed chain for (module-level functions)."""
        return tuple(self._around)

    def __len__(self) -> int:
        return len(self.factories)

    def __repr__(self) -> str:
        return f"<MiddlewareStack {self.kind!r} of {len(self.factories)}>"


class Chain(Generic[H]):
    """One endpoint with the middlewares of chain ``kind`` around it, composed once per
    combination of arms and kept by the host (an agent, a server) for as long as it lives."""

    def __init__(self, kind: str, endpoint: H) -> None:
        self.kind = kind
        self.endpoint = endpoint
        self._handlers: weakref.WeakKeyDictionary[MiddlewareStack, H] = weakref.WeakKeyDictionary()

    def handler(self, ctx: RequestContext) -> H:
        """The composed handler for ``ctx``'s combination of arms."""
        stack = ctx.middleware(self.kind)
        handler = self._handlers.get(stack)
        if handler is None:
            handler = self._handlers[stack] = compose(stack.factories, self.endpoint)  # type: ignore[assignment]
        return handler  # type: ignore[return-value]
