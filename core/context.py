"""Per-session and per-request context objects: where plugin state lives.

A :class:`RequestContext` is made by :meth:`StackRuntime.context` for every request.
It knows the request's A/B arms, answers ``enabled(plugin)``, carries the hook
facade and composed middleware chains for exactly the plugins that are on for it,
and records metrics labelled by plugin and arm.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from loopstack.experiments import DEFAULT_ARM, OFF
from loopstack.hooks import HookFacade
from loopstack.middleware import Handler

if TYPE_CHECKING:
    from loopstack.runtime import StackRuntime, _Combination

T = TypeVar("T")


@dataclass
class Session:
    """A conversation: its id, tenant, and each plugin's session-scoped state."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    tenant: str = "default"
    _state: dict[str, Any] = field(default_factory=dict, repr=False)

    def state(self, plugin: str, factory: Callable[[], T]) -> T:
        """The plugin's state object for this session, created on first use."""
        if plugin not in self._state:
            self._state[plugin] = factory()
        return self._state[plugin]

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
        combination: _Combination,
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

    def chain(self, kind: str, endpoint: Handler) -> Handler:
        """The composed middleware chain of ``kind`` (model, tool, response, engine)
        around ``endpoint``, built once per combination of arms and endpoint."""
        return self.runtime._chain(self._combination, kind, endpoint)

    def state(self, plugin: str, factory: Callable[[], T]) -> T:
        """The plugin's state object for this request, created on first use."""
        if plugin not in self._state:
            self._state[plugin] = factory()
        return self._state[plugin]

    def _label_sets(self) -> list[tuple[str, str]]:
        pairs = list(self._combination.plugin_arms.items())
        return pairs or [("kernel", DEFAULT_ARM)]

    def observe(self, metric: str, value: float, help: str = "", **labels: Any) -> None:
        """Record ``value`` in histogram ``metric`` once per experiment this request is
        in (labels plugin and arm), or under plugin="kernel" when it is in none."""
        histogram = self.runtime.metrics.histogram(metric, help or metric, tuple(labels))
        for plugin, arm in self._label_sets():
            histogram.observe(value, plugin=plugin, arm=arm, **labels)

    def count(self, metric: str, amount: float = 1.0, help: str = "", **labels: Any) -> None:
        """Add ``amount`` to counter ``metric``, labelled like :meth:`observe`."""
        counter = self.runtime.metrics.counter(metric, help or metric, tuple(labels))
        for plugin, arm in self._label_sets():
            counter.inc(amount, plugin=plugin, arm=arm, **labels)
