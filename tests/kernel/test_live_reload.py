from __future__ import annotations

import pytest

from loopstack import LiveStack, hookimpl
from tests.support import Recorder


def test_valid_reload_serves_new_requests(catalog, write_stack):
    path = write_stack("live", '[plugins.recorder]\nenabled = true\nlabel = "v1"\n')
    live = LiveStack(catalog, path)
    path.write_text('[plugins.recorder]\nenabled = true\nlabel = "v2"\n')
    result = live.reload()
    assert result.ok and result.stack_name == "live"
    with live.request() as ctx:
        request = {}
        ctx.hooks.prepare_request(request=request, ctx=ctx)
    assert request == {"seen_by": ["v2"]}
    assert ("unconfigure", "v1") in Recorder.calls  # old stack retired once idle


def test_in_flight_request_keeps_its_stack_until_done(catalog, write_stack):
    path = write_stack("live", '[plugins.recorder]\nenabled = true\nlabel = "v1"\n')
    live = LiveStack(catalog, path)
    with live.request() as ctx:
        path.write_text('[plugins.recorder]\nenabled = true\nlabel = "v2"\n')
        assert live.reload().ok
        request = {}
        ctx.hooks.prepare_request(request=request, ctx=ctx)
        assert request == {"seen_by": ["v1"]}
        assert ("unconfigure", "v1") not in Recorder.calls
    assert ("unconfigure", "v1") in Recorder.calls


def test_invalid_reload_is_rejected_and_old_stack_keeps_serving(catalog, write_stack):
    path = write_stack("live", '[plugins.recorder]\nenabled = true\nlabel = "v1"\n')
    live = LiveStack(catalog, path)
    path.write_text("[plugins.recorder]\nenabled = true\nweight = 99\n")
    result = live.reload()
    assert not result.ok and result.issues[0].key == "plugins.recorder.weight"
    assert live.reloads_rejected == 1
    with live.request() as ctx:
        request = {}
        ctx.hooks.prepare_request(request=request, ctx=ctx)
    assert request == {"seen_by": ["v1"]}


def test_reload_rejected_when_a_plugin_fails_to_configure(catalog, write_stack, monkeypatch):
    path = write_stack("live", "[plugins.recorder]\nenabled = true\n")
    live = LiveStack(catalog, path)

    @hookimpl
    def broken(self, runtime):
        raise RuntimeError("cannot start")

    monkeypatch.setattr(Recorder, "loopstack_configure", broken)
    result = live.reload()
    assert not result.ok and "cannot start" in result.error
    assert live.current.stack.name == "live"


def test_reload_to_another_file(catalog, write_stack):
    first = write_stack("first", "")
    second = write_stack("second", "[plugins.recorder]\nenabled = true\n")
    live = LiveStack(catalog, first)
    assert live.reload(second).ok
    assert live.current.stack.name == "second"
    with pytest.raises(Exception):
        LiveStack(catalog, write_stack("broken", "[engine]\nreplicas = 0\n"))
