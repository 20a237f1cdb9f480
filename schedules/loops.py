"""The two loops every kernel family here is written with, so one loop nest serves both
targets: on CUDA they bind blockIdx.x and threadIdx.x; on the CPU the block loop runs in
parallel and a phase's thread loop serially, so the CPU tests run the GPU kernel's indexing."""

from __future__ import annotations

from collections.abc import Callable

from tvm.script import tirx as T


def block_loop(gpu: bool) -> Callable:
    """`grid(n)`: the loop over a kernel's n blocks."""

    def grid(n):
        return T.thread_binding(n, thread="blockIdx.x") if gpu else T.parallel(n)

    return grid


def thread_loop(threads: int, gpu: bool) -> Callable:
    """`lanes()`: one phase's loop over a block's threads."""

    def lanes():
        return T.thread_binding(threads, thread="threadIdx.x") if gpu else T.serial(threads)

    return lanes
