"""Workload ``transport``: real agent sessions replayed over three transports, TLS on loopback.

Columns are transports, not stacks: ``http_new_tls`` (full resend, a new TLS connection per
call), ``http_keepalive`` (full resend over one kept-alive TLS connection) and ``ws_deltas``
(one wss connection per session, deltas, server-side token state). Each step replays one
recorded mini-swe-agent session (``../shared/data/trajectories``, 20 to 48 turns) through the
real agent loop and Responses client to ``loopstack serve`` over TLS (a certificate made at
run time). The server runs its real API path (validation, rendering, tokenization with the
real SmolLM2 tokenizer, SQLite store, event stream) on a scripted engine that answers each
call with the recorded turn, so the transports differ only in transport and API work, and
every column sends the same conversation (the prompts are checked to be identical).

Per session: bytes the client uploaded (request bodies / WebSocket messages; HTTP headers
and TLS framing not counted), tokens the server tokenized and the time it spent doing so,
TLS connection setups (handshakes the server saw), and the client-side time per call (the
scripted engine answers at once, so that is all overhead).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import threading
import time
from array import array
from collections import deque
from pathlib import Path
from typing import Any

from loopstack.bench.workload import BenchOptions, Workload
from loopstack.stack.schema import ResolvedStack

COLUMNS = ("http_new_tls", "http_keepalive", "ws_deltas")
TRAJECTORIES = "trajectories/swebench_minisweagent/full_trajectories"
QUICK_TURNS = 12


class CountingTokenizer:
    """The server's tokenizer, counting what ``encode`` tokenizes and the time it takes."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.num_tokens = 0
        self.seconds = 0.0

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        started = time.perf_counter()
        ids = self._tokenizer.encode(text, **kwargs)
        self.seconds += time.perf_counter() - started
        self.num_tokens += len(ids)
        return ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


class _TLSServer:
    """``loopstack serve``'s app under uvicorn with TLS on a thread; counts TLS handshakes."""

    def __init__(self, state: Any, tls: Any) -> None:
        import uvicorn

        from loopstack.api.app import create_app

        config = uvicorn.Config(create_app(state), host="127.0.0.1", port=0, log_level="warning",
                                ws="websockets-sansio", lifespan="off", ssl_certfile=str(tls.certfile),
                                ssl_keyfile=str(tls.keyfile), timeout_graceful_shutdown=5)
        config.load()
        self.num_handshakes = 0
        config.ssl.sni_callback = self._count  # called once per ClientHello, with or without SNI
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="transport-bench-api", daemon=True)

    def _count(self, *args: Any) -> None:
        self.num_handshakes += 1

    def start(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the TLS API server did not start")
            time.sleep(0.01)
        return f"https://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=15)


def _recorded_text(turn: Any) -> str:
    from loopstack.api.conversation import format_tool_call

    blocks = "".join(format_tool_call(c.name, json.dumps(c.arguments, ensure_ascii=False)) for c in turn.calls)
    return f"{turn.text}\n{blocks}" if turn.text and blocks else turn.text or blocks


def _digest(prompt_ids: list[int]) -> str:
    return hashlib.blake2b(array("i", prompt_ids).tobytes(), digest_size=12).hexdigest()


class TransportWorkload(Workload):
    name = "transport"
    description = "replayed agent sessions over HTTP (new TLS conn / keep-alive, full resend) vs WebSocket deltas"
    default_steps = 5  # one recorded session per step

    def __init__(self) -> None:
        self._config: dict[str, Any] = {}
        self._digests: dict[tuple[str, int], list[str]] = {}
        self._mismatches: list[str] = []
        self._per_session: dict[str, dict[str, dict[str, float]]] = {}  # session -> column -> totals

    def columns(self, stacks: list[ResolvedStack]) -> list[str]:
        return list(COLUMNS)

    async def setup(self, columns: list[str], stacks: list[ResolvedStack], options: BenchOptions) -> None:
        from loopstack import PluginCatalog, StackLoader, StackRuntime
        from loopstack.api.server import build_state
        from loopstack.harness.trajectory import load_trajectory
        from loopstack.testing.loopback_tls import make_loopback_tls
        from loopstack.testing.scripted_engine import ScriptedEngine, default_tokenizer

        paths = sorted((options.data_dir / TRAJECTORIES).glob("*.traj.json"))
        if not paths:
            raise FileNotFoundError(f"no recorded sessions in {options.data_dir / TRAJECTORIES}")
        self._trajectories = [load_trajectory(p) for p in paths]
        self._max_turns = QUICK_TURNS if options.quick else None
        self._tmp = tempfile.TemporaryDirectory(prefix="loopstack-transport-")
        tmp = Path(self._tmp.name)
        stack_path = tmp / "ws_deltas.toml"
        stack_path.write_text('[stack]\nname = "ws_deltas"\nextends = "baseline"\n'
                              '[plugins.ws_deltas]\nenabled = true\n')
        catalog = PluginCatalog.discover()
        loader = StackLoader(catalog)
        self._runtimes = {"off": StackRuntime(loader.load("baseline"), catalog),
                          "on": StackRuntime(loader.load(stack_path), catalog)}
        self.tokenizer = CountingTokenizer(default_tokenizer())
        self._script: deque[str] = deque()
        self.engine = ScriptedEngine(self.tokenizer, self._next_text)
        self._state = build_state(stack_path, engine=self.engine, store_path=tmp / "responses.sqlite3")
        # the suffix renderer's one-time template probe, outside the measured calls
        self._state.live.current.instance("ws_deltas").token_state.renderer(self.tokenizer)
        self._tls = make_loopback_tls(tmp / "tls")
        self._server = _TLSServer(self._state, self._tls)
        self._url = self._server.start()
        self._config = {"sessions": [t.id for t in self._trajectories],
                        "turns": [len(t.turns) for t in self._trajectories], "max_turns": self._max_turns,
                        "tls": "loopback, private CA made at run time (cryptography)",
                        "engine": "scripted: answers each call with the recorded turn (real tokenizer, real API)",
                        "upload_bytes": "request bodies / WebSocket messages; HTTP headers and TLS framing excluded"}

    def _next_text(self, prompt_ids: list[int]) -> str:
        return self._script.popleft() if self._script else ""

    async def step(self, column: str, index: int) -> dict[str, float]:
        from loopstack.harness.agent import Agent
        from loopstack.harness.clients.http import ResponsesHTTPClient
        from loopstack.harness.clients.replay import ReplayClient
        from loopstack.harness.events import ModelCalled

        trajectory = self._trajectories[index % len(self._trajectories)]
        turns = trajectory.turns[: self._max_turns] if self._max_turns else trajectory.turns
        self._script = deque(_recorded_text(t) for t in turns)
        replay = ReplayClient(trajectory)  # only its tools: each answers with the recorded output
        client = ResponsesHTTPClient(self._url, ssl_context=self._tls.client_context,
                                     keepalive=column != "http_new_tls")
        runtime = self._runtimes["on" if column == "ws_deltas" else "off"]
        agent = Agent(client, replay.tools(), instructions=trajectory.instructions, runtime=runtime,
                      max_turns=len(turns), model="recorded")
        first_prompt = len(self.engine.prompts)
        handshakes, tokens, seconds = self._server.num_handshakes, self.tokenizer.num_tokens, self.tokenizer.seconds
        calls: list[ModelCalled] = []
        try:
            async for event in agent.stream(trajectory.task):
                if isinstance(event, ModelCalled):
                    calls.append(event)
        finally:
            await client.aclose()
        self._digests[(column, index)] = [_digest(p) for p in self.engine.prompts[first_prompt:]]
        self._mismatches.extend(f"{column}/{trajectory.id}: {m}" for m in replay.mismatches)
        del self.engine.prompts[first_prompt:]
        num = len(calls)
        upload = sum(c.request_bytes for c in calls)
        tokenized = self.tokenizer.num_tokens - tokens
        self._per_session.setdefault(trajectory.id, {})[column] = {
            "calls": num, "upload_bytes": upload, "tokens_tokenized": tokenized,
            "connection_setups": self._server.num_handshakes - handshakes,
            "overhead_ms_per_call": round(1000 * sum(c.seconds for c in calls) / num, 2)}
        return {
            "upload_bytes.session": upload,
            "tokens_tokenized.session": tokenized,
            "connection_setups.session": self._server.num_handshakes - handshakes,
            "overhead_ms_per_call": 1000 * sum(c.seconds for c in calls) / num,
            "tokenize_ms_per_call": 1000 * (self.tokenizer.seconds - seconds) / num,
            "upload_bytes_per_call": upload / num,
            "tokens_tokenized_per_call": tokenized / num,
            "calls.session": num,
        }

    async def teardown(self) -> None:
        from loopstack.api.server import close_state

        server = getattr(self, "_server", None)
        if server is not None:
            server.stop()
            close_state(self._state)
        for runtime in getattr(self, "_runtimes", {}).values():
            runtime.close()
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            tmp.cleanup()

    def config(self) -> dict[str, Any]:
        sessions = sorted({index for _, index in self._digests})
        identical = all(len({tuple(self._digests[(c, i)]) for c in COLUMNS if (c, i) in self._digests}) == 1
                        for i in sessions)
        return {**self._config, "prompts_identical_across_columns": identical,
                "replay_mismatches": self._mismatches[:10], "per_session": self._per_session}
