"""The grid barrier and its probe (schedules/grid_barrier.py): the probe's phases against numpy
on the CPU (one phase a loop nest there), and the CUDA the GPU form prints: each block
publishes, arrives, then polls for every block of the phase; its next phase's first loads go
before the wait; the last block out zeroes the words. The GPU runs both forms, checked exactly
against torch, in benchmarks/grid_chain.py."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from qwen35_tvm.schedules import grid_barrier
from qwen35_tvm.schedules.grid_barrier import THREADS, VEC, WORDS, streaming_phases


def _want(data: np.ndarray) -> np.ndarray:
    phases, blocks = data.shape[:2]
    out = np.zeros((phases, blocks), np.int64)
    for p in range(phases):
        out[p] = data[p].reshape(blocks, -1).sum(1) + (np.roll(out[p - 1], -1) if p else 0)
    return out.astype(np.int32)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(
    "phases,blocks,per_thread,ahead", [(1, 1, 1, 0), (3, 5, 6, 2), (4, 3, 2, 8), (2, 7, 3, 3)]
)
def test_the_probe_sums_each_phase_onto_the_last(fused, phases, blocks, per_thread, ahead):
    rng = np.random.default_rng(phases * 10 + blocks)
    data = rng.integers(0, 8, size=(phases, blocks, per_thread, THREADS * VEC)).astype(np.int32)
    lib = tvm.compile(streaming_phases(phases, blocks, per_thread, False, fused, ahead), "llvm")
    out = tvm.runtime.tensor(np.full((phases, blocks), -7, np.int32))
    d = tvm.runtime.tensor(data)
    if fused:
        lib(d, out, tvm.runtime.tensor(np.zeros(WORDS, np.int32)))
    else:
        for p in range(phases):
            lib(p, d, out)
    np.testing.assert_array_equal(out.numpy(), _want(data))


def test_bad_probe_shapes_are_refused():
    with pytest.raises(ValueError, match="phases 0"):
        streaming_phases(0, 4, 1, False, True)


def _cuda(fused: bool, ahead: int = 2) -> str:
    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen
    from qwen35_tvm.compile.pipeline import tir_pipeline
    from qwen35_tvm.compile.targets import make_target

    target, arches = make_target("cuda", "sm_90")
    prepare_cuda_codegen(arches)
    func = streaming_phases(3, 6, 4, True, fused, ahead).with_attr("global_symbol", "probe")
    lib = tvm.compile(tvm.IRModule({"probe": func}), target=target,
                      tir_pipeline=tir_pipeline(target))  # fmt: skip
    source = next(m for m in lib.mod.imports if m.kind == "cuda").inspect_source()
    return source[source.rindex('extern "C" __global__') :]


def _barrier_order(source: str) -> list[str]:
    """The fused kernel's synchronising statements and next-phase loads, in order."""
    marks = {
        "fence": "thread_fence()",
        "arrive": "atomic_add((&(words_ptr[0])), 1)",
        "wait": "wait_until_relaxed_gpu_global_s32(seen_ptr[0], (&(words_ptr[0]))",
        "exit": "atomic_add((&(words_ptr[1])), 1)",
        "reset": "words_ptr[0] = 0;",
        "next loads": "if (p < 2)",
    }
    found = []
    for line in source.splitlines():
        found += [name for name, text in marks.items() if text in line]
    return found


def test_each_block_publishes_arrives_then_waits_for_the_whole_phase():
    source = _cuda(fused=True)
    assert _barrier_order(source) == ["next loads", "fence", "arrive", "wait", "exit", "reset"]
    # the wait's target: every block of this phase, (p + 1) x 6
    assert re.search(r"\(\(p \* 6\) \+ 6\) <= seen_ptr\[0\]", source)
    assert "seen_ptr[0] == 5" in source  # the last of 6 blocks out zeroes the words


def test_a_barrier_without_its_fence_fails_the_order_check(monkeypatch):
    """Teeth: a barrier that arrives without publishing the block's writes first."""

    @T.macro
    def unfenced(words, seen, tx, target):
        T.tvm_storage_sync("shared")
        if tx == 0:
            T.evaluate(T.cuda.atomic_add(T.address_of(words[0]), 1))
            T.evaluate(T.cuda.wait_until(seen, T.address_of(words[0]), lambda v: v >= target))
        T.tvm_storage_sync("shared")

    monkeypatch.setattr(grid_barrier, "grid_barrier", unfenced)
    order = _barrier_order(_cuda(fused=True))
    assert order != ["next loads", "fence", "arrive", "wait", "exit", "reset"]


def test_the_chain_form_loads_its_first_vectors_before_it_waits():
    source = _cuda(fused=False, ahead=2)
    wait = source.index("griddepcontrol_wait()")
    first_load = source.index("(data_ptr + ")
    assert first_load < wait
    assert "words_ptr" not in source
