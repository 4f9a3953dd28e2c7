"""The example third-party plugin, installed for real into a temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from loopstack import PluginCatalog, Session, StackLoader, StackRuntime
from tests.support import REPO

EXAMPLE = REPO / "examples" / "loopstack-hello"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(EXAMPLE)],
        check=True,
        capture_output=True,
    )
    return target


@pytest.fixture
def catalog_with_example(installed, monkeypatch) -> PluginCatalog:
    monkeypatch.syspath_prepend(str(installed))
    return PluginCatalog.discover(env={})


def test_discovered_through_its_entry_point(catalog_with_example):
    spec = catalog_with_example.get("hello")
    assert spec.source == "loopstack-hello" and spec.module == "loopstack_hello"
    assert len(catalog_with_example) == 10


def test_cli_lists_it_once_installed(installed):
    env = {**os.environ, "PYTHONPATH": str(installed)}
    out = subprocess.run(
        [sys.executable, "-m", "loopstack.cli.main", "plugins"], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert any(line.split()[:1] == ["hello"] and "loopstack-hello" in line for line in out.splitlines())


def test_its_config_is_validated(catalog_with_example, write_stack):
    path = write_stack("s", '[plugins.hello]\nenabled = true\ntag = ""\ncolour = 1\n')
    _, issues = StackLoader(catalog_with_example).check(path)
    assert {i.key for i in issues} == {"plugins.hello.tag", "plugins.hello.colour"}


def _prepared(runtime, **kw):
    ctx = runtime.context(**kw)
    request = {}
    ctx.hooks.prepare_request(request=request, ctx=ctx)
    return ctx, request


def test_toggled_by_a_stack(catalog_with_example, write_stack):
    loader = StackLoader(catalog_with_example)
    on = StackRuntime(loader.load(write_stack("on", '[plugins.hello]\nenabled = true\ntag = "t1"\n')), catalog_with_example)
    off = StackRuntime(loader.load(write_stack("off", "[plugins.hello]\nenabled = false\n")), catalog_with_example)
    assert _prepared(on)[1] == {"metadata": {"hello_tag": "t1"}}
    assert _prepared(off)[1] == {}

    async def endpoint(request, ctx):
        for i in range(3):
            yield i

    async def drain(ctx):
        return [e async for e in ctx.chain("model", endpoint)({}, ctx)]

    ctx, _ = _prepared(on)
    assert anyio.run(drain, ctx) == [0, 1, 2]
    assert on.metrics.counter("hello_events_total", "").value(plugin="kernel", arm="default") == 3


def test_assigned_to_arms_by_an_experiment(catalog_with_example, write_stack):
    path = write_stack("ab", """
    [plugins.hello]
    enabled = true
    [experiments.greeting]
    plugin = "hello"
    arms = { on = 0.5, off = 0.5 }
    """)
    runtime = StackRuntime(StackLoader(catalog_with_example).load(path), catalog_with_example)
    tagged = {}
    for i in range(200):
        ctx, request = _prepared(runtime, session=Session(id=f"s{i}"))
        tagged[ctx.arm("hello")] = tagged.get(ctx.arm("hello"), 0) + int(request == {"metadata": {"hello_tag": "hello"}})
    assert tagged["off"] == 0 and 70 < tagged["on"] < 130
