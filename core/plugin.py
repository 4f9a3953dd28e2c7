"""The base class every loopstack plugin derives from.

A plugin is a class. It declares its ``name``, the ``layers`` it acts on and a pydantic
``Config`` model for its ``[plugins.<name>]`` TOML table. When a stack enables it, the
kernel builds one instance with the validated config and registers that instance with
pluggy, so hook implementations are ordinary methods marked with ``@hookimpl`` and
per-stack state lives on the instance, never in module globals.

Example::

    from loopstack import Plugin, PluginConfig, Layer, hookimpl

    class ShoutConfig(PluginConfig):
        suffix: str = "!"

    class Shout(Plugin):
        name = "shout"
        layers = (Layer.HARNESS,)
        Config = ShoutConfig
        summary = "Appends a suffix to every user message."

        @hookimpl
        def loopstack_prepare_request(self, request, ctx):
            ...
"""

from __future__ import annotations

import enum
from typing import ClassVar

from pydantic import BaseModel, ConfigDict


class Layer(str, enum.Enum):
    """The three layers an agent task runs through."""

    HARNESS = "harness"
    API = "api"
    INFERENCE = "inference"


class PluginConfig(BaseModel):
    """Base for a plugin's TOML table. Unknown keys are errors; instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Plugin:
    """Base class of built-in and third-party plugins.

    Class attributes:
        name: unique plugin name; the key of its ``[plugins.<name>]`` table.
        layers: the layers it acts on.
        Config: the pydantic model of its TOML table (``enabled`` is handled by the kernel).
        summary: one line for ``loopstack plugins``.
        implemented: ``False`` for a declared technique that does not exist yet; such a
            plugin validates its config but is skipped (with a warning) at run time.
    """

    name: ClassVar[str]
    layers: ClassVar[tuple[Layer, ...]]
    Config: ClassVar[type[PluginConfig]] = PluginConfig
    summary: ClassVar[str] = ""
    implemented: ClassVar[bool] = True

    def __init__(self, config: PluginConfig, *, arm: str = "default") -> None:
        self.config = config
        self.arm = arm

    def __repr__(self) -> str:
        return f"<{type(self).__name__} plugin {self.name!r} arm={self.arm!r}>"
