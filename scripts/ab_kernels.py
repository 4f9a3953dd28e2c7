"""The engine's C++ kernels of the working tree against those of a commit, in one process,
alternating: decode attention (``attend_rows``: batches of one-row sequences, and one sequence's
verification rows) and the q4q8 matmul, at 1 and 8 rows.

    .venv/bin/python scripts/ab_kernels.py --against HEAD~1

Both builds are compiled here (about two minutes each, cached by torch afterwards). Each case runs
``--rounds`` rounds; a round times ``--calls`` calls of one build, then of the other (the order
alternating), and the table gives each build's median and the median of the per-round ratios
(new / old: below 1 is faster), the figure to trust on a shared, noisy machine. Attention reads a
different layer's float16 cache (the engine's under the C++ loop) on each call (30 of them), so K/V come
from memory, as in a decode step.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loopstack.engine.model import extension, quant

CSRC = "core/engine/model/csrc"


def checkout(rev: str, into: Path) -> Path:
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True).stdout.strip())
    archive = into / "csrc.tar"
    subprocess.run(["git", "-C", str(root), "archive", "-o", str(archive), rev, CSRC], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / CSRC


def compare(label: str, old: Callable[[int], Any], new: Callable[[int], Any], rounds: int, calls: int) -> None:
    times: dict[str, list[float]] = {"old": [], "new": []}
    ratios = []
    for index in range(rounds):
        order = (("old", old), ("new", new)) if index % 2 == 0 else (("new", new), ("old", old))
        for tag, run in order:
            started = time.perf_counter()
            for call in range(calls):
                run(call)
            times[tag].append((time.perf_counter() - started) / calls)
        ratios.append(times["new"][-1] / times["old"][-1])
    print(f"{label:34s} old {statistics.median(times['old']) * 1e6:8.1f} us  new "
          f"{statistics.median(times['new']) * 1e6:8.1f} us  new/old {statistics.median(ratios):.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default="HEAD", help="the commit whose kernels are 'old' (default: HEAD)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as folder:
        old = extension.compile_kernels(checkout(args.against, Path(folder)), "ab_kernels_old")
        new = extension.compile_kernels(name="ab_kernels_new")
        num_heads, num_kv_heads, head_dim, block_size, layers = 9, 3, 64, 16, 30  # SmolLM2-135M
        # batch sequences of one row each (decode), or one sequence of `batch` rows (a verification)
        for batch, context, verify in ((1, 160, False), (1, 2048, False), (8, 160, False), (8, 512, False),
                                       (8, 512, True), (8, 2048, True)):
            num_blocks = -(-context // block_size)
            num_seqs = 1 if verify else batch
            # float16, as the engine's cache under the C++ loop (model.kv_cache_dtype)
            caches = [torch.randn(2, num_seqs * num_blocks * block_size, num_kv_heads, head_dim).half()
                      for _ in range(layers)]
            tables = torch.arange(num_seqs * num_blocks).view(num_seqs, num_blocks)
            q = torch.randn(batch, num_heads, head_dim)
            lengths = [context - batch + 1 + row for row in range(batch)] if verify else [context - row for row in range(batch)]
            query_lens = [batch] if verify else [1] * batch

            def attend(ext: Any) -> Callable[[int], Any]:
                return lambda call: ext.attend_rows(q, caches[call % layers], tables, lengths, query_lens, -1,
                                                    block_size, head_dim ** -0.5)
            label = f"attention, {'one sequence verifying' if verify else 'batch'} {batch}, context {context}"
            compare(label, attend(old), attend(new), args.rounds, args.calls)
        for n, k, bits in ((3072, 576, 4), (576, 1536, 4), (49152, 576, 8)):
            packed, dm = (quant.pack_q4 if bits == 4 else quant.pack_q8)(torch.randn(n, k))
            for rows in (1, 8):
                x = torch.randn(rows, k)

                def matmul(ext: Any) -> Callable[[int], Any]:
                    return lambda call: ext.q4q8_matmul(x, packed, dm)
                calls = args.calls if n < 10_000 else max(1, args.calls // 10)
                compare(f"q4q8 {n}x{k} ({bits}-bit), {rows} row(s)", matmul(old), matmul(new), args.rounds, calls)


if __name__ == "__main__":
    main()
