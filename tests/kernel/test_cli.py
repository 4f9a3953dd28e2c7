from __future__ import annotations

import pytest

from loopstack.cli.main import main
from tests.support import REPO


def test_plugins_lists_the_eight_builtins(capsys):
    assert main(["plugins", "--stack", "full"]) == 0
    out = capsys.readouterr().out
    for name in ("tool_search", "code_mode", "prefix_pinning", "ws_deltas",
                 "parallel_safety", "cache_routing", "spec_decode", "disaggregation"):
        assert name in out
    assert "in full" in out and "not implemented yet" not in out  # every built-in is ready


def test_validate_shipped_stacks(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["stacks", "validate", "stacks/baseline.toml", "stacks/full.toml"]) == 0
    out = capsys.readouterr().out
    assert "stacks/baseline.toml: ok" in out and "stacks/full.toml: ok" in out


def test_validate_broken_stack_prints_every_error(write_stack, capsys):
    path = write_stack("broken", """
    [engine]
    replicas = 0
    device = "tpu"
    [plugins.tool_search]
    enabled = true
    top_k = "five"
    """)
    assert main(["stacks", "validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"{path}:2: error: engine.replicas:" in out
    assert f"{path}:3: error: engine.device:" in out
    assert f"{path}:6: error: plugins.tool_search.top_k:" in out
    assert "invalid (3 error(s))" in out


def test_show_prints_the_resolved_stack(capsys):
    assert main(["stacks", "show", "full"]) == 0
    out = capsys.readouterr().out
    assert "[engine]" in out and "replicas = 2" in out and 'model = "smollm2-135m-instruct"' in out
    assert "[plugins.spec_decode]" in out and 'proposer = "suffix"' in out


def test_list_finds_shipped_stacks(capsys):
    assert main(["stacks", "list"]) == 0
    out = capsys.readouterr().out
    assert "baseline" in out and "full" in out


def test_unknown_stack_is_a_clear_error():
    with pytest.raises(SystemExit, match="stack 'nope' not found; tried"):
        main(["stacks", "show", "nope"])
