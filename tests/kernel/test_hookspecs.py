"""Meta-tests (the datasette idea): every hook is documented, has a facade method and a test."""

from __future__ import annotations

import inspect

import pytest

from loopstack import hookspecs
from loopstack.hooks import HookFacade
from tests.support import REPO

HOOKS = sorted(name for name in dir(hookspecs) if name.startswith("loopstack_"))


def test_hooks_exist():
    assert len(HOOKS) >= 15


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_docstring(hook):
    assert len(inspect.getdoc(getattr(hookspecs, hook)) or "") > 40


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_in_the_plugin_guide(hook):
    assert f"`{hook}`" in (REPO / "docs" / "writing-plugins.md").read_text()


@pytest.mark.parametrize("hook", [h for h in HOOKS if h != "loopstack_bench_workloads"])
def test_every_stack_hook_has_a_facade_method(hook):
    facade_method = hook.removeprefix("loopstack_")
    assert callable(getattr(HookFacade, facade_method, None)), f"HookFacade.{facade_method} is missing"


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_exercised_by_a_test(hook):
    tests = "".join(
        p.read_text() for p in (REPO / "tests").rglob("*.py") if p.name != "test_hookspecs.py"
    )
    short = hook.removeprefix("loopstack_")
    assert hook in tests or f"hooks.{short}(" in tests, f"no test calls or implements {hook}"
