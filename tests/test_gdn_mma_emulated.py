"""The tensor-core chunked GDN kernels (schedules/gdn_chunk_prep.py, gdn_chunk_scan.py) without
a GPU.

1. Fragments: every operand the kernel feeds mma (stored [m][k], [k][m], [n][k], [k][n] in
   swizzled bf16 tiles) is loaded lane by lane with the kernel's own index maps, through an
   emulated ldmatrix.x4 (plain and .trans), multiplied with the PTX ISA's m16n8k16 layouts,
   and must equal the matrix product; a wrong map must not.
2. Jobs: each matmul's (m tile, n tiles) jobs cover its output exactly once, on every warp.
3. Algorithm: the two kernels' chunk math in numpy with bf16 rounding exactly where they
   round (operands, the workspace) and fp32 elsewhere, at sequence lengths 1, C-1, C, C+1,
   ragged batches and non-zero states, against the float64 recurrence: within the bf16 bound
   the benchmark uses (1e-2 of the largest value); breaking the blocked solve, or dropping
   W Sᵀ, must exceed it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qwen35_tvm.schedules import gdn_mma_tiles as mma
from qwen35_tvm.schedules.gdn_chunk_prep import prep_shared_bytes
from qwen35_tvm.schedules.gdn_chunk_scan import scan_shared_bytes

_LANES = np.arange(32)
_G, _Q = _LANES // 4, _LANES % 4
_E8, _E4 = np.arange(8), np.arange(4)
# PTX ISA, mma.m16n8k16 .bf16: (row, k) of A's a0..a7, (k, n) of B's b0..b3, (row, n) of C's
_A_ROW, _A_K = _G[:, None] + 8 * (_E8 // 2 % 2), 2 * _Q[:, None] + _E8 % 2 + 8 * (_E8 // 4)
_B_K, _B_N = 2 * _Q[:, None] + _E4 % 2 + 8 * (_E4 // 2), np.broadcast_to(_G[:, None], (32, 4))


def bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def store(tile: np.ndarray) -> np.ndarray:
    """A [rows, width] tile in the kernel's swizzled flat layout."""
    rows, width = tile.shape
    flat = np.full(rows * width, np.nan, np.float32)
    r, c = np.meshgrid(np.arange(rows), np.arange(width), indexing="ij")
    flat[mma.swz(r, c, width)] = tile
    return flat


def ldmatrix_x4(flat: np.ndarray, addr: np.ndarray, trans: bool) -> np.ndarray:
    """[32, 8] registers: matrix q's 8 rows come from lanes 8q..8q+7's addresses; a lane gets
    (row lane // 4, cols 2 (lane % 4) + 0, 1) of each, or with .trans (rows 2 (lane % 4) + 0,
    1, col lane // 4)."""
    out = np.zeros((32, 8), np.float32)
    for q in range(4):
        m = np.stack([flat[addr[8 * q + r] : addr[8 * q + r] + 8] for r in range(8)])
        for t in range(32):
            r = 2 * (t % 4)
            out[t, 2 * q : 2 * q + 2] = m[r : r + 2, t // 4] if trans else m[t // 4, r : r + 2]
    return out


def mma_frags(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The 16 x 8 product of an A fragment [32, 8] and a B fragment [32, 4]."""
    am, bm = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    am[_A_ROW, _A_K] = a
    bm[_B_K, _B_N] = b
    return am @ bm


def warp_product(a_flat, a_w, a_trans, b_flat, b_w, b_trans, m0, n0, k_steps, a_map=None):
    """A [16, 16 k_steps] x B -> [16, 16] (two n8 tiles) at m0 / n0, as the kernel loads it."""
    a_map = a_map or mma.a_lane
    out = np.zeros((16, 16))
    for kk in range(k_steps):
        ar, ac = a_map(_LANES, kk, a_trans)
        ar, ac = (ar, ac + m0) if a_trans else (ar + m0, ac)
        af = ldmatrix_x4(a_flat, mma.swz(ar, ac, a_w), a_trans)
        br, bc = mma.b_lane(_LANES, kk, b_trans)
        br, bc = (br, bc + n0) if b_trans else (br + n0, bc)
        bfr = ldmatrix_x4(b_flat, mma.swz(br, bc, b_w), b_trans)
        for h2 in range(2):
            out[:, 8 * h2 : 8 * h2 + 8] += mma_frags(af, bfr[:, 4 * h2 : 4 * h2 + 4])
    return out


@pytest.mark.parametrize("a_trans", [False, True])
@pytest.mark.parametrize("b_trans", [False, True])
@pytest.mark.parametrize("width", [32, 64, 128])
def test_fragments_give_the_product(a_trans: bool, b_trans: bool, width: int) -> None:
    rng = np.random.default_rng(0)
    a = bf16(rng.normal(size=(width, width)))  # logical [m, k]
    b = bf16(rng.normal(size=(width, width)))  # logical [k, n]
    a_flat, b_flat = store(a.T if a_trans else a), store(b if b_trans else b.T)
    m0, n0 = width - 16, 16 % width
    got = warp_product(a_flat, width, a_trans, b_flat, width, b_trans, m0, n0, width // 16)
    np.testing.assert_allclose(got, a[m0 : m0 + 16] @ b[:, n0 : n0 + 16], rtol=1e-5, atol=1e-4)
    # mutation: lanes 8-15 and 0-7 swap addresses (two 8x8 matrices trade places)
    bad = warp_product(
        a_flat, width, a_trans, b_flat, width, b_trans, m0, n0, width // 16,
        a_map=lambda lane, kk, t: mma.a_lane(lane ^ 8, kk, t),
    )  # fmt: skip
    assert not np.allclose(bad, got, atol=1e-2)


@pytest.mark.parametrize("c, ct, warps", [(32, 64, 8), (64, 32, 8), (32, 32, 4)])
def test_jobs_cover_each_output_once(c: int, ct: int, warps: int) -> None:
    # prep's [K; Q] x Kᵀ; the scan's [W; Q] x Sᵀ and P x U
    for mt, n8 in [(2 * c // 16, c // 8), (2 * c // 16, ct // 8), (c // 16, ct // 8)]:
        ng = mma.n_group(n8, mt, warps)
        jobs = mt * n8 // ng
        seen = np.zeros((mt, n8), int)
        for job in range(jobs):
            m, n0 = mma.job_tile(job, ng, n8)
            seen[m, n0 : n0 + ng] += 1
        assert jobs % warps == 0 and (seen == 1).all()
    assert sum(prep_shared_bytes(c, 128, 128)) <= 163 * 1024  # sm_80 too
    assert sum(scan_shared_bytes(c, ct, 128)) <= 163 * 1024


LAYER = 1


def two_pass_model(x: dict, c: int, mutate: str = "") -> tuple[np.ndarray, np.ndarray]:
    """gdn_chunk_prep then gdn_chunk_scan per (sequence, value head), rounding to bf16 where
    they store or feed mma and fp32 elsewhere. `mutate`: "solve" drops the off-diagonal rows of
    the blocked solve, "state" drops W Sᵀ (U = U0)."""
    f32 = np.float32
    pool = x["pool"].copy()
    n, hv, dv = x["v"].shape
    hk, dk = x["k"].shape[1:]
    out = np.full((n, hv, dv), np.nan, f32)
    low = np.tril(np.ones((c, c), bool), -1)
    for b, slot in enumerate(x["slots"]):
        start, length = x["indptr"][b], x["indptr"][b + 1] - x["indptr"][b]
        for h in range(hv):
            kh = h // (hv // hk)
            st = pool[slot, LAYER, h].astype(f32)  # [dv, dk]
            for t0 in range(start, start + length, c):
                # the first pass: no state
                nv = min(c, start + length - t0)
                rows = t0 + np.minimum(np.arange(c), nv - 1)
                live = np.arange(c) < nv
                k32 = np.where(live[:, None], x["k"][rows, kh], 0).astype(f32)
                kb, qb = bf16(k32), bf16(np.where(live[:, None], x["q"][rows, kh], 0))
                gs = np.cumsum(np.where(live, x["g"][rows, h], 0)).astype(f32)
                bs = np.where(live, x["beta"][rows, h], 0).astype(f32)
                dec = np.exp(np.minimum(gs[:, None] - gs[None, :], 0)).astype(f32)
                am = np.where(low, bs[:, None] * dec * (kb @ kb.T), 0).astype(f32)
                pb = bf16(np.where(low | np.eye(c, dtype=bool), dec * (qb @ kb.T), 0))
                v = np.where(live[:, None], x["v"][rows, h], 0).astype(f32)
                rs = (bs[:, None] * np.concatenate([np.exp(gs)[:, None] * k32, v], 1)).astype(f32)
                xb = np.zeros_like(rs)
                for r0 in range(0, c, 16):
                    if r0 and mutate != "solve":
                        rs[r0 : r0 + 16] -= bf16(am[r0 : r0 + 16, :r0]) @ xb[:r0]
                    uu = rs[r0 : r0 + 16].copy()
                    for j in range(16):
                        uu[j + 1 :] -= am[r0 + j + 1 : r0 + 16, r0 + j, None] * uu[j]
                    xb[r0 : r0 + 16] = bf16(uu)
                w, u0 = xb[:, :dk], xb[:, dk:]
                # the second pass: the state
                sb = bf16(st)
                u = u0 - (0 if mutate == "state" else w @ sb.T)
                ub = bf16(u)
                wub = bf16(np.exp(gs[-1] - gs)[:, None] * u)
                o = (np.exp(gs)[:, None] * (qb @ sb.T) + pb @ ub) * f32(dk**-0.5)
                out[t0 : t0 + nv, h] = o[:nv]
                st = st * np.exp(gs[-1]) + wub.T @ kb
            pool[slot, LAYER, h] = st
    return out, pool


@pytest.mark.parametrize("c", [32, 64])
def test_two_pass_algorithm_matches_reference(c: int) -> None:
    """The prep/scan split (U = U0 - W Sᵀ) at ragged lengths from non-zero states, within the
    bf16 bound; dropping either the solve's off-diagonal rows or W Sᵀ must break it."""
    from test_gdn_kernels import make_inputs, max_rel_err, reference

    lengths = [1, c - 1, c, c + 1, 0, 2 * c + 5]
    x = make_inputs(lengths, [7, 2, 5, 0, 3, 8], 1, 2, 128, 128, seed=4)
    ref_out, ref_pool = reference(x)
    out, pool = two_pass_model(x, c)
    err_out, err_pool = max_rel_err(out, ref_out), max_rel_err(pool, ref_pool)
    print(f"C={c}: two passes, max rel error: outputs {err_out:.2e}, states {err_pool:.2e}")
    assert err_out < 1e-2 and err_pool < 1e-2, (err_out, err_pool)
    for mutate in ("solve", "state"):
        bad_out, bad_pool = two_pass_model(x, c, mutate)
        assert max(max_rel_err(bad_out, ref_out), max_rel_err(bad_pool, ref_pool)) > 1e-2


def scan_model(g: np.ndarray, nv: int, c: int, carry: bool = True) -> np.ndarray:
    """The prep's decay scan (gdn_chunk_ops.decay_scan): 32-token pieces, each an inclusive
    Hillis-Steele scan over the lanes by shuffle-up (a lane below the distance keeps its own
    value and adds nothing), plus the running total of the pieces before (lane 31's)."""
    gs = np.zeros(c, np.float32)
    total = np.float32(0)
    for piece in range(-(-c // 32)):
        j = piece * 32 + _LANES
        x = np.where(j < nv, g[np.minimum(j, nv - 1)], 0).astype(np.float32)
        for s in range(5):
            up = np.concatenate([x[: 1 << s], x[: 32 - (1 << s)]])  # shfl_up: own value below
            x = x + np.where(_LANES >= 1 << s, up, 0).astype(np.float32)
        x = x + (total if carry else 0)
        total = x[31]
        live = j < c
        gs[j[live]] = x[live]
    return gs


@pytest.mark.parametrize("c", [32, 64])
def test_decay_scan_is_the_cumsum(c: int) -> None:
    rng = np.random.default_rng(5)
    g = -rng.random(c).astype(np.float32) * 5
    for nv in sorted({1, 31, 32, 33, c - 1, c}):
        want = np.cumsum(np.where(np.arange(c) < nv, g, 0))
        np.testing.assert_allclose(scan_model(g, nv, c), want, rtol=1e-5, atol=1e-5)
    # mutation: without the pieces' carry the second half of a 64-token chunk is wrong
    if c > 32:
        assert not np.allclose(scan_model(g, c, c, carry=False), np.cumsum(g), atol=1e-3)
