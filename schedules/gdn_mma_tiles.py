"""The tile layout of the tensor-core chunked GDN kernels (gdn_chunk_prep, gdn_chunk_scan):
where a value of a swizzled bf16 tile lives, which address each lane gives ldmatrix.x4, where
mma's accumulator elements land, and how a matmul's output splits into warp jobs. Plain
functions, so the numpy emulation in tests/test_gdn_mma_emulated.py runs the very same index
maps."""

from __future__ import annotations

WARPS = 8


def swz(row, col, width: int):
    """Element offset of (row, col) in a bf16 tile of rows `width` long: 16-byte chunks XORed
    with row % 8 (fewer for narrow rows), so that ldmatrix's 8 rows hit 8 bank groups."""
    chunks = width // 8
    return row * width + ((col // 8) ^ (row % min(8, chunks))) * 8 + col % 8


def a_lane(lane, kk: int, trans: bool):
    """(row, col) of the stored tile whose address `lane` gives ldmatrix.x4 for the A fragment
    (m16 x k16, k step kk) of a tile at row/col 0: stored [m][k], or [k][m] if `trans`."""
    if trans:
        return kk * 16 + lane // 16 * 8 + lane % 8, lane // 8 % 2 * 8
    return lane % 16, kk * 16 + lane // 16 * 8


def b_lane(lane, kk: int, trans: bool):
    """(row, col) of the stored tile for ldmatrix.x4 of two n8 x k16 B fragments (n 0-15 of
    the pair): stored [n][k], or [k][n] if `trans`."""
    if trans:
        return kk * 16 + lane % 16, lane // 16 * 8
    return lane // 16 * 8 + lane % 8, kk * 16 + lane // 8 % 2 * 8


def acc_rc(lane, e: int):
    """(row, col) within an m16 x n8 tile of accumulator element e (0..3) of `lane`."""
    return lane // 4 + e // 2 * 8, lane % 4 * 2 + e % 2


def n_group(n8: int, m_tiles: int, warps: int = WARPS) -> int:
    """n8 tiles a warp's job covers: the largest even divisor of n8 (at most 12) whose job
    count is a multiple of the warps, so every warp runs the same jobs (no barrier inside a
    condition); jobs are (m tile, group of n8 tiles)."""
    for ng in range(min(12, n8), 1, -1):
        if ng % 2 == 0 and n8 % ng == 0 and (m_tiles * n8 // ng) % warps == 0:
            return ng
    raise ValueError(f"no even n-group of {n8} n8 tiles x {m_tiles} m tiles fits {warps} warps")


def job_tile(job, ng: int, n8: int):
    """(m tile, first n8 tile) of a job."""
    return job // (n8 // ng), job % (n8 // ng) * ng
