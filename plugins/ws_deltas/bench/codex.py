"""Workload ``codex``: the real Codex CLI's requests over HTTP/SSE vs WebSocket mode, on the wire.

Columns are transports: ``http`` (Codex's default: every request resends the whole
conversation and its tools), ``websocket`` (``supports_websockets = true``: one connection per
session, a prewarm request, then each request names ``previous_response_id`` and carries only
the new items) and ``websocket_ws_deltas`` (the same, with the ``ws_deltas`` plugin on the
server keeping the chain's token ids, so only new items are tokenized). Each step is one
``codex exec`` session of ``turns`` tool calls then an answer, against ``loopstack serve`` on
loopback through a byte-counting relay. The server runs its real API path on a scripted engine
(a test double of the model: it calls Codex's ``exec_command`` ``turns`` times, then answers), so
the columns differ only in transport and the server's tokenization.

Per session: bytes Codex uploaded on the wire (request lines, headers, bodies, WebSocket
frames; everything the relay saw), bytes it downloaded, requests the engine served, tokens the
server tokenized, and the session's wall time (Codex start-up included).
"""

from __future__ import annotations

import asyncio
import re
import tempfile
from pathlib import Path
from typing import Any

from loopstack.bench.workload import BenchOptions, Workload
from loopstack.plugins.ws_deltas.bench.workload import CountingTokenizer
from loopstack.stack.schema import ResolvedStack

COLUMNS = ("http", "websocket", "websocket_ws_deltas")
DEFAULT_TURNS, QUICK_TURNS = 8, 3
_MARKER = re.compile(r"\bmarker-(\d+)\b")


def _call(step: int) -> str:
    # the shell evaluates $((...)): the marker's number appears in the prompt only once Codex sent the output
    return ('<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "echo marker-$((%d+0)) && ls"}}\n'
            "</tool_call>" % step)


class CodexWorkload(Workload):
    name = "codex"
    description = "the real Codex CLI's requests: HTTP/SSE vs WebSocket mode vs WebSocket + ws_deltas (bytes on the wire)"
    default_steps = 3

    def columns(self, stacks: list[ResolvedStack]) -> list[str]:
        return list(COLUMNS)

    async def setup(self, columns: list[str], stacks: list[ResolvedStack], options: BenchOptions) -> None:
        from loopstack.api.server import ServerThread, build_state
        from loopstack.testing.byte_relay import ByteRelay
        from loopstack.testing.codex_cli import CODEX_VERSION, CodexCLI
        from loopstack.testing.scripted_engine import ScriptedEngine, default_tokenizer

        self.codex = await asyncio.to_thread(CodexCLI.install)
        self.turns = int(options.extra.get("turns", QUICK_TURNS if options.quick else DEFAULT_TURNS))
        self._tmp = tempfile.TemporaryDirectory(prefix="loopstack-codex-bench-")
        tmp = Path(self._tmp.name)
        (tmp / "ws_deltas.toml").write_text('[stack]\nname = "ws_deltas"\nextends = "baseline"\n'
                                            '[plugins.ws_deltas]\nenabled = true\n')
        self.tokenizer = CountingTokenizer(default_tokenizer())
        self.engine = ScriptedEngine(self.tokenizer, self._script)
        self._states = {"baseline": build_state("baseline", engine=self.engine, store_path=tmp / "a.sqlite3"),
                        "ws_deltas": build_state(tmp / "ws_deltas.toml", engine=self.engine,
                                                 store_path=tmp / "b.sqlite3")}
        self._threads = {name: ServerThread(state).start() for name, state in self._states.items()}
        self._relays = {name: ByteRelay(thread.port).start() for name, thread in self._threads.items()}
        self._work = tmp / "work"
        self._work.mkdir()
        (self._work / "README.md").write_text("a file for `ls` to list\n")
        self._config = {"codex": CODEX_VERSION, "turns": self.turns,
                        "engine": "scripted: calls exec_command `turns` times, then answers (real tokenizer, real API)",
                        "bytes": "everything on the wire between Codex and the server (a relay on loopback)"}

    def _script(self, prompt_ids: list[int]) -> str:
        seen = {int(n) for n in _MARKER.findall(self.tokenizer.decode(prompt_ids))}
        done = max(seen, default=0)
        return f"All {done} commands ran." if done >= self.turns else _call(done + 1)

    async def step(self, column: str, index: int) -> dict[str, float]:
        server = "ws_deltas" if column == "websocket_ws_deltas" else "baseline"
        relay = self._relays[server]
        relay.reset()
        first_prompt, tokens = len(self.engine.prompts), self.tokenizer.num_tokens
        loop = asyncio.get_running_loop()
        started = loop.time()
        run = await asyncio.to_thread(self.codex.exec, f"Run `echo marker-N` for N = 1..{self.turns}, one by one.",
                                      base_url=f"http://127.0.0.1:{relay.port}/v1",
                                      websockets=column != "http", cwd=self._work, timeout=600)
        seconds = loop.time() - started
        if run.returncode != 0 or len(run.items("command_execution")) != self.turns:
            raise RuntimeError(f"codex exec did not run its {self.turns} commands ({column}): {run.stderr[-1500:]}")
        requests = len(self.engine.prompts) - first_prompt
        prompt_tokens = sum(len(p) for p in self.engine.prompts[first_prompt:])
        del self.engine.prompts[first_prompt:]
        tokenized = self.tokenizer.num_tokens - tokens
        return {
            "upload_bytes.session": relay.bytes_up,
            "upload_bytes_per_request": relay.bytes_up / requests,
            "download_bytes.session": relay.bytes_down,
            "requests.session": requests,
            "connections.session": relay.connections,
            "tokens_tokenized.session": tokenized,
            "prompt_tokens.session": prompt_tokens,
            "session_seconds": seconds,
        }

    async def teardown(self) -> None:
        from loopstack.api.server import close_state

        for relay in getattr(self, "_relays", {}).values():
            relay.close()
        for thread in getattr(self, "_threads", {}).values():
            thread.stop()
        for state in getattr(self, "_states", {}).values():
            close_state(state)
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            tmp.cleanup()

    def config(self) -> dict[str, Any]:
        return dict(getattr(self, "_config", {}))
