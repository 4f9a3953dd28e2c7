"""``loopstack run`` and ``loopstack replay``: the harness from the terminal.

``run`` streams an agent session: the model's text as it is generated, each tool call and
its result, compactions, the final answer. Shell commands that the approval policy holds
back are put to the person at the terminal (``y`` runs it, anything else denies); without
a terminal they are denied. The model is the stack's embedded engine unless ``--url``
(a Responses API server, over HTTP or WebSocket) or ``--chat-url`` (an OpenAI-compatible
Chat Completions server: vLLM, SGLang, llama.cpp, Ollama) says otherwise.

``replay`` re-runs a recorded session through the stack (see
:mod:`loopstack.harness.clients.replay`) and prints, per turn, the request sent and the
recorded size it must match.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from contextlib import AsyncExitStack
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import anyio
import anyio.to_thread

from loopstack.catalog import PluginCatalog
from loopstack.harness.clients.base import ModelClientError
from loopstack.harness.events import (
    AgentEvent,
    Compacted,
    FinalAnswer,
    ModelCalled,
    ToolCalled,
    TurnLimitReached,
)
from loopstack.harness.tools.approval import ToolCallRequest
from loopstack.live import LiveStack
from loopstack.stack.errors import StackError

if TYPE_CHECKING:
    from loopstack.harness.clients.embedded import EmbeddedClient
    from loopstack.harness.clients.http import ResponsesHTTPClient


class TerminalApprover:
    """Asks at the terminal; denies when there is no terminal to ask."""

    def __init__(self, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stderr) -> None:
        self.stdin, self.stdout = stdin, stdout

    async def __call__(self, request: ToolCallRequest) -> bool:
        if not self.stdin.isatty():
            print(f"\n  [denied: no terminal to approve `{request.command}`]", file=self.stdout, flush=True)
            return False
        escalated = " with network access" if request.is_escalated else ""
        question = f"\n  run `{request.command}` in {request.workdir}{escalated}? [y/N] "

        def ask() -> str:
            print(question, end="", file=self.stdout, flush=True)
            return self.stdin.readline()

        return (await anyio.to_thread.run_sync(ask)).strip().lower() in ("y", "yes")


def _print_event(event: AgentEvent, out: TextIO, *, as_json: bool, streamed: bool = False) -> None:
    if as_json:
        print(json.dumps({"event": type(event).__name__, **asdict(event)}, default=str), file=out, flush=True)
        return
    if isinstance(event, ModelCalled):
        u = event.usage
        print(f"\n  [model: {u.input_tokens} prompt tokens, {u.cached_tokens} cached, {u.output_tokens} generated, "
              f"{event.seconds:.2f} s]", file=out, flush=True)
    elif isinstance(event, ToolCalled):
        status = "error" if event.is_error else "ok"
        result = event.result_text if len(event.result_text) <= 400 else event.result_text[:400] + " ..."
        print(f"  > {event.name}({json.dumps(event.arguments)}) [{status}, {event.seconds:.2f} s]\n"
              f"    {result.replace(chr(10), chr(10) + '    ')}", file=out, flush=True)
    elif isinstance(event, Compacted):
        print(f"  [compacted: {event.num_outputs_elided} outputs elided, {event.num_items_dropped} items dropped, "
              f"{event.tokens_before} -> {event.tokens_after} tokens]", file=out, flush=True)
    elif isinstance(event, FinalAnswer):
        print("" if streamed else f"\n{event.text}", file=out, flush=True)  # streamed: already printed
    elif isinstance(event, TurnLimitReached):
        print(f"\n  [stopped: the turn limit ({event.max_turns}) was reached]", file=out, flush=True)


def _model_client(args: argparse.Namespace, live: LiveStack) -> Any:
    api_key = args.api_key or os.environ.get("LOOPSTACK_API_KEY")
    if args.url and args.chat_url:
        sys.exit("loopstack: give --url or --chat-url, not both")
    if args.chat_url:
        from loopstack.harness.clients.chat import ChatCompletionsClient

        return ChatCompletionsClient(args.chat_url, api_key)
    if args.url and args.transport == "ws":
        from loopstack.harness.clients.websocket import ResponsesWebSocketClient

        return ResponsesWebSocketClient(args.url, api_key)
    if args.url:
        from loopstack.harness.clients.http import ResponsesHTTPClient

        return ResponsesHTTPClient(args.url, api_key)
    from loopstack.harness.clients.embedded import EmbeddedClient

    return EmbeddedClient.from_live(live)  # the harness's own stack: built once


async def _run(args: argparse.Namespace, live: LiveStack, out: TextIO) -> int:
    from loopstack.harness.agent import Agent
    from loopstack.harness.tools.mcp import MCPServer
    from loopstack.harness.tools.shell import ShellTool

    runtime = live.current
    harness = runtime.stack.harness
    if args.approval:
        harness = harness.model_copy(update={"approval": args.approval})
    async with AsyncExitStack() as stack:
        stack.callback(live.close)  # last: after the client and the MCP servers
        client = _model_client(args, live)
        stack.push_async_callback(client.aclose)
        tools: list[Any] = []
        if not args.no_shell:
            tools.append(ShellTool.from_config(harness, base_dir=Path(args.workdir), approver=TerminalApprover()))
        for index, command in enumerate(args.mcp or []):
            argv = shlex.split(command)
            server = await stack.enter_async_context(MCPServer.stdio(argv[0], argv[1:], name=f"mcp{index}"))
            tools.extend(await server.list_tools())
        state = getattr(client, "state", None)  # the embedded client knows its engine's window
        window = state.engine.max_model_len if state is not None else args.context_window
        agent = Agent(client, tools, instructions=args.instructions, runtime=runtime,
                      max_turns=args.max_turns or harness.max_turns, max_output_tokens=args.max_output_tokens,
                      tool_choice_first=args.tool_choice_first, context_window=window,
                      compact_at=harness.compact_at_fraction, compact_target=min(0.6, harness.compact_at_fraction),
                      on_text_delta=None if args.json else (lambda delta: print(delta, end="", file=out, flush=True)))
        try:
            async for event in agent.stream(args.task):
                _print_event(event, out, as_json=args.json, streamed=not args.json)
        except ModelClientError as exc:
            print(f"loopstack: the model server refused the request: {exc}", file=sys.stderr)
            return 1
    return 0


def _live(stack_ref: str) -> LiveStack:
    """The stack the harness and, for the embedded engine, the API layer share."""
    try:
        return LiveStack(PluginCatalog.discover(), stack_ref)
    except StackError as exc:
        sys.exit(f"loopstack: {exc}")


def cmd_run(args: argparse.Namespace) -> int:
    live = _live(args.stack)
    try:
        return anyio.run(_run, args, live, sys.stdout)
    except KeyboardInterrupt:
        print("\nloopstack: interrupted", file=sys.stderr)
        return 130


async def _replay(args: argparse.Namespace, live: LiveStack) -> int:
    from loopstack.harness.clients.replay import replay
    from loopstack.harness.trajectory import TrajectoryError, load_trajectory

    try:
        trajectory = load_trajectory(args.trajectory)
    except TrajectoryError as exc:
        sys.exit(f"loopstack: {exc}")
    forward: ResponsesHTTPClient | EmbeddedClient | None = None
    if args.through_url:
        from loopstack.harness.clients.http import ResponsesHTTPClient

        forward = ResponsesHTTPClient(args.through_url)
    elif args.through_engine:
        from loopstack.harness.clients.embedded import EmbeddedClient

        forward = EmbeddedClient.from_live(live)
    try:
        report = await replay(trajectory, runtime=live.current, forward=forward, max_turns=args.max_turns)
    finally:
        if forward is not None:
            await forward.aclose()
        live.close()
    if args.json:
        print(json.dumps({"trajectory": trajectory.id, "turns": [asdict(r) for r in report.rows],
                          "calls_match": report.calls_match, "sizes_match": report.sizes_match,
                          "mismatches": report.mismatches}))
    else:
        print(f"{trajectory.id} ({trajectory.format}): {len(report.rows)} of {len(trajectory.turns)} turns replayed")
        print(f"{'turn':>4} {'request bytes':>14} {'chars':>8} {'recorded':>8} {'prompt tok':>10} {'cached':>8}")
        for row in report.rows:
            print(f"{row.turn:>4} {row.request_bytes:>14,} {row.conversation_chars:>8,} {row.recorded_chars:>8,} "
                  f"{row.input_tokens:>10,} {row.cached_tokens:>8,}")
        print(f"tool calls as recorded: {'yes' if report.calls_match else 'NO'}; "
              f"request sizes as recorded: {'yes' if report.sizes_match else 'NO'}")
        for line in report.mismatches[:10]:
            print(f"  mismatch: {line}")
    return 0 if report.calls_match and report.sizes_match else 1


def cmd_replay(args: argparse.Namespace) -> int:
    return anyio.run(_replay, args, _live(args.stack))


def add_parsers(sub: Any) -> None:
    """Add ``run`` and ``replay`` to the ``loopstack`` command's subparsers."""
    p = sub.add_parser("run", help="run an agent session and stream it to the terminal",
                       description="Run TASK with the shell tool (in --workdir, under the stack's approval policy) "
                       "and any --mcp servers. The model is the stack's embedded engine unless --url or --chat-url "
                       "names a server.")
    p.add_argument("task", help="what the agent should do")
    p.add_argument("--stack", "-s", default="baseline", help="stack name or file (default: baseline)")
    p.add_argument("--url", help="a Responses API root, e.g. http://127.0.0.1:8321/v1")
    p.add_argument("--transport", choices=("http", "ws"), default="http", help="for --url: HTTP/SSE or WebSocket")
    p.add_argument("--chat-url", help="an OpenAI-compatible Chat Completions root (vLLM, SGLang, llama.cpp, Ollama)")
    p.add_argument("--api-key", help="bearer key for --url/--chat-url (default: $LOOPSTACK_API_KEY)")
    p.add_argument("--mcp", action="append", metavar="COMMAND", help="an MCP server to start over stdio; repeatable")
    p.add_argument("--workdir", default=".", help="the shell tool's sandbox root (default: .)")
    p.add_argument("--approval", choices=("never", "on-request", "untrusted"), help="override the stack's policy")
    p.add_argument("--no-shell", action="store_true", help="do not give the agent the shell tool")
    p.add_argument("--instructions", default="You are a helpful assistant. Use the tools when they help.",
                   help="the system prompt")
    p.add_argument("--max-turns", type=int, help="model calls before stopping (default: the stack's)")
    p.add_argument("--max-output-tokens", type=int, default=512, help="per model call (default 512)")
    p.add_argument("--tool-choice-first", default="auto", choices=("auto", "required", "none"),
                   help="tool_choice of the first turn (small models may need 'required')")
    p.add_argument("--context-window", type=int, default=None,
                   help="for remote models: the context window in tokens, for compaction")
    p.add_argument("--json", action="store_true", help="print events as JSON lines")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("replay", help="re-run a recorded agent session through a stack",
                       description="Replay TRAJECTORY (mini-swe-agent .traj.json or an OpenAI message list): the "
                       "recording plays the model and the tools, the stack's plugins run for real. Exit status 1 "
                       "when the calls or request sizes differ from the recording.")
    p.add_argument("trajectory", help="trajectory file")
    p.add_argument("--stack", "-s", default="baseline", help="stack name or file (default: baseline)")
    p.add_argument("--through-url", metavar="URL", help="also send each request to this Responses API root "
                   "(max_output_tokens=1) and report its token usage")
    p.add_argument("--through-engine", action="store_true",
                   help="also send each request to the stack's embedded engine and report its token usage")
    p.add_argument("--max-turns", type=int, help="replay only the first N turns (an append-only cut)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_replay)
