from __future__ import annotations

import types

import pytest

from loopstack import Layer, Plugin, PluginCatalog, PluginLoadError
from loopstack.catalog import plugin_class_of

BUILTINS = {
    "tool_search", "code_mode", "prefix_pinning", "ws_deltas",
    "parallel_safety", "cache_routing", "spec_decode", "disaggregation", "kv_cache",
}


def test_the_nine_builtins_are_registered_from_loopstack():
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    assert set(catalog.names()) == BUILTINS
    assert {spec.source for spec in catalog} == {"loopstack"}


def test_builtins_declare_layers_and_a_config_with_defaults():
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    for spec in catalog:
        assert spec.layers and all(isinstance(layer, Layer) for layer in spec.layers)
        spec.cls.Config()  # every built-in config has defaults for every key


def test_disable_env_blocks_plugins_by_name():
    catalog = PluginCatalog.discover(use_entry_points=False, env={"LOOPSTACK_DISABLE_PLUGINS": "spec_decode, code_mode"})
    assert "spec_decode" not in catalog and "code_mode" not in catalog
    assert catalog.blocked == {"spec_decode", "code_mode"}
    assert len(catalog) == 7


def _module_with(*classes):
    module = types.ModuleType("fake_plugin_module")
    for cls in classes:
        cls.__module__ = module.__name__
        setattr(module, cls.__name__, cls)
    return module


def test_module_without_a_plugin_class_is_an_error():
    with pytest.raises(PluginLoadError, match="exactly one loopstack.Plugin subclass"):
        plugin_class_of(_module_with())


def test_module_with_two_plugin_classes_must_choose():
    class A(Plugin):
        name, layers = "a", (Layer.API,)

    class B(Plugin):
        name, layers = "b", (Layer.API,)

    with pytest.raises(PluginLoadError, match="found: A, B"):
        plugin_class_of(_module_with(A, B))
    module = _module_with(A, B)
    module.PLUGIN = B
    assert plugin_class_of(module) is B


def test_duplicate_plugin_names_name_both_sources(catalog):
    class Impostor(Plugin):
        name, layers = "spec_decode", (Layer.INFERENCE,)

    with pytest.raises(PluginLoadError, match="two plugins are named 'spec_decode'"):
        catalog.add_plugin(Impostor, source="evil-package")


def test_plugin_without_layers_is_rejected(catalog):
    class NoLayers(Plugin):
        name = "nolayers"

    with pytest.raises(PluginLoadError, match="'layers'"):
        catalog.add_plugin(NoLayers)


def test_unknown_plugin_lookup_lists_known_ones(catalog):
    with pytest.raises(KeyError, match="known plugins: cache_routing"):
        catalog.get("nope")
