"""What a running server holds: the live stack, the engine, the store, the keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loopstack.api.auth import KeyRing
from loopstack.api.generation import EngineClient
from loopstack.api.service import ResponsesService
from loopstack.api.store import ResponseStore
from loopstack.live import LiveStack


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
        self.service = ResponsesService(self.engine, self.store, model_name=self.model_name)
