"""Find plugins: the built-ins and every entry point in the group ``loopstack``.

Built-in plugins go through exactly the path third-party ones do: a module is loaded,
its single :class:`~loopstack.Plugin` subclass becomes a :class:`PluginSpec`, and its
module-level discovery hooks are registered with a process-wide pluggy manager.

``LOOPSTACK_DISABLE_PLUGINS=a,b`` blocks plugins by name: their modules are never
imported (use it to step around a broken third-party plugin).
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType

import pluggy

from loopstack import hookspecs
from loopstack.hookspecs import PROJECT_NAME
from loopstack.plugin import Layer, Plugin

ENTRY_POINT_GROUP = "loopstack"
DISABLE_ENV = "LOOPSTACK_DISABLE_PLUGINS"

BUILTIN_PLUGIN_MODULES = (
    "loopstack.plugins.tool_search",
    "loopstack.plugins.code_mode",
    "loopstack.plugins.prefix_pinning",
    "loopstack.plugins.ws_deltas",
    "loopstack.plugins.parallel_safety",
    "loopstack.plugins.cache_routing",
    "loopstack.plugins.spec_decode",
    "loopstack.plugins.disaggregation",
    "loopstack.plugins.kv_cache",
)
# Modules of the kernel itself that implement discovery hooks (not plugins).
KERNEL_HOOK_MODULES = ("loopstack.bench.workloads",)


class PluginLoadError(Exception):
    """A plugin module could not be imported or does not define a valid plugin."""


@dataclass(frozen=True)
class PluginSpec:
    """A discovered plugin class and where it came from."""

    name: str
    cls: type[Plugin]
    module: str
    source: str  # "loopstack" for built-ins, else the distribution that declared it

    @property
    def layers(self) -> tuple[Layer, ...]:
        return self.cls.layers

    @property
    def implemented(self) -> bool:
        return self.cls.implemented


def new_pluggy_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def blocked_names(env: dict[str, str] | None = None) -> frozenset[str]:
    raw = (env if env is not None else os.environ).get(DISABLE_ENV, "")
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


def plugin_class_of(module: ModuleType) -> type[Plugin]:
    """The plugin class a module defines: ``module.PLUGIN`` or its only Plugin subclass."""
    explicit = getattr(module, "PLUGIN", None)
    if explicit is not None:
        if not (inspect.isclass(explicit) and issubclass(explicit, Plugin)):
            raise PluginLoadError(f"{module.__name__}.PLUGIN must be a loopstack.Plugin subclass")
        return explicit
    found = [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj) and issubclass(obj, Plugin) and obj is not Plugin and obj.__module__ == module.__name__
    ]
    if len(found) != 1:
        names = ", ".join(c.__name__ for c in found) or "none"
        raise PluginLoadError(
            f"{module.__name__} must define exactly one loopstack.Plugin subclass (found: {names}); "
            "set PLUGIN = YourClass to choose one"
        )
    return found[0]


def _check_class(cls: type[Plugin], where: str) -> None:
    for attr in ("name", "layers"):
        if not getattr(cls, attr, None):
            raise PluginLoadError(f"{where}: plugin class {cls.__name__} must set the class attribute {attr!r}")
    bad = [layer for layer in cls.layers if not isinstance(layer, Layer)]
    if bad:
        raise PluginLoadError(f"{where}: layers must be loopstack.Layer values, got {bad!r}")


class PluginCatalog:
    """Every plugin this process can use, by name, plus the discovery-hook manager."""

    def __init__(self) -> None:
        self._specs: dict[str, PluginSpec] = {}
        self.blocked: frozenset[str] = frozenset()
        self.discovery = new_pluggy_manager()

    @classmethod
    def discover(cls, *, use_entry_points: bool = True, env: dict[str, str] | None = None) -> PluginCatalog:
        catalog = cls()
        catalog.blocked = blocked_names(env)
        for module_name in KERNEL_HOOK_MODULES:
            catalog.discovery.register(importlib.import_module(module_name), name=module_name)
        for module_name in BUILTIN_PLUGIN_MODULES:
            catalog.add_module(module_name, source="loopstack")
        if use_entry_points:
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                catalog.add_entry_point(ep)
        catalog.discovery.check_pending()
        return catalog

    def add_entry_point(self, ep: EntryPoint) -> None:
        if ep.name in self.blocked:
            return
        source = ep.dist.name if ep.dist is not None else "?"
        try:
            loaded = ep.load()
        except Exception as exc:  # a broken third-party package must say which one it is
            raise PluginLoadError(
                f"entry point {ep.name!r} = {ep.value!r} from {source} failed to import: {exc!r} "
                f"(set {DISABLE_ENV}={ep.name} to skip it)"
            ) from exc
        if not isinstance(loaded, ModuleType):
            raise PluginLoadError(f"entry point {ep.name!r} from {source} must name a module, not {ep.value!r}")
        self._add(loaded, source=source, expected_name=ep.name)

    def add_module(self, module_name: str, *, source: str) -> None:
        short = module_name.rsplit(".", 1)[-1]
        if short in self.blocked:
            return
        self._add(importlib.import_module(module_name), source=source, expected_name=None)

    def add_plugin(self, cls: type[Plugin], *, source: str = "local") -> None:
        """Add a plugin class directly (an application embedding loopstack, or a test).
        Its module's discovery hooks are not registered."""
        self._add_class(cls, cls.__module__, source, expected_name=None)

    def _add(self, module: ModuleType, *, source: str, expected_name: str | None) -> None:
        if self._add_class(plugin_class_of(module), module.__name__, source, expected_name):
            self.discovery.register(module, name=module.__name__)

    def _add_class(self, cls: type[Plugin], module_name: str, source: str, expected_name: str | None) -> bool:
        _check_class(cls, module_name)
        if cls.name in self.blocked:
            return False
        if expected_name is not None and expected_name != cls.name:
            raise PluginLoadError(
                f"entry point {expected_name!r} from {source} loads plugin named {cls.name!r}; the names must match"
            )
        if cls.name in self._specs:
            other = self._specs[cls.name]
            if other.module == module_name:
                return False  # the same module declared twice (editable installs can do that)
            raise PluginLoadError(
                f"two plugins are named {cls.name!r}: {other.module} ({other.source}) and {module_name} ({source})"
            )
        self._specs[cls.name] = PluginSpec(cls.name, cls, module_name, source)
        return True

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[PluginSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def get(self, name: str) -> PluginSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise KeyError(f"unknown plugin {name!r}; known plugins: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._specs)
