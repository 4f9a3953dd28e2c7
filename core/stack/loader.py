"""Load a TOML stack: follow ``extends``, merge key by key, validate every table.

Every problem is collected before anything is raised, so ``loopstack stacks validate``
prints all of them at once, each with its file, key path and line.

Stack references are a path (``stacks/full.toml``) or a name (``full``), looked up in
``$LOOPSTACK_STACKS_PATH`` (os.pathsep-separated), then ``./stacks``, then the stacks
shipped beside the loopstack sources.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from loopstack.catalog import PluginCatalog
from loopstack.stack.errors import StackError, StackIssue, describe_validation_error
from loopstack.stack.schema import (
    SECTION_MODELS,
    TOP_LEVEL_KEYS,
    ExperimentConfig,
    PluginSettings,
    ResolvedStack,
    StackMeta,
)
from loopstack.stack.toml import find_line, key_lines

STACKS_PATH_ENV = "LOOPSTACK_STACKS_PATH"
SHIPPED_STACKS = Path(__file__).resolve().parents[2] / "stacks"


def stack_search_path() -> list[Path]:
    extra = [Path(p) for p in os.environ.get(STACKS_PATH_ENV, "").split(os.pathsep) if p]
    return [*extra, Path.cwd() / "stacks", SHIPPED_STACKS]


def find_stack(ref: str | Path, relative_to: Path | None = None) -> Path:
    """Resolve a stack reference to a file. Raises FileNotFoundError naming what was tried."""
    ref_path = Path(ref)
    tried: list[Path] = []
    if ref_path.suffix == ".toml" or len(ref_path.parts) > 1:
        candidates = [relative_to / ref_path] if relative_to and not ref_path.is_absolute() else []
        candidates.append(ref_path)
    else:
        bases = ([relative_to] if relative_to else []) + stack_search_path()
        candidates = [base / f"{ref}.toml" for base in bases]
    for candidate in candidates:
        tried.append(candidate)
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(f"stack {str(ref)!r} not found; tried: {', '.join(str(t) for t in tried)}")


def list_stacks() -> list[Path]:
    """Every stack file in the search path, first occurrence of each name wins."""
    seen: dict[str, Path] = {}
    for base in stack_search_path():
        for path in sorted(base.glob("*.toml")) if base.is_dir() else []:
            seen.setdefault(path.stem, path.resolve())
    return list(seen.values())


@dataclass
class _Layer:
    path: Path
    data: dict[str, Any]
    lines: dict[tuple[str, ...], int]


class _Collector:
    """Gathers issues and knows which file and line set each key."""

    def __init__(self, chain: list[_Layer], fallback: Path) -> None:
        self.chain = chain
        self.fallback = fallback
        self.issues: list[StackIssue] = []
        self.owner: dict[tuple[str, ...], int] = {}

    def add(self, path: tuple[Any, ...], message: str, severity: str = "error") -> None:
        key = tuple(str(p) for p in path)
        index = None
        for end in range(len(key), 0, -1):
            if key[:end] in self.owner:
                index = self.owner[key[:end]]
                break
        layer = self.chain[index] if index is not None else (self.chain[-1] if self.chain else None)
        file = layer.path if layer else self.fallback
        line = find_line(layer.lines, key) if layer else None
        self.issues.append(StackIssue(file, ".".join(key), message, line, severity))  # type: ignore[arg-type]

    def validate(self, model: type[BaseModel], data: Any, prefix: tuple[str, ...]) -> Any:
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            for loc, message in describe_validation_error(model, exc):
                self.add(prefix + loc, message)
            return None


def _merge(base: dict[str, Any], top: dict[str, Any], owner: dict, index: int, path: tuple[str, ...] = ()) -> None:
    for key, value in top.items():
        here = path + (key,)
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value, owner, index, here)
        else:
            base[key] = _copy(value)
        owner[here] = index
        if isinstance(value, dict):
            for sub in _leaf_paths(value, here):
                owner[sub] = index


def _leaf_paths(data: dict[str, Any], path: tuple[str, ...]) -> list[tuple[str, ...]]:
    out = []
    for key, value in data.items():
        out.append(path + (key,))
        if isinstance(value, dict):
            out.extend(_leaf_paths(value, path + (key,)))
    return out


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


class StackLoader:
    """Loads and validates stacks against the plugins of a catalog."""

    def __init__(self, catalog: PluginCatalog) -> None:
        self.catalog = catalog

    def load(self, ref: str | Path) -> ResolvedStack:
        """Resolve and validate; raises :class:`StackError` listing every error."""
        stack, issues = self.check(ref)
        if stack is None:
            raise StackError(issues)
        return stack

    def check(self, ref: str | Path) -> tuple[ResolvedStack | None, list[StackIssue]]:
        """Resolve and validate; returns the stack (or None) and every issue found."""
        try:
            path = find_stack(ref)
        except FileNotFoundError as exc:
            return None, [StackIssue(Path(str(ref)), "", str(exc))]
        chain: list[_Layer] = []
        collector = _Collector(chain, path)
        self._read_chain(path, [], chain, collector)
        if any(i.severity == "error" for i in collector.issues):
            return None, collector.issues
        merged: dict[str, Any] = {}
        for index, layer in enumerate(chain):
            data = {k: v for k, v in layer.data.items() if k != "stack"}
            _merge(merged, data, collector.owner, index)
        merged["stack"] = dict(chain[-1].data.get("stack", {}))
        for key in _leaf_paths({"stack": merged["stack"]}, ()):
            collector.owner[key] = len(chain) - 1
        stack = self._validate(merged, chain, collector)
        return stack, collector.issues

    def _read_chain(self, path: Path, seen: list[Path], chain: list[_Layer], collector: _Collector) -> None:
        if path in seen:
            cycle = " -> ".join(str(p) for p in [*seen, path])
            collector.issues.append(StackIssue(seen[-1], "stack.extends", f"extends cycle: {cycle}"))
            return
        try:
            text = path.read_text(encoding="utf-8")
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            # Python 3.11's tomllib puts the position only in the message text
            found = re.search(r"\(at line (\d+), column (\d+)\)", str(exc))
            line = int(found.group(1)) if found else getattr(exc, "lineno", None)
            message = str(exc)
            collector.issues.append(StackIssue(path, "", f"invalid TOML: {message}", line))
            return
        except OSError as exc:
            collector.issues.append(StackIssue(path, "", f"cannot read stack: {exc.strerror or exc}"))
            return
        layer = _Layer(path, data, key_lines(text))
        extends = data.get("stack", {}).get("extends") if isinstance(data.get("stack"), dict) else None
        if extends is not None:
            line = find_line(layer.lines, ("stack", "extends"))
            if not isinstance(extends, str):
                collector.issues.append(StackIssue(path, "stack.extends", "must be a string (a stack name or path)", line))
            else:
                try:
                    parent = find_stack(extends, relative_to=path.parent)
                except FileNotFoundError as exc:
                    collector.issues.append(StackIssue(path, "stack.extends", str(exc), line))
                else:
                    self._read_chain(parent, [*seen, path], chain, collector)
        chain.append(layer)

    def _validate(self, merged: dict[str, Any], chain: list[_Layer], c: _Collector) -> ResolvedStack | None:
        for key in merged:
            if key not in TOP_LEVEL_KEYS:
                c.add((key,), f"unknown table; allowed: {', '.join(TOP_LEVEL_KEYS)}")
        meta_data = {"name": chain[-1].path.stem, **merged["stack"]}
        meta = c.validate(StackMeta, meta_data, ("stack",))
        sections = {name: c.validate(model, merged.get(name, {}), (name,)) for name, model in SECTION_MODELS.items()}
        plugins = self._validate_plugins(merged.get("plugins", {}), c)
        experiments = self._validate_experiments(merged.get("experiments", {}), plugins, c)
        if any(i.severity == "error" for i in c.issues):
            return None
        warnings = tuple(str(i) for i in c.issues if i.severity == "warning")
        return ResolvedStack(
            meta=meta,
            files=tuple(layer.path for layer in chain),
            engine=sections["engine"],
            api=sections["api"],
            harness=sections["harness"],
            plugins=plugins,
            experiments=experiments,
            raw=merged,
            warnings=warnings,
        )

    def _validate_plugins(self, tables: Any, c: _Collector) -> dict[str, PluginSettings]:
        settings: dict[str, PluginSettings] = {}
        if not isinstance(tables, dict):
            c.add(("plugins",), "must be a table of [plugins.<name>] tables")
            tables = {}
        for name, table in tables.items():
            if name in self.catalog.blocked:
                c.add(("plugins", name), "plugin is blocked by LOOPSTACK_DISABLE_PLUGINS; it is skipped", "warning")
                settings[name] = PluginSettings(name, False, None)
                continue
            if name not in self.catalog:
                c.add(("plugins", name), f"unknown plugin; known plugins: {', '.join(self.catalog.names())}")
                continue
            if not isinstance(table, dict):
                c.add(("plugins", name), "must be a table, e.g. [plugins.NAME] with enabled = true")
                continue
            enabled = table.get("enabled", False)
            if not isinstance(enabled, bool):
                c.add(("plugins", name, "enabled"), f"must be true or false (got {enabled!r})")
                enabled = False
            spec = self.catalog.get(name)
            body = {k: v for k, v in table.items() if k != "enabled"}
            config = c.validate(spec.cls.Config, body, ("plugins", name))
            if enabled and not spec.implemented:
                c.add(("plugins", name), "plugin is not implemented yet; it is skipped at run time", "warning")
            settings[name] = PluginSettings(name, enabled, config)
        for spec in self.catalog:
            if spec.name not in settings:
                try:
                    default = spec.cls.Config()
                except ValidationError:
                    default = None  # a plugin with required keys is simply off
                settings[spec.name] = PluginSettings(spec.name, False, default)
        return settings

    def _validate_experiments(
        self, tables: Any, plugins: dict[str, PluginSettings], c: _Collector
    ) -> dict[str, ExperimentConfig]:
        experiments: dict[str, ExperimentConfig] = {}
        if not isinstance(tables, dict):
            c.add(("experiments",), "must be a table of [experiments.<name>] tables")
            return experiments
        owner_of_plugin: dict[str, str] = {}
        for name, table in tables.items():
            exp = c.validate(ExperimentConfig, table, ("experiments", name))
            if exp is None:
                continue
            if exp.plugin in self.catalog.blocked:
                c.add(("experiments", name, "plugin"), f"plugin {exp.plugin!r} is blocked by LOOPSTACK_DISABLE_PLUGINS; experiment skipped", "warning")
                continue
            settings = plugins.get(exp.plugin)
            if settings is None or exp.plugin not in self.catalog:
                c.add(("experiments", name, "plugin"), f"unknown plugin {exp.plugin!r}; known: {', '.join(self.catalog.names())}")
                continue
            if not settings.enabled:
                c.add(("experiments", name, "plugin"), f"plugin {exp.plugin!r} must be enabled ([plugins.{exp.plugin}] enabled = true) to be split into arms")
                continue
            if exp.plugin in owner_of_plugin:
                c.add(("experiments", name, "plugin"), f"plugin {exp.plugin!r} is already split by experiment {owner_of_plugin[exp.plugin]!r}")
                continue
            owner_of_plugin[exp.plugin] = name
            variants = self._validate_variants(name, exp, settings, c)
            plugins[exp.plugin] = PluginSettings(settings.name, True, settings.config, variants)
            experiments[name] = exp
        return experiments

    def _validate_variants(self, name: str, exp: ExperimentConfig, settings: PluginSettings, c: _Collector) -> dict:
        variants = {}
        spec = self.catalog.get(exp.plugin)
        for arm, overrides in exp.variants.items():
            where = ("experiments", name, "variants", arm)
            if arm not in exp.arms or arm == "off":
                c.add(where, f"variant for {arm!r}, which is not an 'on'-type arm; arms: {', '.join(exp.arms)}")
                continue
            base = settings.config.model_dump() if settings.config else {}
            config = c.validate(spec.cls.Config, {**base, **overrides}, where)
            if config is not None:
                variants[arm] = config
        return variants
