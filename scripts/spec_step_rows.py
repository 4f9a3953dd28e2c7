"""What real speculating steps cost by their rows, beside the curves that price them.

Runs the spec bench's agent-shaped requests (``../shared/data``) one at a time with the ``suffix``
and ``ngram`` proposers, times every decode step, and bins it by the rows it computed (1 + the
draft it verified). Prints each bin's median over the plain step's median, next to the built-in
curve and to this machine's as ``[engine] step_cost = "measure"`` finds it (measured now on a
private engine, not read from the store): the check that the probe prices what the workload
pays.

    .venv/bin/python scripts/spec_step_rows.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[1].parent / "shared" / "data")
    args = parser.parse_args()

    from loopstack.bench.workload import BenchOptions
    from loopstack.engine.sampling_params import SamplingParams
    from loopstack.engine.step_cost import DEFAULT_STEP_COST
    from loopstack.engine.step_cost_probe import measure_step_cost
    from loopstack.plugins.spec_decode.bench.workload import SpecWorkload

    workload = SpecWorkload()
    options = BenchOptions(data_dir=args.data, extra={"groups": "agent_b1", "step_cost": "default"})
    asyncio.run(workload.setup(["off", "ngram", "suffix"], [], options))
    engine = workload._engine
    params = SamplingParams(temperature=0.0, max_tokens=workload._settings["max_tokens"])
    steps: dict[int, list[float]] = collections.defaultdict(list)
    for _ in range(args.rounds):
        for column in ("suffix", "ngram"):
            workload._fresh_proposers()
            for prompt in workload._groups["agent_b1"]:
                engine.block_manager.reset_prefix_cache()
                seq = engine.add_request(f"rows-{time.monotonic_ns()}", prompt, params,
                                         speculation=workload._specs[column])
                while not seq.is_finished:
                    decoding = seq.first_token_time is not None
                    proposed = engine.speculator.statistics.num_proposed
                    started = time.perf_counter()
                    engine.step()
                    if decoding:
                        rows = 1 + engine.speculator.statistics.num_proposed - proposed
                        steps[rows].append(time.perf_counter() - started)
    measured = measure_step_cost(engine).curve
    plain = statistics.median(steps[1])
    print(f"plain step {plain * 1e3:.2f} ms ({len(steps[1])} steps)")
    print("rows  steps  real  measured  built-in")
    for rows in sorted(steps):
        if rows > 1 and len(steps[rows]) >= 5:
            real = statistics.median(steps[rows]) / plain
            print(f"{rows:4d}  {len(steps[rows]):5d}  {real:4.2f}  {measured.time(rows):8.2f}  "
                  f"{DEFAULT_STEP_COST.time(rows):8.2f}")


if __name__ == "__main__":
    main()
