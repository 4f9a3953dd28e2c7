"""Per-session and per-request context objects: where plugin state lives.

A :class:`RequestContext` is made by :meth:`StackRuntime.context` for every request.
It knows the request's A/B arms, answers ``enabled(plugin)``, carries the hook
facade and composed middleware chains for exactly the plugins that are on for it,
and records metrics labelled by plugin and arm.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from loopstack.experiments import DEFAULT_ARM, OFF
from loopstack.hooks import HookFacade
from loopstack.middleware import MiddlewareStack
from loopstack.types import Handler, StateKey

if TYPE_CHECKING:
    from loopstack.runtime import Combination, StackRuntime

T = TypeVar("T")


def _state_of(store: dict[Any, Any], key: StateKey[T] | str, factory: Callable[[], T] | None) -> T:
    if key in store and factory is None:  # the hot path: a typed key's value made earlier
        found: T = store[key]
        return found
    if isinstance(key, StateKey):
        if factory is not None:
            raise TypeError(f"{key!r} carries its own factory; call state(key) without one")
        factory = key.factory
    elif factory is None:
        raise TypeError(f"state({key!r}) needs a factory; better, pass a StateKey")
    if key not in store:
        store[key] = factory()
    value: T = store[key]
    return value


@dataclass
class Session:
    """A conversation: its id, tenant, and each plugin's session-scoped state."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    tenant: str = "default"
    _state: dict[str, Any] = field(default_factory=dict, repr=False)

    def state(self, key: StateKey[T] | str, factory: Callable[[], T] | None = None) -> T:
        """The state object under ``key`` for this session, created by the key's factory on
        first use. A bare string key with a ``factory`` is the older form, still accepted."""
        return _state_of(self._state, key, factory)

    def close(self) -> None:
        """End the session: every state object with a ``close()`` method is closed (in the
        order they were made), then forgotten. Safe to call twice. A state object that holds
        an outside resource (a V8 context, a connection) should also release it when the
        session is garbage-collected without being closed (``weakref.finalize``)."""
        states, self._state = list(self._state.values()), {}
        for state in states:
            close = getattr(state, "close", None)
            if callable(close):
                close()


class RequestContext:
    """Everything a hook needs to know about the request being served."""

    def __init__(
        self,
        runtime: StackRuntime,
        combination: Combination,
        session: Session,
        request_id: str,
    ) -> None:
        self.runtime = runtime
        self.session = session
        self.request_id = request_id
        self._combination = combination
        self._state: dict[str, Any] = {}

    @property
    def stack(self) -> Any:
        return self.runtime.stack

    @property
    def arms(self) -> Mapping[str, str]:
        """Experiment name -> arm, for this request."""
        return self._combination.arms

    @property
    def hooks(self) -> HookFacade:
        """Hook caller over the plugins that are on for this request."""
        return self._combination.hooks

    def enabled(self, plugin: str) -> bool:
        """True when ``plugin`` is enabled in the stack, implemented, and not in arm "off"."""
        return plugin in self._combination.active

    def arm(self, plugin: str) -> str:
        """The plugin's arm for this request: an experiment arm, "default", or "off"."""
        return self._combination.plugin_arms.get(plugin, DEFAULT_ARM if self.enabled(plugin) else OFF)

    def middleware(self, kind: str) -> MiddlewareStack:
        """The middleware factories of chain ``kind`` (model, tool, response, engine) for this
        request's combination of arms, outermost first; the same object for every request
        with the same arms. Hosts compose it around their endpoint with a
        :class:`~loopstack.middleware.Chain`."""
        return self.runtime.middleware(self._combination, kind)

    def chain(self, kind: str, endpoint: Handler) -> Handler:
        """The middleware chain of ``kind`` around ``endpoint``. Composed once per combination
        of arms and endpoint when ``endpoint`` is a long-lived function (module-level); a
        host with a per-instance endpoint (a bound method) holds a
        :class:`~loopstack.middleware.Chain` instead."""
        return self.middleware(kind).around(endpoint)

    def state(self, key: StateKey[T] | str, factory: Callable[[], T] | None = None) -> T:
        """The state object under ``key`` for this request, created by the key's factory on
        first use. A bare string key with a ``factory`` is the older form, still accepted."""
        return _state_of(self._state, key, factory)

    def _label_sets(self) -> list[tuple[str, str]]:
        pairs = list(self._combination.plugin_arms.items())
        return pairs or [("kernel", DEFAULT_ARM)]

    def observe(self, metric: str, value: float, help: str = "", *, buckets: Sequence[float] | None = None,
                **labels: Any) -> None:
        """Record ``value`` in histogram ``metric`` once per experiment this request is
        in (labels plugin and arm), or under plugin="kernel" when it is in none. ``buckets``:
        the histogram's upper bounds when this call creates it (default: latency seconds)."""
        histogram = self.runtime.metrics.histogram(metric, help or metric, tuple(labels),
                                                   **({"buckets": buckets} if buckets is not None else {}))
        for plugin, arm in self._label_sets():
            histogram.observe(value, plugin=plugin, arm=arm, **labels)

    def count(self, metric: str, amount: float = 1.0, help: str = "", **labels: Any) -> None:
        """Add ``amount`` to counter ``metric``, labelled like :meth:`observe`."""
        counter = self.runtime.metrics.counter(metric, help or metric, tuple(labels))
        for plugin, arm in self._label_sets():
            counter.inc(amount, plugin=plugin, arm=arm, **labels)
