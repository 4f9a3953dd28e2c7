"""The ``loopstack`` command."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from loopstack import __version__
from loopstack.catalog import PluginCatalog, PluginLoadError
from loopstack.cli.agent import add_parsers as add_agent_parsers
from loopstack.cli.kv import add_parsers as add_kv_parsers
from loopstack.cli.model import add_parsers as add_model_parsers
from loopstack.stack.errors import StackError
from loopstack.stack.loader import StackLoader, list_stacks

EPILOG = "Docs: docs/architecture.md, docs/stacks.md, docs/writing-plugins.md, docs/harness.md."


def _catalog() -> PluginCatalog:
    try:
        return PluginCatalog.discover()
    except PluginLoadError as exc:
        sys.exit(f"loopstack: {exc}")


def _load(loader: StackLoader, ref: str):
    try:
        return loader.load(ref)
    except StackError as exc:
        sys.exit(f"loopstack: {exc}")


def cmd_plugins(args: argparse.Namespace) -> int:
    catalog = _catalog()
    stack = _load(StackLoader(catalog), args.stack) if args.stack else None
    rows = [("name", "layers", "source", "status", f"in {stack.name}" if stack else "")]
    for spec in sorted(catalog, key=lambda s: s.name):
        status = "ready" if spec.implemented else "not implemented yet"
        enabled = ""
        if stack:
            settings = stack.plugins.get(spec.name)
            enabled = "on" if settings and settings.enabled else "off"
            split = [e for e, c in stack.experiments.items() if c.plugin == spec.name]
            if split:
                enabled += f" (experiment {split[0]})"
        rows.append((spec.name, ",".join(layer.value for layer in spec.layers), spec.source, status, enabled))
    for name in sorted(catalog.blocked):
        rows.append((name, "?", "?", "blocked by LOOPSTACK_DISABLE_PLUGINS", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def cmd_stacks_list(args: argparse.Namespace) -> int:
    for path in list_stacks():
        print(f"{path.stem:<20} {path}")
    return 0


def cmd_stacks_show(args: argparse.Namespace) -> int:
    from loopstack.stack.toml import dumps

    stack = _load(StackLoader(_catalog()), args.stack)
    data = {
        "stack": {"name": stack.name, "description": stack.meta.description, "files": [str(p) for p in stack.files]},
        "engine": stack.engine.model_dump(),
        "api": stack.api.model_dump(),
        "harness": stack.harness.model_dump(),
        "plugins": {
            name: {"enabled": s.enabled, **(s.config.model_dump() if s.config else {})}
            for name, s in sorted(stack.plugins.items())
        },
        "experiments": {name: e.model_dump() for name, e in stack.experiments.items()},
    }
    print(json.dumps(data, indent=2) if args.json else dumps(data))
    for warning in stack.warnings:
        print(f"# {warning}", file=sys.stderr)
    return 0


def cmd_stacks_validate(args: argparse.Namespace) -> int:
    loader = StackLoader(_catalog())
    failed = 0
    for ref in args.files:
        stack, issues = loader.check(ref)
        for issue in issues:
            print(issue)
        if stack is None:
            failed += 1
            print(f"{ref}: invalid ({sum(i.severity == 'error' for i in issues)} error(s))")
        else:
            print(f"{ref}: ok (stack {stack.name!r}, {len(stack.warnings)} warning(s))")
    return 1 if failed else 0


def cmd_ab_report(args: argparse.Namespace) -> int:
    from loopstack.cli.ab_report import compare_arms, format_report

    try:
        snapshot = json.loads(Path(args.snapshot).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        sys.exit(f"loopstack: cannot read metrics snapshot {args.snapshot}: {exc}")
    if "metrics" not in snapshot or not isinstance(snapshot["metrics"], list):
        sys.exit(f"loopstack: {args.snapshot} is not a metrics snapshot (expected a 'metrics' list)")
    comparisons = compare_arms(snapshot, confidence=args.confidence, resamples=args.resamples)
    print(format_report(comparisons, args.confidence))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from loopstack.bench.registry import workloads
    from loopstack.bench.report import format_table, write_plot
    from loopstack.bench.runner import run_bench
    from loopstack.bench.workload import BenchOptionError, BenchOptions

    catalog = _catalog()
    available = workloads(catalog)
    if args.list or not args.workload:
        for name, workload in sorted(available.items()):
            print(f"{name:<14} {workload.description}")
        return 0 if args.list else 2
    if args.workload not in available:
        sys.exit(f"loopstack: unknown workload {args.workload!r}; available: {', '.join(sorted(available))}")
    loader = StackLoader(catalog)
    stacks = [_load(loader, ref) for ref in (args.stack or ["baseline"])]
    extra: dict[str, str] = {}
    for option in args.option or []:
        key, sep, value = option.partition("=")
        if not sep or not key:
            sys.exit(f"loopstack: --option takes KEY=VALUE, got {option!r}")
        extra[key.strip()] = value.strip()
    options = BenchOptions(steps=args.steps, quick=args.quick, extra=extra)
    try:
        result = asyncio.run(run_bench(available[args.workload], stacks, options, progress=not args.no_progress))
    except BenchOptionError as exc:
        sys.exit(f"loopstack bench: {exc}")
    print(format_table(result))
    if args.json:
        result.write_json(Path(args.json))
        print(f"wrote {args.json}")
    plot_path = _plot_path(args)
    if plot_path is not None:
        plot = write_plot(result, plot_path)
        print(f"wrote {plot}" if plot else "no plot: matplotlib is not installed (pip install -e '.[bench]')")
    return 0


def _plot_path(args: argparse.Namespace) -> Path | None:
    """Where the PNG goes: ``--plot``, else beside the ``--json`` file; never anywhere unasked."""
    if args.no_plot:
        return None
    if args.plot:
        return Path(args.plot)
    if args.plot_dir:  # the older flag: still honoured, as it was
        return Path(args.plot_dir) / f"{args.workload}.png"
    return Path(args.json).with_suffix(".png") if args.json else None


def cmd_serve(args: argparse.Namespace) -> int:
    from loopstack.api.auth import UnsafeBindError
    from loopstack.api.server import serve
    from loopstack.engine.errors import EngineError

    try:
        return serve(args.stack, host=args.host, port=args.port)
    except (StackError, UnsafeBindError, EngineError) as exc:
        sys.exit(f"loopstack: {exc}")


def cmd_demo(args: argparse.Namespace) -> int:
    from loopstack.cli.demo import run_demo

    return run_demo()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loopstack",
        description="Composable optimization middlewares for LLM agent loops. Each technique is a plugin; "
        "stacks (TOML files) say which plugins are on, with what settings, and which are A/B-tested.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"loopstack {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("plugins", help="list installed plugins (built-in and third-party)",
                       description="List every plugin this environment can load: name, layers, the package it "
                       "comes from, whether it is implemented, and (with --stack) whether that stack enables it.")
    p.add_argument("--stack", help="a stack name or TOML file; adds an 'enabled' column")
    p.set_defaults(func=cmd_plugins)

    stacks = sub.add_parser("stacks", help="list, show or validate stack files",
                            description="Stacks are TOML files that choose plugins and their settings.")
    stacks_sub = stacks.add_subparsers(dest="stacks_command", metavar="ACTION", required=True)
    p = stacks_sub.add_parser("list", help="stacks found in the search path")
    p.set_defaults(func=cmd_stacks_list)
    p = stacks_sub.add_parser("show", help="print a stack fully resolved (extends merged, defaults filled in)")
    p.add_argument("stack", help="a stack name or TOML file")
    p.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    p.set_defaults(func=cmd_stacks_show)
    p = stacks_sub.add_parser("validate", help="check stack files; prints every error with file, key and line",
                              description="Check stack files. Exit status 1 if any is invalid.")
    p.add_argument("files", nargs="+", help="stack names or TOML files")
    p.set_defaults(func=cmd_stacks_validate)

    ab = sub.add_parser("ab", help="A/B experiment reports")
    ab_sub = ab.add_subparsers(dest="ab_command", metavar="ACTION", required=True)
    p = ab_sub.add_parser("report", help="compare arms in a metrics snapshot, with bootstrap confidence intervals",
                          description="Read a metrics snapshot (JSON from the server's /metrics.json or a benchmark) "
                          "and compare each experiment's arms metric by metric.")
    p.add_argument("snapshot", help="metrics snapshot JSON file")
    p.add_argument("--confidence", type=float, default=0.95, help="confidence level (default 0.95)")
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (default 2000)")
    p.set_defaults(func=cmd_ab_report)

    p = sub.add_parser("bench", help="run a workload under several stacks side by side and print ratios",
                       description="Run WORKLOAD once per stack, alternating stacks each round in one process, "
                       "then print each metric per stack and the ratio last/first.")
    p.add_argument("--workload", "-w", help="workload name (see --list)")
    p.add_argument("--stack", "-s", action="append", help="stack name or file; repeat to compare (default: baseline)")
    p.add_argument("--json", metavar="PATH", help="write results as JSON, and a PNG plot beside it (same name, .png)")
    p.add_argument("--plot", metavar="PATH", help="write the PNG plot here (default: beside --json; none without either)")
    p.add_argument("--plot-dir", metavar="DIR", help=argparse.SUPPRESS)  # deprecated: DIR/WORKLOAD.png
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    p.add_argument("--steps", type=int, help="measured rounds per stack (default: the workload's)")
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    p.add_argument("--option", "-o", action="append", metavar="KEY=VALUE",
                   help="a workload setting (see the workload's docs), e.g. -o turns=8; repeatable")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--list", action="store_true", help="list workloads and exit")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("serve", help="serve a stack over the Responses API (HTTP/SSE and WebSocket)",
                       description="Start the API server on the stack's engine. --host/--port override the stack's "
                       "[api] table. Without API keys the server only binds loopback addresses. SIGHUP (or POST "
                       "/admin/reload) reloads the stack; an invalid stack is rejected and the old one keeps serving.")
    p.add_argument("--stack", "-s", default="baseline", help="stack name or file (default: baseline)")
    p.add_argument("--host", help="bind address (default: the stack's api.host)")
    p.add_argument("--port", type=int, help="port (default: the stack's api.port; 0 picks a free one)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="the main job: an agent session through all three layers on the embedded model")
    p.set_defaults(func=cmd_demo)

    add_agent_parsers(sub)
    add_model_parsers(sub)
    add_kv_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
