"""Where the tensor-core GEMM (schedules/matmul.py) puts things: the swizzled shared-memory
tiles, the cp.async copy split, ldmatrix addresses and accumulator positions. Written once for
the kernel (TIR expressions) and the test's numpy emulator (ints)."""

from __future__ import annotations

from tvm import tirx

Index = int | tirx.Expr


def tile_offset(row: Index, chunk: Index, chunks: int) -> Index:
    """Element offset of 16-byte chunk `chunk` of row `row` in a tile whose rows hold `chunks`
    chunks. The chunk index is XORed with the row's place among the rows sharing a 128-byte bank
    window, so the 8 rows an ldmatrix reads (and a warp's 32 copies) hit 8 different banks."""
    rows_per_window = 8 // chunks
    return row * (chunks * 8) + (chunk ^ (row // rows_per_window % chunks)) * 8


def copy_coords(index: Index, chunks: int) -> tuple[Index, Index]:
    """(row, chunk) of the index-th 16-byte chunk of a tile; consecutive threads take
    consecutive chunks of a row, so a warp reads whole rows of global memory."""
    return index // chunks, index % chunks


def ldmatrix_a_coords(lane: Index, kk: Index) -> tuple[Index, Index]:
    """(row, chunk) whose address `lane` gives ldmatrix.x4 for the A fragment of one m16 x k16
    step kk: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15,
    k 8-15), which are mma's a0a1, a2a3, a4a5, a6a7 registers."""
    return lane % 16, kk * 2 + lane // 16


def ldmatrix_b_coords(lane: Index, kk: Index) -> tuple[Index, Index]:
    """(row of B = column n, chunk) for ldmatrix.x4 of two n8 x k16 B fragments: matrices
    (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15), i.e. b0b1 and b2b3 of
    the first n8 tile, then of the second."""
    return lane // 16 * 8 + lane % 8, kk * 2 + lane // 8 % 2


def acc_coords(lane: Index, e: Index) -> tuple[Index, Index]:
    """(row, column) within an m16 x n8 tile of accumulator element e (0..3) of `lane`."""
    return lane // 4 + e // 2 * 8, lane % 4 * 2 + e % 2


def paired_weight_row(row: Index, group: int, first_col: Index, inter: int) -> Index:
    """The weight row that B-tile row `row` holds when the GEMM's epilogue is a SwiGLU (gate_up
    [2 inter, k] as stored, gate rows then up rows): each `group` tile rows are group / 2 gate
    rows of consecutive output columns, then the up rows of the same columns, so a thread holds
    both halves of its columns in n8 tiles group / 16 apart. `first_col`: the tile's first
    output column."""
    half = group // 2
    col = first_col + row // group * half + row % group % half
    return col + row % group // half * inter
