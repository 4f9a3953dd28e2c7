"""A stack made live: plugin instances registered with pluggy, arms resolved per request.

``StackRuntime`` builds one instance per enabled, implemented plugin (one per arm
when an experiment gives arms different config variants) and registers them with a
pluggy manager. For each combination of arms it caches a hook caller that leaves out
the plugins in arm "off" (``subset_hook_caller``) and the middleware chains composed
from it, so a plugin that is off for a request costs nothing on its hot path.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import pluggy

from loopstack.catalog import PluginCatalog, new_pluggy_manager
from loopstack.context import RequestContext, Session
from loopstack.experiments import DEFAULT_ARM, OFF, UnitKeys, resolve_arms
from loopstack.hooks import MIDDLEWARE_HOOKS, HookFacade
from loopstack.metrics import MetricsRegistry
from loopstack.middleware import MiddlewareStack
from loopstack.plugin import Plugin
from loopstack.stack.schema import ResolvedStack


@dataclass(eq=False)
class Combination:
    """One combination of A/B arms: its hook caller and its middleware stacks, made once."""

    arms: dict[str, str]  # experiment -> arm
    plugin_arms: dict[str, str]  # plugin -> arm, for split plugins
    active: frozenset[str]
    hooks: HookFacade
    stacks: dict[str, MiddlewareStack] = field(default_factory=dict)  # chain kind -> its middlewares


@dataclass(frozen=True)
class RuntimeStatistics:
    plugins_active: tuple[str, ...]
    plugins_skipped: tuple[str, ...]
    combinations_cached: int
    requests: int


class StackRuntime:
    """The live form of a :class:`ResolvedStack`."""

    def __init__(self, stack: ResolvedStack, catalog: PluginCatalog, metrics: MetricsRegistry | None = None) -> None:
        self.stack = stack
        self.catalog = catalog
        self.metrics = metrics if metrics is not None else MetricsRegistry()
        self.pm: pluggy.PluginManager = new_pluggy_manager()
        self.skipped: list[str] = []  # enabled in the stack but not implemented (or blocked)
        self._instances: dict[tuple[str, str], Plugin] = {}  # (plugin, arm) -> instance
        self._combinations: dict[tuple[tuple[str, str], ...], Combination] = {}
        self._num_requests = 0
        self._closed = False
        self._register_plugins()
        self.hooks = HookFacade(self.pm)
        self.hooks.configure(self)

    def _register_plugins(self) -> None:
        split = {exp.plugin: exp for exp in self.stack.experiments.values()}
        for name, settings in sorted(self.stack.plugins.items()):
            if not settings.enabled:
                continue
            if name not in self.catalog or not self.catalog.get(name).implemented or settings.config is None:
                self.skipped.append(name)
                continue
            cls = self.catalog.get(name).cls
            experiment = split.get(name)
            arms = [a for a in experiment.arms if a != OFF] if experiment else [DEFAULT_ARM]
            for arm in arms:
                instance = cls(settings.variants.get(arm, settings.config), arm=arm)
                self.pm.register(instance, name=name if arm == DEFAULT_ARM else f"{name}[{arm}]")
                self._instances[(name, arm)] = instance
        self.pm.check_pending()

    def instance(self, plugin: str, arm: str = DEFAULT_ARM) -> Plugin | None:
        """The registered instance of ``plugin`` for ``arm`` (None when not running)."""
        return self._instances.get((plugin, arm))

    @property
    def active_plugins(self) -> list[str]:
        return sorted({name for name, _ in self._instances})

    def _combination(self, arms: dict[str, str]) -> Combination:
        key = tuple(sorted(arms.items()))
        combo = self._combinations.get(key)
        if combo is not None:
            return combo
        plugin_arms = {self.stack.experiments[exp].plugin: arm for exp, arm in arms.items()}
        excluded = frozenset(
            instance for (name, arm), instance in self._instances.items() if name in plugin_arms and plugin_arms[name] != arm
        )
        active = frozenset(name for (name, arm), inst in self._instances.items() if inst not in excluded)
        combo = Combination(arms, plugin_arms, active, HookFacade(self.pm, excluded))
        self._combinations[key] = combo
        return combo

    def context(
        self,
        *,
        session: Session | None = None,
        request_id: str | None = None,
        overrides: Mapping[str, str] | None = None,
    ) -> RequestContext:
        """A context for one request: assigns its arms (sticky by the experiment's unit).

        Raises ArmOverrideError when ``overrides`` asks for something the stack forbids.
        """
        session = session or Session()
        request_id = request_id or uuid.uuid4().hex
        keys = UnitKeys(session=session.id, request=request_id, tenant=session.tenant)
        arms = resolve_arms(self.stack.experiments, keys, overrides)
        self._num_requests += 1
        ctx = RequestContext(self, self._combination(arms), session, request_id)
        ctx.count("loopstack_requests_total", help="requests served, by plugin and arm")
        return ctx

    def middleware(self, combo: Combination, kind: str) -> MiddlewareStack:
        """The middleware stack of chain ``kind`` for ``combo``, collected from its hook once."""
        stack = combo.stacks.get(kind)
        if stack is None:
            if kind not in MIDDLEWARE_HOOKS:
                raise ValueError(f"unknown middleware kind {kind!r}; kinds: {', '.join(MIDDLEWARE_HOOKS)}")
            factories = getattr(combo.hooks, MIDDLEWARE_HOOKS[kind])(self)
            stack = combo.stacks[kind] = MiddlewareStack(kind, factories)
        return stack

    def close(self) -> None:
        """Retire the stack: calls ``loopstack_unconfigure`` once."""
        if not self._closed:
            self._closed = True
            self.hooks.unconfigure(self)

    def statistics(self) -> RuntimeStatistics:
        return RuntimeStatistics(
            plugins_active=tuple(self.active_plugins),
            plugins_skipped=tuple(self.skipped),
            combinations_cached=len(self._combinations),
            requests=self._num_requests,
        )
