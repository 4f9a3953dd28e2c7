"""How fast the q4q8 kernels multiply as the rows grow (random weights, two threads by default):
the VNNI kernel and, where this CPU has AMX tiles, the AMX one, side by side, alternating rounds.

    .venv/bin/python scripts/bench_q4q8_matmul.py

At 1 row a decode step's matmuls read weights from DRAM; at 8 rows they are the VNNI kernel's
compute (``vpdpbusd`` a second is printed). The AMX kernel gives the same bits; the ratio column
(AMX / VNNI, below 1 is faster) is what ``amx_min_rows`` in ``csrc/q4q8_amx.h`` is set from.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from loopstack.engine.model import extension, quant


def timed(extension_module: object, x: torch.Tensor, packed: torch.Tensor, dm: torch.Tensor, calls: int) -> float:
    matmul = extension_module.q4q8_matmul  # type: ignore[attr-defined]
    for _ in range(5):
        matmul(x, packed, dm)
    started = time.perf_counter()
    for _ in range(calls):
        matmul(x, packed, dm)
    return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,12,16", help="input row counts to time, comma-separated")
    args = parser.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    kernels = extension.load_extension()
    if kernels is None or not extension.has_q4q8():
        raise SystemExit("the q4q8 kernel is not available here (no AVX-512 VNNI, or the build failed)")
    has_amx = bool(kernels.q4q8_use_amx(True))
    print(f"AMX tiles: {'yes' if has_amx else 'no (VNNI only)'}")
    # SmolLM2-135M's gate_up, down and qkv projections (4-bit), its output head (8-bit)
    for bits, n, k in ((4, 3072, 576), (4, 576, 1536), (4, 960, 576), (8, 49152, 576)):
        packed, dm = quant.pack_q4(torch.randn(n, k)) if bits == 4 else quant.pack_q8(torch.randn(n, k))
        calls = 20 if n > 10_000 else 200
        for m in row_counts:
            x = torch.randn(m, k)
            seconds: dict[bool, list[float]] = {False: [], True: []}
            for index in range(5 if has_amx else 1):
                for amx in ((False, True) if index % 2 == 0 else (True, False)) if has_amx else (False,):
                    kernels.q4q8_use_amx(amx)
                    seconds[amx].append(timed(kernels, x, packed, dm, calls))
            vnni = statistics.median(seconds[False])
            instructions = m * n / 16 * k / 4 * 2  # two digits: 16 rows and 4 inputs an instruction
            line = f"{bits}-bit {n}x{k}, {m:2d} row(s): VNNI {vnni * 1e6:8.1f} us ({instructions / vnni / 1e9:5.2f} G vpdpbusd/s)"
            if has_amx:
                amx_time = statistics.median(seconds[True])
                line += f"  AMX {amx_time * 1e6:8.1f} us  ratio {amx_time / vnni:.2f}"
            print(line, flush=True)
    kernels.q4q8_use_amx(True)


if __name__ == "__main__":
    main()
