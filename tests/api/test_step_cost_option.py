"""``[engine] step_cost = "auto"``: the server measures this machine's step cost exactly when a
plugin of the stack proposes drafts (core/api/server.py)."""

from __future__ import annotations

import pytest

from loopstack.api.server import build_state, close_state


@pytest.mark.parametrize(("enabled", "expected"), [(True, "measure"), (False, "default")])
def test_the_served_engine_measures_when_the_stack_speculates(write_stack, monkeypatch, enabled, expected):
    seen = {}

    def engine_from_table(table, kv_cache=None, *, speculates=False):
        from loopstack.api.server import engine_options

        seen["step_cost"] = engine_options(table, kv_cache, speculates=speculates).step_cost
        return object()

    monkeypatch.setattr("loopstack.api.server.engine_from_table", engine_from_table)
    monkeypatch.setattr("loopstack.engine.AsyncEngine", lambda engine: engine)
    stack = write_stack("spec", f"""
        [stack]
        name = "spec"

        [plugins.spec_decode]
        enabled = {str(enabled).lower()}
        """)
    state = build_state(stack, store_path=":memory:")
    try:
        assert seen == {"step_cost": expected}
    finally:
        close_state(state)
