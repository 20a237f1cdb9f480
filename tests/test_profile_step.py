"""benchmarks/profile_step.py's accounting of a step's kernels, on made-up timelines: what each
kernel adds to the span, and the handover from each kernel to the next."""

from __future__ import annotations

from benchmark_module import load

# two calls of three kernels; g starts beside a (dependent launch), o after g's end
CALLS = [
    [(0.0, 10.0, "a"), (8.0, 20.0, "g"), (21.0, 30.0, "o")],
    [(100.0, 110.0, "a"), (106.0, 124.0, "g"), (123.0, 130.0, "o")],
]


def test_links_time_each_kernel_from_its_producers_end() -> None:
    links = {(r["after"], r["kernel"]): r for r in load("profile_step").kernel_links(CALLS)}
    assert set(links) == {("a", "g"), ("g", "o")}
    ag, go = links[("a", "g")], links[("g", "o")]
    assert ag["count"] == 1 and ag["start_us"] == -3.0 and ag["end_us"] == 12.0
    assert go["count"] == 1 and go["start_us"] == 0.0 and go["end_us"] == 8.0


def test_added_time_sums_to_the_span() -> None:
    added = load("profile_step").added_time(CALLS, 2)
    assert added == {"a": 10.0, "g": 12.0, "o": 8.0}
