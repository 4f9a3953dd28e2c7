"""Azure's LLM inference trace (code), scaled to the embedded model and this machine.

``../shared/data/traces/AzureLLMInferenceTrace_code.csv`` (Azure/AzurePublicDataset, CC-BY-4.0;
Patel et al., Splitwise, ISCA 2024): one row per request with its arrival time, prompt tokens and
generated tokens. The bench keeps the trace's shape — bursts of arrivals, long prompts, short
outputs — and scales it: arrivals spread ``time_scale`` times, prompt lengths divided by
``token_scale`` (clamped to what a 2-core CPU prefills in about a second), outputs clamped.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

__all__ = ["AZURE_CODE_TRACE", "ScaledRequest", "load_scaled_trace"]

AZURE_CODE_TRACE = Path("traces") / "AzureLLMInferenceTrace_code.csv"


@dataclass(frozen=True)
class ScaledRequest:
    arrival_s: float  # from the first request of the window
    prompt_tokens: int
    output_tokens: int


def load_scaled_trace(path: Path, *, start: int = 0, count: int = 24, time_scale: float = 4.0,
                      token_scale: float = 4.0, max_prompt: int = 1200, min_prompt: int = 32,
                      max_output: int = 32, min_output: int = 4, max_gap_s: float = 3.0) -> list[ScaledRequest]:
    """``count`` requests of the trace from row ``start``, scaled (see the module docstring); a
    quiet gap between bursts longer than ``max_gap_s`` (scaled) is cut to it."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: the Azure trace is not there (it comes with ../shared/data)")
    rows = []
    with path.open(newline="") as handle:
        for number, row in enumerate(csv.DictReader(handle)):
            if number < start:
                continue
            if len(rows) >= count:
                break
            stamp = datetime.strptime(row["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f")
            rows.append((stamp.timestamp(), int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    if not rows:
        raise ValueError(f"{path}: no rows from {start}")
    out, clock, previous = [], 0.0, rows[0][0]
    for stamp, context, generated in rows:
        clock += min((stamp - previous) * time_scale, max_gap_s)
        previous = stamp
        out.append(ScaledRequest(clock, max(min_prompt, min(max_prompt, round(context / token_scale))),
                                 max(min_output, min(max_output, generated))))
    return out
