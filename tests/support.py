"""Helpers for the kernel tests: a recording test plugin, repository paths."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from loopstack import Layer, Plugin, PluginConfig, hookimpl

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


class RecorderConfig(PluginConfig):
    label: str = "base"
    weight: int = Field(1, ge=0, le=10)


class Unfinished(Plugin):
    """A test plugin declared but not implemented (``implemented = False``): stacks may enable it,
    the runtime skips it with a warning."""

    name = "unfinished"
    layers = (Layer.INFERENCE,)
    implemented = False


class Recorder(Plugin):
    """A test plugin that records every hook call on a shared list."""

    name = "recorder"
    layers = (Layer.HARNESS,)
    Config = RecorderConfig
    calls: list[tuple[str, str]] = []  # (hook, label); reset by the fixture

    @hookimpl
    def loopstack_configure(self, runtime):
        Recorder.calls.append(("configure", self.config.label))

    @hookimpl
    def loopstack_unconfigure(self, runtime):
        Recorder.calls.append(("unconfigure", self.config.label))

    @hookimpl
    def loopstack_prepare_request(self, request, ctx):
        Recorder.calls.append(("prepare_request", self.config.label))
        request.setdefault("seen_by", []).append(self.config.label)

    @hookimpl
    def loopstack_model_middleware(self, runtime):
        label = self.config.label

        def wrap(next_handler):
            async def handler(request, ctx):
                yield f"{label}:before"
                async for event in next_handler(request, ctx):
                    yield event

            return handler

        return wrap


def requires_shared_data() -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not SHARED_DATA.is_dir(), reason=f"real data not found at {SHARED_DATA} (a user's machine); skipping"
    )
