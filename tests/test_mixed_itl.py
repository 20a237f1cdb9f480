"""benchmarks/mixed_itl.py: the closed loop replaces each request that ends until all have run,
and every token after a request's first is one gap, labelled with the step that made it."""

from __future__ import annotations

import numpy as np
from benchmark_module import load

from qwen35_tvm.runtime.artifact import Artifact
from qwen35_tvm.runtime.engine import Engine

mixed_itl = load("mixed_itl")


def test_closed_loop_counts_every_gap(tiny_random_artifact):
    engine = Engine(Artifact(tiny_random_artifact), max_batch_size=3, max_total_tokens=512,
                    prefill_chunk=16, mixed_step_share=0.7)  # fmt: skip
    loop = mixed_itl.closed_loop(engine, np.random.default_rng(0), 3, 5, 20, 6)
    assert len(loop["ttft_ms"]) == 5  # two requests joined as others ended
    assert len(loop["gaps"]) == 5 * (6 - 1)
    assert {k for _, _, k, _ in loop["gaps"]} <= {"decode", "mixed", "prefill"}
    # a later request's prompt (20 tokens, chunks of 16) shared steps with running decodes
    assert any(k == "mixed" for _, _, k, _ in loop["gaps"])
    assert not engine.has_work()


def test_summary_names_the_steps_behind_the_tail():
    gaps = [(0, 1.0, "decode", 0)] * 980 + [(1, 3.0, "mixed", 112)] * 20
    s = mixed_itl.summarise({"gaps": gaps, "steps": {}, "ttft_ms": [5.0, 7.0]})
    assert s["itl_ms_p50"] == 1.0 and s["p99_tail_from"] == {"mixed:112": 20}
    assert s["by_step_kind"]["mixed"]["itl_ms_mean"] == 3.0
    assert s["p99_over_p50"] == 3.0
