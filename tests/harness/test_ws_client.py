"""The WebSocket client never answers a request with an abandoned response's events."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest
from websockets.asyncio.server import serve

from loopstack.harness.clients.websocket import ResponsesWebSocketClient


class _Ctx:
    """A minimal request context (the client records bytes and metrics on it)."""

    def __init__(self) -> None:
        self._state: dict[str, Any] = {}

    def state(self, key: Any, factory: Any = None) -> Any:  # a StateKey, or a name and a factory
        if key not in self._state:
            self._state[key] = (factory or key.factory)()
        return self._state[key]

    def observe(self, *args: Any, **kwargs: Any) -> None:
        pass

    def count(self, *args: Any, **kwargs: Any) -> None:
        pass


def test_a_timed_out_response_does_not_answer_the_next_request():
    counter = itertools.count(1)

    async def handler(ws: Any) -> None:  # a server whose first response is slow
        async for _ in ws:
            n = next(counter)
            await asyncio.sleep(0.5 if n == 1 else 0.0)
            await ws.send(json.dumps({"type": "response.completed", "response": {"id": f"resp_{n}", "output": []}}))

    async def main() -> tuple[str, int]:
        async with serve(handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            client = ResponsesWebSocketClient(f"ws://127.0.0.1:{port}/v1", timeout_s=0.2)
            ctx = _Ctx()
            with pytest.raises(TimeoutError):
                await client.exchange(b'{"type":"response.create","input":"first"}', ctx)
            await asyncio.sleep(0.6)  # the abandoned response arrives meanwhile
            response = await client.exchange(b'{"type":"response.create","input":"second"}', ctx)
            setups = client.statistics().connection_setups
            await client.aclose()
            return response["id"], setups

    response_id, setups = asyncio.run(main())
    assert response_id == "resp_2" and setups == 2  # the timed-out connection was dropped, a new one opened


def test_a_client_keeps_only_the_most_recently_used_session_transports_open():
    from loopstack.harness.clients import base as model_client

    class Transport:
        def __init__(self) -> None:
            self.closed = 0

        async def create(self, request: Any, ctx: Any, **kwargs: Any) -> dict[str, Any]:
            return {"id": "r"}

        async def aclose(self) -> None:
            self.closed += 1

    class Hooks:
        def __init__(self, transport: Transport) -> None:
            self.transport = transport

        def client_transport(self, ctx: Any) -> Transport:
            return self.transport

    class Ctx:
        def __init__(self, transport: Transport) -> None:
            self.hooks = Hooks(transport)

    client = type("Client", (), {"endpoint": None, "transports": model_client.TransportCache()})()
    transports = [Transport() for _ in range(model_client.MAX_OPEN_TRANSPORTS + 3)]

    async def main() -> None:
        for transport in transports:
            await model_client.dispatch(client, {}, Ctx(transport), send=None, on_text_delta=None)
        await model_client.dispatch(client, {}, Ctx(transports[0]), send=None, on_text_delta=None)  # used again

    asyncio.run(main())
    assert [t.closed for t in transports[:4]] == [1, 1, 1, 1]  # 0-2 evicted; 0 comes back and evicts 3
    assert all(t.closed == 0 for t in transports[4:])
    assert len(client.transports) == model_client.MAX_OPEN_TRANSPORTS
