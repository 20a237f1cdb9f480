"""benchmarks/ncu_step.py's summary: Nsight Compute's CSV pages into one row a kernel name."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from benchmark_module import load

HEAD = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
        "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit",
        "Metric Value"]  # fmt: skip
STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"


def _pages(tmp: Path, calls: list[tuple[str, float, float, dict[str, float]]]) -> tuple:
    """Two CSV pages as ncu writes them: (name, µs, SM active cycles of 2,000, stalls) a call."""
    details, raw = tmp / "details.csv", tmp / "raw.csv"
    stalls = sorted({k for *_, s in calls for k in s})
    with details.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(HEAD)
        for i, (name, us, active, _) in enumerate(calls):
            base = [str(i), "1", "python3", "host", name, "1", "7", "(256, 1, 1)", "(160, 1, 1)",
                    "0", "9.0"]  # fmt: skip
            for metric, value in (("Duration", us), ("Elapsed Cycles", 2000),
                                  ("SM Active Cycles", active), ("Grid Size", 160)):  # fmt: skip
                out.writerow([*base, "Section", metric, "", f"{value:,}"])
            out.writerow([*base, "Section", "", "", ""])  # a section's rule line
    with raw.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["ID", "Kernel Name", *(STALL.format(s) for s in stalls)])
        out.writerow(["", "", *("ratio" for _ in stalls)])
        for i, (name, _, _, s) in enumerate(calls):
            out.writerow([str(i), name, *(str(s.get(k, 0)) for k in stalls)])
    return details, raw


def test_summary_averages_each_kernels_calls(tmp_path: Path) -> None:
    ncu = load("ncu_step")
    calls = [
        ("gemv", 10.0, 1200, {"long_scoreboard": 20.0, "wait": 2.0, "barrier": 1.0}),
        ("gdn", 30.0, 1800, {"mio_throttle": 11.0, "long_scoreboard": 9.0}),
        ("gemv", 14.0, 1600, {"long_scoreboard": 30.0, "wait": 4.0, "barrier": 0.0}),
    ]
    rows = {r["kernel"]: r for r in ncu.summary(*_pages(tmp_path, calls))}
    assert rows["gemv"]["calls"] == 2 and rows["gdn"]["calls"] == 1
    assert rows["gemv"]["us"] == pytest.approx(12.0)
    assert rows["gemv"]["sm_active_share"] == pytest.approx(0.7)  # 1,400 of 2,000 cycles
    assert rows["gemv"]["grid"] == 160  # "160", written with ncu's thousands separators
    # the stalls of each kernel's own calls, largest first
    assert list(rows["gemv"]["stalls"].items())[:2] == [("long_scoreboard", 25.0), ("wait", 3.0)]
    assert list(rows["gdn"]["stalls"])[0] == "mio_throttle"
