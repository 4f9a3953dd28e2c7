"""How fast the q4q8 kernel multiplies as the rows grow (random Q4_1 weights, two threads by
default): microseconds a call and integer dot-product instructions (``vpdpbusd``) a second.

    .venv/bin/python scripts/bench_q4q8_matmul.py

At 1 row a decode step's matmuls read weights from DRAM; at 8 rows they are the kernel's compute.
"""

from __future__ import annotations

import time

import torch

from loopstack.engine.model import extension, quant


def main() -> None:
    torch.manual_seed(0)
    if not extension.has_q4q8():
        raise SystemExit("the q4q8 kernel is not available here (no AVX-512 VNNI, or the build failed)")
    for n, k in ((3072, 576), (576, 1536)):  # SmolLM2-135M's gate_up and down projections
        packed, dm = quant.pack_q4(torch.randn(n, k))
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k)
            for _ in range(20):
                extension.q4q8_matmul(x, packed, dm)
            started = time.perf_counter()
            for _ in range(500):
                extension.q4q8_matmul(x, packed, dm)
            seconds = (time.perf_counter() - started) / 500
            instructions = m * n / 16 * k / 4 * 2  # two digits: two per 4 inputs, 16 rows and row
            print(f"{n}x{k}, {m} row(s): {seconds * 1e6:7.1f} us, {instructions / seconds / 1e9:.2f} G vpdpbusd/s")


if __name__ == "__main__":
    main()
