"""Where the decode GEMV (schedules/gemv.py) puts things: which k, weight rows and batch rows a
lane loads, how loaded elements become mma fragments, where accumulators, ring slots and
outputs go. The kernel uses these with TIR expressions, tests/test_gemv_emulated.py with ints;
tests mutate them through schedules.gemv_body and gemv_store, whose names the kernel reads."""

from __future__ import annotations

from tvm import tirx

from .gemv_config import BULK_PAD, TILE_COLS, VEC, GemvConfig

Index = int | tirx.Expr


def lane_coords(lane: Index) -> tuple[Index, Index]:
    """(g, q): a lane loads weight rows g and g + 8 of each m-tile and X row g (mma's group and
    thread-in-group)."""
    return lane // 4, lane % 4


def warp_step(j: Index, warp: Index, warps_k: int) -> Index:
    """The k step a warp takes j-th: interleaved, so a block's warps read adjacent stretches."""
    return j * warps_k + warp


def load_k(ks: Index, u: Index, q: Index, step: int) -> Index:
    """First k of load u of lane q in step ks: the four lanes of a row cover 64 contiguous
    bytes per load instruction."""
    return ks * step + u * 4 * VEC + q * VEC


def load_row(tile: Index, h: Index, g: Index, m_tiles: int) -> Index:
    """Weight row of a lane's h-th row register set: m-tile h // 2, row g (h even) or g + 8."""
    return tile * 16 * m_tiles + h // 2 * 16 + h % 2 * 8 + g


def frag_source(m: Index, s: Index, e: Index) -> tuple[Index, Index]:
    """(h, v): A fragment element e of m-tile m in half s of a load comes from element v of row
    register set h. mma's A layout is a0a1 (row g, k 2q..2q+1), a2a3 (g + 8, same k), a4a5
    (g, k 2q+8..2q+9), a6a7 (g + 8, same k); half s maps logical k {2q, 2q+1, 2q+8, 2q+9} to
    physical {4s, .., 4s + 3} of the 8 loaded, and X's B fragment (b0b1: k 2q..2q+1, b2b3:
    k 2q+8..2q+9) is loaded elements 4s..4s+3, the same map."""
    return m * 2 + e // 2 % 2, s * 4 + e // 4 * 2 + e % 2


def x_row(col: Index, j: Index, g: Index) -> Index:
    """Batch row whose X a lane of group g loads for n-tile j of the pass from batch row col:
    B's column g of that tile."""
    return col + j * TILE_COLS + g


def out_row(col: Index, j: Index, c: Index) -> Index:
    """Batch row (output row) of accumulator column c of n-tile j of the pass from row col."""
    return col + j * TILE_COLS + c


def ring_offset(wk: Index, d: Index, u: Index, h: Index, lane: Index, cfg: GemvConfig) -> Index:
    """Element offset in the shared weight ring of the 8 weights load u of row register set h
    of `lane` of warp wk copies in slot d: a warp's lanes 16 bytes apart (conflict-free)."""
    return (((wk * cfg.stages + d) * cfg.unroll + u) * 2 * cfg.m_tiles + h) * 32 * VEC + lane * VEC


def groups_in_flight(stages: int) -> int:
    """cp.async groups a warp may leave pending when it reads a step's ring slot: one a step,
    the step's own the oldest."""
    return stages - 1


def acc_index(m: Index, j: Index, e: Index, n_tiles: int) -> Index:
    """A lane's accumulator element e of m-tile m and n-tile j: four a (m, j) tile, n-tiles of
    an m-tile adjacent."""
    return (m * n_tiles + j) * 4 + e


def paired_row(v: Index) -> tuple[Index, Index]:
    """(output column, 0 gate / 1 up) of a block's virtual row v when it pairs the gate and up
    rows of a gated activation (gemv_kernel's `swiglu`): in each m16 tile rows 0-7 are the gate
    rows of 8 output columns and rows 8-15 their up rows, so the weight's layout stays [gate;
    up] and a column's two sums meet in one block. The weight row is column + 1/0 x half."""
    return v // 16 * 8 + v % 8, v % 16 // 8


def pair_rows(c: Index) -> tuple[Index, Index]:
    """(gate, up) virtual rows of a block's output column c: paired_row's inverse."""
    return c // 8 * 16 + c % 8, c // 8 * 16 + c % 8 + 8


def stage_offset(slot: Index, r: Index, kk: Index, cfg: GemvConfig) -> Index:
    """Element offset in a bulk ring (schedules/gemv_bulk.py) of row r (of the block's tile)
    at k kk of the chunk in stage `slot`: stages of rows x chunk, rows BULK_PAD apart."""
    pitch = cfg.chunk + BULK_PAD
    return (slot * cfg.rows + r) * pitch + kk


def chunk_k(u: Index, q: Index, wk: Index, cfg: GemvConfig) -> Index:
    """k within its chunk of load u of lane q of warp wk: the warp's step is the chunk's wk-th
    (warp_step), laid out as load_k lays out a step."""
    return wk * cfg.step + u * 4 * VEC + q * VEC


def ring_step_tile(gs: Index, blk: Index, grid: Index, chunks: int) -> tuple[Index, Index]:
    """(row tile, chunk) that ring step gs of persistent block blk holds: the block's tiles
    blk, blk + grid, ..., each `chunks` steps."""
    return blk + gs // chunks * grid, gs % chunks


def ring_phase(gs: Index, stages: int) -> Index:
    """The parity ring step gs waits for on its stage's mbarriers: the stage's
    (gs // stages)-th phase, counting from 0."""
    return gs // stages % 2
