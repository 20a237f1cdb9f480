"""Split-K for prefill's GEMM (schedules/matmul.py) where its tiles cannot fill the GPU.

A tile of 128 rows streams its weight columns through one SM, and one SM streams ~45 GB/s. At
m <= 128 the n = 2,560 projections of 4B (down, o_proj, out_proj: 16 tiles of 160 columns) thus
used 16 SMs of 132 and ran at 0.4x cuBLAS (docs/results/gemm_kernel_2cta_experiment.json),
which made small prefills, and the mixed steps that carry a prompt chunk beside decodes,
cost two decode steps whatever their size (docs/results/mixed_step_s15_base.json).

So where four or more splits fit one wave, a second launch's grid gains a z axis: split z of
`splits` computes its tile over k tiles [z k_tiles / splits, (z + 1) k_tiles / splits) and
stores the unrounded fp32 partial into a workspace [splits, m, n]; a second kernel of the same
PrimFunc sums the splits and applies the epilogue (cast, residual add, SwiGLU) once. The count is a
function of m, computed on the host, which picks the launch; a GEMM that never splits keeps the
one launch it had.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .pdl import release_dependents, wait_for_producers

SMS = 132  # the H200's (and H100's) SMs; an A100's 108 take a short second wave
MAX_SPLITS = 8  # 16 tiles (4B's n = 2,560) fill 128 SMs; more adds workspace traffic
MIN_K_TILES = 4  # per split, so the ring has something to pipeline
# two splits cost more than they gain at k <= 4,096 (the reduce kernel and the workspace's
# round trip: docs/results/gemm_kernel_split_first_build.json), so a split GEMM takes four or more
MIN_SPLITS = 4
REDUCE_THREADS = 256


def can_split(n_tiles: int, k_tiles: int, min_splits: int = MIN_SPLITS) -> bool:
    """Whether any m splits a GEMM of `n_tiles` column tiles and `k_tiles` k tiles: a GEMM
    that never does keeps the one kernel it had, its k loop of fixed length. One m tile is
    the most any m leaves idle."""
    return int(split_count(T.int32(1), 1, n_tiles, k_tiles, min_splits)) > 1


def split_count(m, block_m: int, n_tiles: int, k_tiles: int, min_splits: int = MIN_SPLITS):
    """Splits for an m-row GEMM of `n_tiles` column tiles: as many as fill the SMs with one
    wave of CTAs, at most MAX_SPLITS and k_tiles / MIN_K_TILES; 1 (no split) where that is
    under `min_splits`."""
    most = min(MAX_SPLITS, k_tiles // MIN_K_TILES)
    fill = T.min(SMS // (T.ceildiv(m, block_m) * n_tiles), most)
    return T.if_then_else(fill >= min_splits, fill, 1)


def k_range(z, splits, k_tiles: int):
    """(first k tile, k tiles) of split z of `splits`: the splits cover [0, k_tiles) in order,
    in runs that differ by at most one tile. For ints or the kernel's PrimExprs."""
    first = z * k_tiles // splits
    return first, (z + 1) * k_tiles // splits - first


def workspace_elems(splits, m, n: int):
    """fp32 elements of the partials' workspace; one when nothing is split."""
    return T.if_then_else(splits > 1, splits * m * n, 1)


def partial_store(n: int, swiglu: bool):
    """A macro storing one lane's column pair of a split-K partial, acc[at : at + 2] unrounded,
    at ws[z, r, c : c + 2] of a flat fp32 [splits, m, n] workspace; with `swiglu`, the up pair
    (`up_at`) at column n / 2 + c, where the weight has its up rows (reduce_partials sums)."""

    @T.macro
    def store(ws, acc, at, up_at, z, r, c, m, n_out):
        for v in T.unroll(2):
            if r < m and c + v < n_out:
                ws[(z * m + r) * n + c + v] = acc[at + v]
                if swiglu:
                    ws[(z * m + r) * n + n // 2 + c + v] = acc[up_at + v]

    return store


def reduce_partials(n: int, n_out: int, swiglu: bool, store):
    """A macro launching the kernel that sums the splits' partials in `ws` and stores each
    output column pair through `store` (matmul_wgmma.pair_store's macro: the epilogue, and with
    `swiglu` silu(gate) · up of the columns c and n / 2 + c). A thread a column pair."""
    pairs = (n_out + 1) // 2

    @T.macro
    def launch(out, extras, ws, m, splits, pair):
        for bi in T.thread_binding(T.ceildiv(m * pairs, REDUCE_THREADS), thread="blockIdx.x"):
            for t in T.thread_binding(REDUCE_THREADS, thread="threadIdx.x"):
                with T.sblock("split_k_reduce"):
                    T.reads()
                    T.writes()
                    sums = T.alloc_local((4,), "float32")
                    T.evaluate(wait_for_producers(True))  # first: schedules/pdl.py
                    T.evaluate(release_dependents(True))
                    idx: T.let[T.int32] = bi * REDUCE_THREADS + t
                    r: T.let[T.int32] = idx // pairs
                    c: T.let[T.int32] = idx % pairs * 2
                    for v in T.unroll(4):
                        sums[v] = T.float32(0)
                    if r < m:
                        for z in T.serial(splits):
                            row: T.let[T.int32] = (z * m + r) * n
                            for v in T.unroll(2):
                                if c + v < n_out:
                                    sums[v] = sums[v] + ws[row + c + v]
                                    if swiglu:  # the up column, n / 2 on
                                        sums[2 + v] = sums[2 + v] + ws[row + n // 2 + c + v]
                    store(out, extras, sums, 0, 2, r, c, m, n_out, pair)

    return launch
