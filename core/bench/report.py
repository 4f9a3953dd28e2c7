"""Print a bench result as a table, and draw it as a PNG when matplotlib is there."""

from __future__ import annotations

from pathlib import Path

from loopstack.bench.runner import BenchResult


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0 or 0.001 <= abs(value) < 1e6:
        return f"{value:.4g}"
    return f"{value:.3e}"


def format_table(result: BenchResult) -> str:
    """A fixed-width table: metric, one column per stack/backend, then the ratio."""
    ratio_head = f"ratio {result.columns[-1]}/{result.columns[0]}" if len(result.columns) > 1 else "ratio"
    if result.pair_ratios:  # the workload's own pairs replace the default last-over-first
        header = ["metric", *result.columns, *result.pair_ratios]
    else:
        header = ["metric", *result.columns, ratio_head]
    rows = [header]
    for metric, per_column in result.metrics.items():
        figures = [_fmt(per_column.get(c)) for c in result.columns]
        if result.pair_ratios:
            rows.append([metric, *figures, *(_fmt(r.get(metric)) for r in result.pair_ratios.values())])
        else:
            rows.append([metric, *figures, _fmt(result.ratios.get(metric))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return f"workload: {result.workload}\n" + "\n".join(lines)


def write_plot(result: BenchResult, path: Path) -> Path | None:
    """Bar chart of every metric relative to the first column. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    metrics = [m for m in result.metrics if result.metrics[m].get(result.columns[0])]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(metrics) + 3), 4))
    width = 0.8 / max(1, len(result.columns))
    for i, column in enumerate(result.columns):
        values = [result.metrics[m].get(column, 0) / result.metrics[m][result.columns[0]] for m in metrics]
        ax.bar([x + i * width for x in range(len(metrics))], values, width, label=column)
    ax.set_xticks([x + width * (len(result.columns) - 1) / 2 for x in range(len(metrics))])
    ax.set_xticklabels(metrics, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"relative to {result.columns[0]}")
    ax.set_title(f"loopstack bench {result.workload}")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
