"""The bf16 tensor-core GEMM of prefill (schedules/matmul.py), checked without a GPU: its index
math (swizzled cp.async tiles, ldmatrix addresses, fragment and accumulator positions, the stage
ring, clamped edge rows) runs in a numpy emulation of the kernel whose ldmatrix and mma.sync
follow the PTX ISA's fragment layouts, and must reproduce A · Bᵀ. The CUDA pipeline's choice
of this kernel is checked in tests/test_matmul_pipeline.py.
"""

from __future__ import annotations

import itertools
import sys

import numpy as np
import pytest
import tvm

from qwen35_tvm.schedules import gemm_layout as gl
from qwen35_tvm.schedules import matmul as mm
from qwen35_tvm.schedules import matmul_config as mc
from qwen35_tvm.schedules import matmul_rule as rule
from qwen35_tvm.schedules import split_k
from qwen35_tvm.schedules.gemm_layout import paired_weight_row
from qwen35_tvm.schedules.matmul_wgmma import SM80_SHARED_BYTES, default_wgmma_config

MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"

# ---- numpy emulation of the kernel --------------------------------------------------------


def _small_m(n: int, k: int):
    small = rule.small_m_config(n, k, default_wgmma_config(n), split_k.MIN_SPLITS)
    assert small is not None
    return small


_LANE = np.arange(32)
_G, _Q = _LANE // 4, _LANE % 4
# PTX ISA, mma.m16n8k16 with .bf16: where each lane's fragment elements sit in the matrices.
_E8, _E4 = np.arange(8), np.arange(4)
_A_ROW = _G[:, None] + 8 * (_E8 // 2 % 2)  # a0..a7: (g | g+8, 2q + {0,1} | +8)
_A_COL = 2 * _Q[:, None] + _E8 % 2 + 8 * (_E8 // 4)
_B_K = 2 * _Q[:, None] + _E4 % 2 + 8 * (_E4 // 2)  # b0..b3: (k 2q+{0,1} | +8, n g)
_B_N = np.broadcast_to(_G[:, None], (32, 4))
_C_ROW = _G[:, None] + 8 * (_E4 // 2)  # c0..c3: (g | g+8, 2q + {0,1})
_C_COL = 2 * _Q[:, None] + _E4 % 2


def _ldmatrix_x4(smem: np.ndarray, addrs: list[int]) -> np.ndarray:
    """Lane 8j + r gives the address of row r of matrix j (8 consecutive b16); lane t receives
    row t // 4, elements 2(t % 4) and 2(t % 4) + 1 of each matrix, matrix j in register j."""
    rows = np.stack([smem[a : a + 8] for a in addrs]).reshape(4, 8, 8)
    pairs = rows[:, _G, :].reshape(4, 32, 4, 2)[:, _LANE, _Q, :]  # [matrix, lane, 2]
    return pairs.transpose(1, 0, 2).reshape(32, 8)


def _mma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
    """c[32, 4] += the 16x8 product of the fragments a[32, 8] (16x16) and b[32, 4] (16x8)."""
    am = np.full((16, 16), np.nan)
    bm = np.full((16, 8), np.nan)
    am[_A_ROW, _A_COL] = a
    bm[_B_K, _B_N] = b
    c += (am @ bm)[_C_ROW, _C_COL]


def _emulate(
    a: np.ndarray, b: np.ndarray, cfg: mc.GemmConfig, swiglu: bool = False, splits: int = 1
) -> np.ndarray:
    """The kernel's data movement, one thread block and warp at a time. With `swiglu`, b is a
    gate_up weight and the result silu(gate) · up [m, n / 2], exact (no bf16 rounding). With
    `splits`, split z's blocks run over split_k.k_range's k tiles and the partials are summed
    before the epilogue (what the reduce kernel does)."""
    (m, k), n = a.shape, b.shape[0]
    bm_, bn_, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages
    chunks, threads = bk // 8, cfg.threads
    warp_m, warp_n = bm_ // cfg.warps_m, bn_ // cfg.warps_n
    mtc, ntc, k_tiles = warp_m // 16, warp_n // 8, k // bk
    n_out = n // 2 if swiglu else n
    out = np.full((m, n_out), np.nan)
    for bx, by in itertools.product(range(-(-m // bm_)), range(-(-n // bn_))):
        total = np.zeros((threads // 32, 32, mtc * ntc * 4))
        for z in range(splits):
            k_first, k_count = split_k.k_range(z, splits, k_tiles)
            tiles = {
                "a": np.full(stages * bm_ * bk, np.nan),
                "b": np.full(stages * bn_ * bk, np.nan),
            }
            acc = np.zeros((threads // 32, 32, mtc * ntc * 4))

            def load(stage: int, kt: int, bx: int = bx, by: int = by, tiles: dict = tiles) -> None:
                for name, src, rows, first in (("a", a, bm_, bx * bm_), ("b", b, bn_, by * bn_)):
                    for it in range(rows * chunks // threads):
                        for tid in range(threads):
                            row, chunk = gl.copy_coords(it * threads + tid, chunks)
                            dst = stage * rows * bk + gl.tile_offset(row, chunk, chunks)
                            col = kt * bk + chunk * 8
                            at = first + row
                            if name == "b" and swiglu:
                                at = paired_weight_row(row, warp_n, by * bn_ // 2, n // 2)
                            tiles[name][dst : dst + 8] = src[min(at, len(src) - 1)][col : col + 8]

            for s in range(stages - 1):
                if s < k_count:
                    load(s, k_first + s)

            def frags(w: int, stage: int, kk: int, tiles: dict = tiles) -> tuple[list, list]:
                """Warp w's ldmatrix of k16 step kk of a stage, as the tiles hold it now."""
                row_w, col_w = w // cfg.warps_n * warp_m, w % cfg.warps_n * warp_n
                a_frag = []
                for mt in range(mtc):
                    coords = [gl.ldmatrix_a_coords(lane, kk) for lane in range(32)]
                    addrs = [
                        stage * bm_ * bk + gl.tile_offset(row_w + mt * 16 + r, c, chunks)
                        for r, c in coords
                    ]
                    a_frag.append(_ldmatrix_x4(tiles["a"], addrs))
                b_frag = []
                for pair in range(ntc // 2):
                    coords = [gl.ldmatrix_b_coords(lane, kk) for lane in range(32)]
                    addrs = [
                        stage * bn_ * bk + gl.tile_offset(col_w + pair * 16 + r, c, chunks)
                        for r, c in coords
                    ]
                    regs = _ldmatrix_x4(tiles["b"], addrs)
                    b_frag += [regs[:, :4], regs[:, 4:]]
                return a_frag, b_frag

            def mma(w: int, got: tuple[list, list], acc: np.ndarray = acc) -> None:
                for mt in range(mtc):
                    for nt in range(ntc):
                        at = (mt * ntc + nt) * 4
                        _mma(got[0][mt], got[1][nt], acc[w, :, at : at + 4])

            warps, ksteps = range(threads // 32), bk // 16
            if cfg.frag_pipeline:
                # the kernel's order: next step's fragments, then (kk 0) the copy, then mma
                cur = [frags(w, 0, 0) for w in warps]
                for kt in range(k_count):
                    stage = kt % stages
                    for kk in range(ksteps):
                        nxt = None
                        if kk < ksteps - 1:
                            nxt = [frags(w, stage, kk + 1) for w in warps]
                        elif kt + 1 < k_count:
                            nxt = [frags(w, (kt + 1) % stages, 0) for w in warps]
                        if kk == 0 and kt + stages - 1 < k_count:
                            load((kt + stages - 1) % stages, k_first + kt + stages - 1)
                        for w in warps:
                            mma(w, cur[w])
                        cur = nxt
            else:
                for kt in range(k_count):
                    if kt + stages - 1 < k_count:
                        load((kt + stages - 1) % stages, k_first + kt + stages - 1)
                    for w in warps:
                        for kk in range(ksteps):
                            mma(w, frags(w, kt % stages, kk))
            total += acc
        # a SwiGLU's lane holds gate in n8 tile nt and up in nt + ntc / 2
        half = 2 if swiglu else 1
        for w in range(threads // 32):
            row_w, col_w = w // cfg.warps_n * warp_m, w % cfg.warps_n * warp_n
            for lane in range(32):
                for mt in range(mtc):
                    for nt in range(ntc // half):
                        for e in range(4):
                            er, ec = gl.acc_coords(lane, e)
                            r = bx * bm_ + row_w + mt * 16 + er
                            c = (by * bn_ + col_w) // half + nt * 8 + ec
                            got = total[w, lane, (mt * ntc + nt) * 4 + e]
                            if swiglu:
                                up = total[w, lane, (mt * ntc + nt + ntc // 2) * 4 + e]
                                got = _silu(got) * up
                            if r < m and c < n_out:
                                out[r, c] = got
    return out


def _silu(x):
    return x / (1 + np.exp(-x))


@pytest.mark.parametrize(
    "cfg, m, n, k",
    [
        (mc.DEFAULT_CONFIG, 1, 136, 64),  # one k tile: fewer tiles than prologue stages
        (mc.GemmConfig(), 1, 136, 32),  # the same, 32 deep
        (mc.DEFAULT_CONFIG, 130, 200, 320),  # m and n off the tile, k through the ring twice
        (mc.default_config(200), 130, 200, 320),  # the narrow-n default: 128 x 64 tiles
        (mc.GemmConfig(), 130, 200, 160),
        (mc.GemmConfig(block_k=64), 70, 128, 256),
        (mc.GemmConfig(block_m=64, block_k=64, stages=4), 65, 72, 320),
        (mc.GemmConfig(block_n=256, warps_n=4, stages=4), 17, 264, 96),
        # the sweep's shapes (benchmarks/gemm_kernel.py): 8 warps of 64x32, small-N tiles
        (mc.GemmConfig(warps_n=4, block_k=64), 131, 136, 192),
        (mc.GemmConfig(block_n=64, stages=4), 129, 72, 224),
        (mc.GemmConfig(block_m=64, stages=4), 63, 136, 96),
        (mc.GemmConfig(block_m=256, warps_m=4, stages=4), 257, 128, 160),
        # frag_pipeline: one k tile, two (< stages - 1), and through the ring
        (mc.GemmConfig(frag_pipeline=True), 5, 136, 32),
        (mc.GemmConfig(frag_pipeline=True, stages=4), 33, 128, 64),
        (mc.GemmConfig(frag_pipeline=True), 130, 200, 160),
        (mc.GemmConfig(frag_pipeline=True, block_k=64, warps_n=4), 129, 136, 384),
        (mc.GemmConfig(frag_pipeline=True, block_n=64, stages=2), 64, 72, 128),
        # the 8-warp tilings sharing the sm_90a path's launch (160: 4 x 2 warps of 32 x 80)
        (rule.shared_launch_config(default_wgmma_config(2560)), 130, 330, 192),
        (rule.shared_launch_config(default_wgmma_config(12352)), 129, 200, 128),
        (rule.shared_launch_config(default_wgmma_config(4096)), 1, 136, 64),
        # one m tile's tilings (small_m_config): 96 columns in 4 x 2 warps of 32 x 48
        (rule.shared_launch_config(_small_m(12352, 2560)), 128, 200, 256),
        (rule.shared_launch_config(_small_m(12352, 2560)), 1, 96, 64),
        # 0.8B's in_proj: 64 columns in 2 x 4 warps of 64 x 16
        (rule.shared_launch_config(_small_m(8224, 1024)), 100, 136, 128),
    ],
)
def test_emulated_kernel_computes_a_times_b_transposed(cfg, m, n, k) -> None:
    rng = np.random.default_rng(m * n + k)
    # small multiples of 1/8: every product and sum is exact, in bf16 and in fp32
    a = rng.integers(-8, 9, (m, k)) / 8
    b = rng.integers(-8, 9, (n, k)) / 8
    np.testing.assert_array_equal(_emulate(a, b, cfg), a @ b.T)


@pytest.mark.parametrize(
    "cfg, m, inter, k",
    [
        (rule.shared_launch_config(default_wgmma_config(18432)), 130, 200, 128),  # 2 x 4 warps
        (rule.shared_launch_config(default_wgmma_config(2560)), 1, 96, 64),  # 4 x 2 warps
        (rule.shared_launch_config(_small_m(12352, 2560)), 77, 100, 128),  # 4 x 2 of 32 x 48
        (rule.shared_launch_config(_small_m(18432, 2560)), 128, 90, 64),  # 4 x 2 of 32 x 80
        (rule.shared_launch_config(_small_m(7168, 1024)), 65, 72, 128),  # 2 x 4 of 64 x 16
        (mc.DEFAULT_CONFIG, 129, 72, 192),  # 4 warps of 64 x 64
        (mc.GemmConfig(block_n=64, stages=4), 17, 40, 96),
    ],
)
def test_emulated_swiglu_epilogue_pairs_gate_and_up(cfg, m, inter, k) -> None:
    """gemm_kernel's `swiglu`: each B tile holds its columns' gate and up rows, and a lane
    holds both halves of a column; inter not a multiple of the tile's columns."""
    rng = np.random.default_rng(m + inter)
    a = rng.integers(-8, 9, (m, k)) / 8
    b = rng.integers(-8, 9, (2 * inter, k)) / 8
    gate, up = a @ b[:inter].T, a @ b[inter:].T
    np.testing.assert_allclose(_emulate(a, b, cfg, swiglu=True), _silu(gate) * up, rtol=1e-12)


@pytest.mark.parametrize("splits, k", [(2, 64 * 4), (3, 64 * 7), (8, 64 * 9)])
def test_emulated_split_k_on_the_shared_launch(splits, k) -> None:
    """The mma.sync tiling that shares the sm_90a launch, each split over its k run (runs of
    one tile: shorter than the ring's prologue), summed; plain and with a SwiGLU."""
    cfg = rule.shared_launch_config(default_wgmma_config(2560))
    rng = np.random.default_rng(splits + k)
    a = rng.integers(-8, 9, (65, k)) / 8
    b = rng.integers(-8, 9, (330, k)) / 8
    np.testing.assert_array_equal(_emulate(a, b, cfg, splits=splits), a @ b.T)
    gate, up = a @ b[:165].T, a @ b[165:].T
    got = _emulate(a, b, cfg, swiglu=True, splits=splits)
    np.testing.assert_allclose(got, _silu(gate) * up, rtol=1e-12)


def test_swiglu_rows_swapped_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation check: gate and up rows swapped in the tile."""
    real = paired_weight_row
    monkeypatch.setattr(
        sys.modules[__name__],
        "paired_weight_row",
        lambda row, group, first, inter: real(row + group // 2, group, first, inter),
    )
    rng = np.random.default_rng(1)
    a, b = rng.integers(-8, 9, (33, 64)) / 8, rng.integers(-8, 9, (2 * 96, 64)) / 8
    got = _emulate(a, b, mc.DEFAULT_CONFIG, swiglu=True)
    assert not np.allclose(got, _silu(a @ b[:96].T) * (a @ b[96:].T))


def test_swizzle_is_a_permutation_and_conflict_free() -> None:
    for chunks in (4, 8):
        offsets = [gl.tile_offset(r, c, chunks) for r in range(32) for c in range(chunks)]
        assert sorted(offsets) == list(range(0, 32 * chunks * 8, 8))
        for kk in range(chunks // 2):
            for base in (0, 8, 16):
                # ldmatrix: each 8-lane phase reads 8 rows; their 16-byte chunks must fall in
                # 8 different 16-byte bank groups of the 128-byte bank window
                for phase in range(4):
                    groups = set()
                    for lane in range(8 * phase, 8 * phase + 8):
                        r, c = gl.ldmatrix_a_coords(lane, kk)
                        groups.add(gl.tile_offset(base + r, c, chunks) // 8 % 8)
                    assert len(groups) == 8


def test_pair_store_lanes_own_adjacent_even_columns() -> None:
    # the bf16x2 epilogue stores acc elements 2 eh and 2 eh + 1 of a lane at (r, c), (r, c + 1)
    for lane in range(32):
        for eh in range(2):
            r, c = gl.acc_coords(lane, 2 * eh)
            assert c % 2 == 0 and gl.acc_coords(lane, 2 * eh + 1) == (r, c + 1)


@pytest.mark.parametrize("n, pair", [(200, True), (136, True), (201, False)])
def test_pair_store_only_where_n_is_even(n, pair) -> None:
    cfg = mc.GemmConfig(pair_store=True)
    func = mm.gemm_kernel(n, 64, cfg, out_dtype="bfloat16", epilogue=_cast_bf16)
    text = tvm.tirx.transform.VectorizeLoop()(tvm.IRModule({"main": func}))["main"].script()
    stores = [line.strip() for line in text.splitlines() if line.strip().startswith("out[")]
    guards = [line.strip() for line in text.splitlines() if line.strip().startswith("if r <")]
    assert len(stores) == 1 and len(guards) == 1
    if pair:  # one bf16x2 store a column pair, guarded by the row and the pair's first column
        assert stores[0].startswith("out[r, c:c + 2] =") and "bfloat16x2" in stores[0]
        assert guards[0] == f"if r < m and c < {n}:"
    else:  # n odd: a pair may straddle n, so scalar stores, each column guarded
        assert stores[0].startswith("out[r, c + v] =")
        assert guards[0] == f"if r < m and c + v < {n}:"


def _cast_bf16(acc, _row, _col, _extras):
    return tvm.tirx.Cast("bfloat16", acc)


# ---- the launch an m of one tile takes (matmul_rule.small_m_config) ----------------------


@pytest.mark.parametrize(
    "n, k, width",
    [
        (12352, 2560, 96),  # 4B in_proj: 65 tiles of 192 -> 129 of 96
        (10240, 2560, 96),  # 4B qkv: 64 of 160 -> 107 of 96
        (18432, 2560, 160),  # 4B gate_up: 96 of 192 -> 116 of 160
        (12352, 4096, 96),  # 9B in_proj
        (8224, 1024, 64),  # 0.8B in_proj: 43 tiles of 192 -> 129 of 64
        (7168, 1024, 64),  # 0.8B gate_up
        (24576, 4096, None),  # 9B gate_up: 128 tiles of 192 already
        (2560, 4096, None),  # 4B out_proj: 16 tiles, split k instead
        (2560, 9216, None),  # 4B down
        (4096, 12288, None),  # 9B down
    ],
)
def test_one_m_tile_gets_a_tiling_that_fills_the_sms(n, k, width) -> None:
    wide = default_wgmma_config(n)
    small = rule.small_m_config(n, k, wide, split_k.MIN_SPLITS)
    assert (small and small.block_n) == width
    if small is not None:
        tiles = -(-n // small.block_n)
        assert -(-n // wide.block_n) < 3 * split_k.SMS // 4 <= tiles <= split_k.SMS
        assert small.tma == wide.tma and not small.ctas
        small.check()
        sm80 = rule.shared_launch_config(small)
        sm80.check()
        assert max(sm80.shared_bytes, small.shared_bytes) <= SM80_SHARED_BYTES


def _grid_columns_by_branch(func) -> dict[str, list[int]]:
    """blockIdx.y extents of the kernel's launches, under its host branch on m (the lines of
    its script at the body's top indent: `if m <= 128:` and `else:`)."""
    by: dict[str, list[int]] = {}
    branch = "always"
    for line in func.script().splitlines():
        if line.startswith("    if m <= "):
            branch = line.strip()
        elif line.startswith("    else:"):
            branch = "else"
        if 'thread="blockIdx.y"' in line:
            by.setdefault(branch, []).append(int(line.split("T.thread_binding(")[1].split(",")[0]))
    return by


@pytest.mark.parametrize("swiglu", [False, True])
def test_one_m_tile_launches_its_tiling_chosen_on_the_host(swiglu) -> None:
    """in_proj's (gate_up's) kernel: up to 128 rows (one m tile) the 96 (160)-column tiles,
    beyond it the default's 192; a shape that splits k at one m tile keeps one tiling."""
    n, k = (18432, 2560) if swiglu else (12352, 2560)
    wide, small = default_wgmma_config(n), _small_m(n, k)
    func = mm.gemm_kernel(
        n, k, rule.shared_launch_config(wide), out_dtype="bfloat16", epilogue=_cast_bf16,
        wgmma=wide, swiglu=swiglu,
        small_m=(rule.shared_launch_config(small), small),
    )  # fmt: skip
    assert _grid_columns_by_branch(func) == {
        f"if m <= {mm.BLOCK_M}:": [-(-n // small.block_n)],
        "else": [-(-n // wide.block_n)],
    }
    down = default_wgmma_config(2560)
    func = mm.gemm_kernel(
        2560, 9216, rule.shared_launch_config(down), out_dtype="bfloat16",
        epilogue=_cast_bf16, wgmma=down,
    )  # fmt: skip
    assert "    if m <= " not in func.script()  # its one-tile m splits k instead
