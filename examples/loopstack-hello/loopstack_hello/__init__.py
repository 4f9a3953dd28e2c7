"""A third-party loopstack plugin, as small as a useful one gets.

It shows the three things a plugin usually does:

* a config model, validated from the stack's ``[plugins.hello]`` table;
* a synchronous hook that changes a decision (``loopstack_prepare_request`` tags the
  request's metadata so the tag is visible in server logs);
* an async middleware on the hot path (``loopstack_model_middleware`` counts the
  events streamed back from the model, without buffering the stream).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field

from loopstack import Layer, Plugin, PluginConfig, hookimpl


class HelloConfig(PluginConfig):
    tag: str = Field("hello", min_length=1, max_length=64, description="value of metadata.hello_tag")
    count_events: bool = Field(True, description="count streamed model events in metric hello_events_total")


class Hello(Plugin):
    name = "hello"
    layers = (Layer.HARNESS,)
    Config = HelloConfig
    summary = "Tags each request's metadata and counts streamed model events."

    @hookimpl
    def loopstack_prepare_request(self, request: dict[str, Any], ctx: Any) -> None:
        request.setdefault("metadata", {})["hello_tag"] = self.config.tag

    @hookimpl
    def loopstack_model_middleware(self, runtime: Any):
        if not self.config.count_events:
            return None

        def wrap(next_handler):
            async def handler(request: dict[str, Any], ctx: Any) -> AsyncIterator[Any]:
                async for event in next_handler(request, ctx):
                    ctx.count("hello_events_total", help="model events seen by the hello plugin")
                    yield event

            return handler

        return wrap
