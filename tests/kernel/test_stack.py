from __future__ import annotations

import pytest

from loopstack import StackError, StackLoader


def load(catalog, path):
    return StackLoader(catalog).load(path)


def errors_of(catalog, path):
    stack, issues = StackLoader(catalog).check(path)
    assert stack is None, "expected the stack to be invalid"
    return [i for i in issues if i.severity == "error"]


def test_shipped_stacks_are_valid(catalog):
    baseline = load(catalog, "baseline")
    full = load(catalog, "full")
    assert baseline.enabled_plugins() == []
    assert set(full.enabled_plugins()) >= {"tool_search", "spec_decode", "disaggregation"}


def test_name_defaults_to_file_stem(catalog, write_stack):
    assert load(catalog, write_stack("mystack", "[engine]\nreplicas = 3\n")).name == "mystack"


def test_toml_syntax_error_names_file_and_line(catalog, write_stack):
    path = write_stack("bad", "[engine]\nreplicas = 2\nmodel = \n")
    [error] = errors_of(catalog, path)
    assert error.file == path and error.line == 3 and "invalid TOML" in error.message


def test_unknown_top_level_table(catalog, write_stack):
    [error] = errors_of(catalog, write_stack("s", "[engin]\nreplicas = 2\n"))
    assert error.key == "engin" and error.line == 1
    assert "allowed: stack, engine, api, harness, plugins, experiments" in error.message


def test_unknown_key_lists_allowed_keys_with_line(catalog, write_stack):
    [error] = errors_of(catalog, write_stack("s", "[engine]\nreplicas = 2\nreplica = 3\n"))
    assert (error.key, error.line) == ("engine.replica", 3)
    assert "allowed keys:" in error.message and "replicas" in error.message


def test_literal_error_lists_allowed_values(catalog, write_stack):
    [error] = errors_of(catalog, write_stack("s", '[engine]\ndevice = "tpu"\n'))
    assert error.key == "engine.device"
    for allowed in ("'auto'", "'cpu'", "'cuda'"):
        assert allowed in error.message
    assert "'tpu'" in error.message


def test_wrong_type_and_range(catalog, write_stack):
    errors = errors_of(catalog, write_stack("s", '[engine]\nreplicas = 0\n[api]\nport = "x"\n'))
    assert {e.key for e in errors} == {"engine.replicas", "api.port"}


def test_unknown_plugin(catalog, write_stack):
    [error] = errors_of(catalog, write_stack("s", "[plugins.tool_serch]\nenabled = true\n"))
    assert error.key == "plugins.tool_serch" and "known plugins:" in error.message and "tool_search" in error.message


def test_plugin_config_is_validated_by_the_plugins_model(catalog, write_stack):
    errors = errors_of(catalog, write_stack("s", "[plugins.tool_search]\nenabled = true\ntop_k = 0\nbogus = 1\n"))
    by_key = {e.key: e for e in errors}
    assert set(by_key) == {"plugins.tool_search.top_k", "plugins.tool_search.bogus"}
    assert by_key["plugins.tool_search.top_k"].line == 3
    assert "greater than or equal to 1" in by_key["plugins.tool_search.top_k"].message
    assert "top_k" in by_key["plugins.tool_search.bogus"].message  # allowed keys listed


def test_enabled_must_be_boolean(catalog, write_stack):
    [error] = errors_of(catalog, write_stack("s", '[plugins.recorder]\nenabled = "yes"\n'))
    assert error.key == "plugins.recorder.enabled" and "true or false" in error.message


def test_every_error_is_reported_at_once(catalog, write_stack):
    text = """
    [engine]
    replicas = -1
    device = "tpu"
    [api]
    port = 99999
    [plugins.nope]
    enabled = true
    [plugins.recorder]
    weight = 11
    [experiments.x]
    plugin = "recorder"
    arms = { on = 0.6, off = 0.6 }
    """
    errors = errors_of(catalog, write_stack("s", text))
    assert len(errors) == 6
    assert all(e.line is not None for e in errors)


def test_experiment_errors(catalog, write_stack):
    text = """
    [plugins.recorder]
    enabled = false
    [experiments.a]
    plugin = "recorder"
    arms = { on = 0.5, off = 0.5 }
    [experiments.b]
    plugin = "ghost"
    arms = { on = 0.5, off = 0.5 }
    [experiments.c]
    plugin = "recorder"
    arms = { on = 1.0 }
    unit = "planet"
    """
    errors = {e.key: e.message for e in errors_of(catalog, write_stack("s", text))}
    assert "must be enabled" in errors["experiments.a.plugin"]
    assert "unknown plugin 'ghost'" in errors["experiments.b.plugin"]
    assert "at least two arms" in errors["experiments.c.arms"]
    assert "'session'" in errors["experiments.c.unit"]


def test_two_experiments_on_one_plugin(catalog, write_stack):
    text = """
    [plugins.recorder]
    enabled = true
    [experiments.a]
    plugin = "recorder"
    arms = { on = 0.5, off = 0.5 }
    [experiments.b]
    plugin = "recorder"
    arms = { on = 0.5, off = 0.5 }
    """
    [error] = errors_of(catalog, write_stack("s", text))
    assert "already split by experiment 'a'" in error.message


def test_variant_config_is_validated(catalog, write_stack):
    text = """
    [plugins.recorder]
    enabled = true
    [experiments.a]
    plugin = "recorder"
    arms = { small = 0.5, big = 0.5 }
    variants = { big = { weight = 50 }, off = { weight = 1 } }
    """
    errors = {e.key: e.message for e in errors_of(catalog, write_stack("s", text))}
    assert "experiments.a.variants.big.weight" in errors
    assert "not an 'on'-type arm" in errors["experiments.a.variants.off"]


def test_extends_merges_key_by_key(catalog, write_stack):
    write_stack("base", """
    [engine]
    replicas = 2
    device = "cpu"
    [plugins.recorder]
    enabled = true
    label = "from-base"
    weight = 3
    """)
    child = write_stack("child", """
    [stack]
    extends = "base"
    [engine]
    replicas = 4
    [plugins.recorder]
    label = "from-child"
    """)
    stack = load(catalog, child)
    assert stack.name == "child"  # the name is never inherited
    assert (stack.engine.replicas, stack.engine.device) == (4, "cpu")
    settings = stack.plugins["recorder"]
    assert settings.enabled and settings.config.label == "from-child" and settings.config.weight == 3
    assert [p.name for p in stack.files] == ["base.toml", "child.toml"]


def test_extends_by_relative_path(catalog, write_stack, tmp_path):
    (tmp_path / "sub").mkdir()
    write_stack("sub/parent", "[engine]\nreplicas = 5\n")
    child = write_stack("kid", '[stack]\nextends = "sub/parent.toml"\n')
    assert load(catalog, child).engine.replicas == 5


def test_error_in_parent_names_the_parent_file(catalog, write_stack):
    parent = write_stack("parent", "[engine]\nreplicas = 2\nthreads = 0\n")
    child = write_stack("child2", '[stack]\nextends = "parent"\n[engine]\nreplicas = 3\n')
    [error] = errors_of(catalog, child)
    assert (error.file, error.key, error.line) == (parent, "engine.threads", 3)


def test_extends_cycle_is_detected(catalog, write_stack):
    write_stack("a", '[stack]\nextends = "b"\n')
    write_stack("b", '[stack]\nextends = "c"\n')
    path_c = write_stack("c", '[stack]\nextends = "a"\n')
    errors = errors_of(catalog, path_c)
    assert len(errors) == 1 and "extends cycle" in errors[0].message
    assert errors[0].message.count(".toml") == 4


def test_extends_missing_parent(catalog, write_stack):
    [error] = errors_of(catalog, write_stack("s", '[stack]\nextends = "does-not-exist"\n'))
    assert error.key == "stack.extends" and error.line == 2 and "not found; tried" in error.message


def test_missing_stack_file(catalog, tmp_path):
    with pytest.raises(StackError, match="not found"):
        load(catalog, tmp_path / "nope.toml")


def test_unimplemented_plugin_is_a_warning(catalog, write_stack):
    stack = load(catalog, write_stack("s", "[plugins.unfinished]\nenabled = true\n"))
    assert any("not implemented yet" in w for w in stack.warnings)


def test_blocked_plugin_is_a_warning(write_stack):
    from loopstack import PluginCatalog

    blocked = PluginCatalog.discover(use_entry_points=False, env={"LOOPSTACK_DISABLE_PLUGINS": "code_mode"})
    stack = StackLoader(blocked).load(write_stack("s", "[plugins.code_mode]\nenabled = true\nheap_mb = 1\n"))
    assert any("blocked" in w for w in stack.warnings)
    assert not stack.plugins["code_mode"].enabled
