"""``loopstack kv advise TRACE...``: how large a KV cache, which block size and eviction policy.

Replays the trace (a loopstack server request log, a Mooncake trace, or mini-swe-agent
``per_turn_usage.jsonl``; several files are one timeline) against the engine's own block manager at
every block size x capacity x policy (x second tier on/off with ``--tier-slots``), prints each
configuration's hit rate, prefill tokens saved and modelled prefill seconds, the best configuration
per capacity, and the smallest capacity whose best saves 95% of what the largest capacity's best
saves. No model runs: see ``loopstack.plugins.kv_cache.advisor.replay`` for what is modelled.

Capacities are in tokens (``k`` = 1024, ``M`` = 1024 k). Defaults: the trace's block size and two
multiples; powers of two from about 1/64 to 1/2 of what a never-evicting cache would hold; every
engine policy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parsers", "cmd_kv_advise"]


def cmd_kv_advise(args: argparse.Namespace) -> int:
    from loopstack.engine.eviction import POLICIES
    from loopstack.plugins.kv_cache.advisor.replay import DEFAULT_SERVICE, ServiceModel
    from loopstack.plugins.kv_cache.advisor.report import (
        Grid,
        advice_json,
        default_block_sizes,
        default_capacities,
        format_advice,
        parse_tokens,
        recommend,
        run_grid,
    )
    from loopstack.plugins.kv_cache.advisor.traces import load_traces
    from loopstack.plugins.kv_cache.advisor.units import infinite_cache

    try:
        requests = load_traces([Path(p) for p in args.traces], limit=args.limit)
        policies = _names(args.policies) if args.policies else tuple(POLICIES)
        unknown = [p for p in policies if p not in POLICIES]
        if unknown:
            raise ValueError(f"unknown policy {unknown[0]!r}; known: {', '.join(POLICIES)}")
        block_sizes = tuple(int(b) for b in _names(args.block_sizes)) if args.block_sizes else default_block_sizes(requests)
        capacities = (tuple(parse_tokens(c) for c in _names(args.capacities)) if args.capacities
                      else default_capacities(requests, block_sizes))
        tier_tokens = args.tier_slots * requests[0].block_size  # the same host memory at every block size
        grid = Grid(block_sizes, capacities, policies, (0, tier_tokens) if tier_tokens else (0,))
        service = ServiceModel(
            prefill_tokens_per_s=args.prefill_tokens_per_s or DEFAULT_SERVICE.prefill_tokens_per_s,
            decode_s_per_token=DEFAULT_SERVICE.decode_s_per_token if args.decode_s_per_token is None else args.decode_s_per_token,
        )
        results = run_grid(requests, grid, service=service, progress=not args.no_progress)
        bounds = {size: infinite_cache(requests, size) for size in block_sizes}
    except (OSError, ValueError) as exc:
        sys.exit(f"loopstack kv advise: {exc}")
    advice = recommend(results, share=args.share, bounds=bounds)
    print(f"{len(requests)} requests, {requests[0].block_size}-token trace blocks, "
          f"{requests[-1].arrival_s - requests[0].arrival_s:,.0f} s")
    print(format_advice(advice))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(advice_json(advice), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_parsers(sub: Any) -> None:
    """Add ``kv advise`` to the ``loopstack`` command's subparsers."""
    kv = sub.add_parser("kv", help="KV cache tools: size the cache and choose its policy from a trace")
    kv_sub = kv.add_subparsers(dest="kv_command", metavar="ACTION", required=True)
    p = kv_sub.add_parser("advise", help="replay a trace at many cache sizes, block sizes and policies; recommend one",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", metavar="TRACE", help="request log, Mooncake trace or per_turn_usage.jsonl")
    p.add_argument("--block-sizes", metavar="LIST", help="block sizes in tokens, e.g. 16,32,64")
    p.add_argument("--capacities", metavar="LIST", help="cache sizes in tokens, e.g. 8192,32k,1M")
    p.add_argument("--policies", metavar="LIST", help="eviction policies (default: all: lru,slru,frequency,reuse)")
    p.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests")
    p.add_argument("--tier-slots", type=int, default=0, metavar="N",
                   help="also replay with a second tier behind the cache: N slots of the trace's block size "
                   "(the same tokens at every block size)")
    p.add_argument("--share", type=float, default=0.95,
                   help="recommend the smallest capacity saving this share of the largest's best (default 0.95)")
    p.add_argument("--prefill-tokens-per-s", type=float, metavar="N",
                   help="modelled prefill speed of the one engine, for rows without finish times (default 64000)")
    p.add_argument("--decode-s-per-token", type=float, metavar="S",
                   help="modelled decode time per output token (default 0.005)")
    p.add_argument("--json", metavar="PATH", help="also write every figure and the recommendation as JSON")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=cmd_kv_advise)
