"""benchmarks/gpu_parity.py's bf16 verdict, on the rows the device runs committed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_module import load

RESULTS = Path(__file__).parents[1] / "docs" / "results"
BROKEN = "gpu_parity_4b_bf16_sm80ptx_broken_h100_s38.json"  # session 38's miscompiled sm_80 PTX


def _bf16_rows(name: str) -> list[dict]:
    data = json.loads((RESULTS / name).read_text())
    rows = data if isinstance(data, list) else [data]
    return [r for r in rows if "hf_bf16_vs_hf_fp32" in r]


def _row(ours: tuple[float, float], hf: tuple[float, float]) -> dict:
    return {
        "ours_vs_hf_fp32": dict(zip(("mean", "p99"), ours, strict=True)),
        "hf_bf16_vs_hf_fp32": dict(zip(("mean", "p99"), hf, strict=True)),
    }


def test_correct_builds_pass_and_the_broken_one_fails():
    parity = load("gpu_parity")
    good = ("gpu_parity_08b_bf16_s26.json", "gpu_parity_4b_bf16_sm90_h100_s38.json",
            "gpu_parity_4b_bf16_sm80ptx_h100_s38.json")  # fmt: skip
    for name in good:
        assert all(parity.bf16_pass(r) for r in _bf16_rows(name)), name
    assert not any(parity.bf16_pass(r) for r in _bf16_rows(BROKEN))


@pytest.mark.parametrize("stat", [0, 1])
def test_either_statistic_past_the_slack_fails(stat):
    parity = load("gpu_parity")
    ours = [0.02, 0.07]
    assert parity.bf16_pass(_row(tuple(ours), (0.02, 0.07)))
    ours[stat] *= parity.BF16_SLACK * 1.01
    assert not parity.bf16_pass(_row(tuple(ours), (0.02, 0.07)))


def test_the_slack_binds_on_real_rows(monkeypatch):
    # mutation: a slack below the correct builds' ratios (up to 0.98 mean / 1.00 p99) fails them
    parity = load("gpu_parity")
    monkeypatch.setattr(parity, "BF16_SLACK", 0.95)
    assert not all(parity.bf16_pass(r) for r in _bf16_rows("gpu_parity_4b_bf16_sm90_h100_s38.json"))
