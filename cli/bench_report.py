"""`qwen35-tvm bench`'s report: the metrics as a table (one column a concurrency level) and as
a PNG of throughput, TTFT and TPOT against concurrency."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


ROWS = [
    ("completed", "completed", "d"),
    ("failed", "failed", "d"),
    ("duration (s)", "duration_s", ".2f"),
    ("request throughput (req/s)", "request_throughput", ".2f"),
    ("output throughput (tok/s)", "output_throughput", ".1f"),
    ("total throughput (tok/s)", "total_token_throughput", ".1f"),
    ("tokens per chunk", "tokens_per_chunk", ".2f"),
] + [
    (f"{name.upper()} {stat} (ms)", f"{stat}_{name}_ms", ".2f")
    for name in ("ttft", "tpot", "itl", "e2e")
    for stat in ("mean", "p50", "p99")
]


def format_table(levels: list[dict[str, Any]]) -> str:
    """Metrics down, one column per concurrency level."""
    head = ["concurrency"] + [str(lv["concurrency"]) for lv in levels]
    lines = [head] + [[label] + [_cell(lv[key], fmt) for lv in levels] for label, key, fmt in ROWS]
    first = max(len(row[0]) for row in lines)
    rest = max(len(cell) for row in lines for cell in row[1:])
    text = [row[0].ljust(first) + "".join(c.rjust(rest + 2) for c in row[1:]) for row in lines]
    text.insert(1, "-" * len(text[0]))
    for lv in levels:
        for message, count in lv["errors"].items():
            text.append(f"concurrency {lv['concurrency']}: {count} x {message}")
    return "\n".join(text)


def plot(levels: list[dict[str, Any]], path: str | Path) -> bool:
    """Throughput and latency against concurrency as a PNG; False when matplotlib is absent."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib); no plot written")
        return False
    xs = [lv["concurrency"] for lv in levels]
    fig = Figure(figsize=(15, 4.5), layout="constrained")
    FigureCanvasAgg(fig)  # Agg without touching pyplot's global backend
    axes = fig.subplots(1, 3)
    panels = [
        ("output throughput (tok/s)", [("output_throughput", "output tok/s")]),
        ("TTFT (ms)", [("p50_ttft_ms", "p50"), ("p99_ttft_ms", "p99")]),
        ("TPOT (ms)", [("p50_tpot_ms", "p50"), ("p99_tpot_ms", "p99")]),
    ]
    for ax, (title, series) in zip(axes, panels, strict=True):
        for key, label in series:
            ys = [math.nan if lv[key] is None else lv[key] for lv in levels]
            ax.plot(xs, ys, marker="o", label=label)
        if len(xs) > 1 and max(xs) >= 4 * min(xs):
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)  # from zero, so small differences do not look large
        ax.set_title(title)
        ax.set_xlabel("concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=100)
    return True
