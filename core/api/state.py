"""What a running server holds: the live stack, the engine, the store, the keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loopstack.api.auth import KeyRing
from loopstack.api.generation import EngineClient, GenerationDefaults
from loopstack.api.service import ResponsesService
from loopstack.api.store import ResponseStore
from loopstack.live import LiveStack, ReloadResult


@dataclass
class ServerState:
    live: LiveStack
    engine: EngineClient
    store: ResponseStore
    keyring: KeyRing
    model_name: str
    max_body_bytes: int
    service: ResponsesService = field(init=False)
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.service = ResponsesService(self.engine, self.store, model_name=self.model_name,
                                        hosted_tools=self.live.current.stack.api.hosted_tools,
                                        defaults=GenerationDefaults.of(self.live.current.stack.api))

    def reload(self) -> ReloadResult:
        """Reload the stack file; a router in front of replicas is announced to the new stack's
        plugins (``loopstack_router_started``), so its routing plugin gets KV events and health."""
        from loopstack.inference.router import Router

        result = self.live.reload()
        if result.ok and isinstance(self.engine, Router):
            self.engine.announce(self.live.current.hooks)
        if result.ok:
            self.apply_kv_cache()
            self.service.hosted_tools = self.live.current.stack.api.hosted_tools
            self.service.defaults = GenerationDefaults.of(self.live.current.stack.api)
        return result

    def apply_kv_cache(self) -> None:
        """Give the engine the serving stack's KV cache settings (``loopstack_kv_cache``): the
        eviction policy and the pin share switch now; a tier or request log waits for a restart."""
        from loopstack.engine.cache_options import KVCacheOptions

        configure = getattr(self.engine, "configure_kv_cache", None)  # a remote or scripted engine has none
        if configure is None:
            return
        options = self.live.current.hooks.kv_cache(self.live.current.stack.engine) or KVCacheOptions()
        configure(options)
