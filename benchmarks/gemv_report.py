"""The tables of benchmarks/gemv_kernel.py: a markdown line per measured row, and a summary per
shape, row class and batch against issue 11's targets."""

from __future__ import annotations

import subprocess

TARGET_PCT = {"small": 90, "wide": 85}  # issue 11's share of the copy bandwidth


def device_name() -> str:
    """The GPU's name, as nvidia-smi gives it."""
    try:
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


PREVIOUS = ("dlight", "mma_wide")  # what each row class ran before our kernel


def _same(a: dict, b: dict) -> bool:
    return all(a.get(f) == b.get(f) for f in ("model", "n", "k", "rows", "batch"))


def _us(rows: list[dict], r: dict, kernels: tuple[str, ...]) -> float:
    """Time of the first of `kernels` measured at r's shape and batch (nan if none)."""
    hit = [t for t in rows if _same(t, r) and t.get("kernel") in kernels and "us" in t]
    return hit[0]["us"] if hit else float("nan")


def table_line(r: dict, rows: list[dict]) -> str:
    """The markdown row of measured (or checked) row r; `rows`: its shape's, for cuBLAS's and
    the previous kernel's times."""
    if r.get("timed") == "check only" and "max_rel_err" in r:
        return (
            f"| {r['model']} | {'/'.join(r['names'])} | {r['n']}x{r['k']} | {r['batch']} | "
            f"{r['kernel']} | check only | | | | {r['max_rel_err']:.1e} | | | |"
        )
    if "error" in r or "us" not in r:
        return (
            f"| {r.get('model')} | {r.get('file', r.get('names'))} | | {r.get('batch')} | "
            f"{r.get('kernel')} | ERROR {str(r.get('error'))[-200:]} |"
        )
    cub, before = _us(rows, r, ("torch",)), _us(rows, r, PREVIOUS)
    return (
        f"| {r['model']} | {'/'.join(r['names'])} | {r['n']}x{r['k']} | {r['batch']} | "
        f"{r['kernel']} | {r['us']:.1f} | {r['wall_us']:.1f} | {r['bytes'] / 1e6:.1f} | "
        f"{r['pct_copy_bw']:.1f}% | {r['max_rel_err']:.1e} | {cub:.1f} | "
        f"x{cub / r['us']:.2f} | x{before / r['us']:.2f} |"
    )


def summarize(rows: list[dict]) -> dict:
    """Per shape, row class and batch: the default kernel's share of copy bandwidth, the best
    config's, cuBLAS's and the previous kernel's; our kernels' largest error where checked
    only."""
    best, lines = [], ["shape, batch: ours (default) / best config / cuBLAS / before, % of copy bw"]
    keys = sorted(
        {(r["rows"], r["model"], r["n"], r["k"], r["batch"]) for r in rows if "max_rel_err" in r}
    )
    for cls, model, n, k, batch in keys:
        here = [r for r in rows if _same(r, {"rows": cls, "model": model, "n": n, "k": k,
                                             "batch": batch}) and "max_rel_err" in r]  # fmt: skip
        mine = [r for r in here if r["kernel"] not in ("torch", *PREVIOUS)]
        if mine and all("us" not in r for r in mine):
            worst = max(mine, key=lambda r: r["max_rel_err"])
            mark = "ok" if worst["max_rel_err"] < 2**-6 else "WRONG"
            lines.append(f"{model} {n}x{k} B={batch} ({cls}, checked): largest error "
                         f"{worst['max_rel_err']:.1e} ({worst['kernel']}) {mark}")  # fmt: skip
            continue
        mine = [r for r in mine if "us" in r and r["max_rel_err"] < 2**-6]
        if not mine:
            continue
        top = max(mine, key=lambda r: r["pct_copy_bw"])
        ours = next((r for r in mine if r["kernel"] == "ours"), None)
        others = {
            name: next((r["pct_copy_bw"] for r in here if r["kernel"] in kinds and "us" in r),
                       None)
            for name, kinds in (("torch", ("torch",)), ("before", PREVIOUS))
        }  # fmt: skip
        best.append(
            {
                "rows": cls,
                "model": model,
                "n": n,
                "k": k,
                "batch": batch,
                "kernel": top["kernel"],
                "config": top["config"],
                "pct_copy_bw": top["pct_copy_bw"],
                "ours_pct_copy_bw": ours and ours["pct_copy_bw"],
                "torch_pct_copy_bw": others["torch"],
                "before_pct_copy_bw": others["before"],
            }
        )
        mark = "ok" if top["pct_copy_bw"] >= TARGET_PCT.get(cls, 90) else "MISS"

        def pct(v):
            return f"{v:.1f}%" if v is not None else "n/a"

        lines.append(
            f"{model} {n}x{k} B={batch}: {pct(ours and ours['pct_copy_bw'])} / {top['kernel']} "
            f"{top['pct_copy_bw']:.1f}% {mark} / cuBLAS {pct(others['torch'])} / before "
            f"{pct(others['before'])}"
        )
    return {"best": best, "lines": lines}
