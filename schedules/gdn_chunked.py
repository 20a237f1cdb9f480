"""The gated delta rule in chunkwise-parallel (WY / UT-transform) form, for prefill.

A drop-in replacement for `gdn.gated_delta_rule`: same buffers, same in-place state pool, same
result up to fp32 rounding. Per sequence and value head, tokens are taken C at a time. With
G_i the cumulative log decay inside the chunk (token i included), S0 the incoming state
(rows = value columns) and u_i = beta_i (v_i - S_{i}^- k_i) the delta-rule update of token i:

    A[i, j] = beta_i exp(G_i - G_j) k_i.k_j  (j < i)      (I + A) U = beta (V - exp(G) K S0ᵀ)
    o_i     = scale (exp(G_i) S0 q_i + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) u_j)
    S      <- exp(G_last) S0 + sum_j exp(G_last - G_j) u_j k_jᵀ

The triangular solve is blocked: 16-row blocks take the rows above them as one small matmul,
then each value column solves its 16x16 diagonal block in registers. Everything but that
solve is a small dense matmul.

This module picks the kernels and checks their configuration: bf16 models on CUDA sm_80+ take
the tensor-core form in two passes (`two_pass`: gdn_chunk_prep, then gdn_chunk_scan), which
solves every chunk's state-free half at once and leaves a short serial walk over chunks; fp32
models and the CPU take one fp32 kernel (`chunked_gated_delta_rule`, gdn_chunked_fp32).
"""

from __future__ import annotations

from typing import NamedTuple

from tvm.target import Target
from tvm.tirx import Expr, PrimFunc

from .gdn_chunk_prep import blocks_per_sm, chunk_prep, prep_shared_bytes, workspace_rows
from .gdn_chunk_scan import chunk_scan, scan_shared_bytes
from .gdn_chunked_fp32 import GPU_COL_TILE, GPU_THREADS, SOLVE_BLOCK, gdn_chunked_fp32
from .gdn_chunked_fp32 import shared_bytes as fp32_shared_bytes
from .gdn_mma_tiles import WARPS

# Dynamic shared memory a block may use (KiB) by SM arch; unlisted archs get the smallest.
_SMEM_KIB = {80: 163, 87: 163, 90: 227, 100: 227, 103: 227}


def chunked_gated_delta_rule(
    k_heads: int,
    v_heads: int,
    k_dim: int,
    v_dim: int,
    target: Target,
    chunk: int = 32,
    *,
    threads: int | None = None,
    col_tile: int | None = None,
) -> PrimFunc:
    """`gdn.gated_delta_rule` computed chunk by chunk (see the module docstring) in fp32, one
    kernel. `chunk` 32 by default: on the H200 it beat 64 (589 against 607 us at 1x1,024, 3.8
    against 4.9 ms at 16x1,024). `threads` and `col_tile` (threads and value columns per
    block) default to the target's layout: 256 and 64 on CUDA, 1 and v_dim on the CPU, which
    runs (sequence, head) pairs in parallel; tests pass the GPU layout on the CPU to check its
    indexing."""
    gpu = target.kind.name == "cuda"
    arch = int(str(target.attrs.get("arch", "sm_80"))[3:]) if gpu else 0
    nt_ = threads or (GPU_THREADS if gpu else 1)
    ct = col_tile or (min(GPU_COL_TILE, v_dim) if gpu else v_dim)
    sb = SOLVE_BLOCK if chunk % SOLVE_BLOCK == 0 else chunk
    if v_heads % k_heads or v_dim % ct or chunk < 1:
        raise ValueError(f"need k_heads | v_heads ({k_heads}, {v_heads}), col_tile | v_dim")
    if gpu:  # fail here, not at the first launch on the GPU
        need = fp32_shared_bytes(chunk, ct, k_dim, sb)
        if need > _SMEM_KIB.get(arch, 99) * 1024:
            raise ValueError(
                f"chunk {chunk} x col_tile {ct} needs {need // 1024} KiB of shared memory, "
                f"more than sm_{arch} has: use a smaller chunk or col_tile"
            )
    return gdn_chunked_fp32(k_heads, v_heads, k_dim, v_dim, chunk, nt_, ct, sb, gpu)


class TwoPass(NamedTuple):
    """Prefill's tensor-core chunked GDN as two kernels (gdn_chunk_prep, gdn_chunk_scan) and
    the workspace the first hands the second."""

    prep: PrimFunc
    scan: PrimFunc
    chunk: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    skip_single: bool = False  # one-token sequences left to gdn_decode's ragged kernel

    def workspace(self, n_tok: Expr | int, n_seq: Expr | int) -> list[tuple]:
        """(shape, dtype) of K, Q, W, U0, P and G, in the order both kernels take them."""
        rows = workspace_rows(n_tok, n_seq, self.chunk)
        hk, hv, dk, dv, bf16 = self.k_heads, self.v_heads, self.k_dim, self.v_dim, "bfloat16"
        return [
            ((rows, hk, dk), bf16),
            ((rows, hk, dk), bf16),
            ((rows, hv, dk), bf16),
            ((rows, hv, dv), bf16),
            ((rows, hv, self.chunk), bf16),
            ((hv, rows), "float32"),
        ]


# (chunk, value columns a scan block). H200, 4B heads (gdn_kernel.json, session 12): C32 t64
# matches C64 t32 at 1 x 1,024 (111 us a layer), loses 8% at 1 x 8,192 (798 against 734 us)
# and wins wherever several sequences share a step (16 x 1,024: 1,030 against 1,570 us): its
# blocks take 95 KiB of shared memory, two an SM, where C64's take 157 KiB.
TWO_PASS = (32, 64)
# (sequences, col_tile, warps): a step of at most that many sequences scans with narrower,
# smaller blocks, since one sequence's chunks are serial and its 64 wide blocks leave half the
# H200's SMs idle. H200, 4B heads (gdn_kernel_s22.json, kernel us, 64 wide -> 32 narrow):
# 1 x 1,024 124.2 -> 110.6, 1 x 8,192 904 -> 800, but 2 x 1,024 176 -> 180, 4 x 1,024
# 316 -> 351 and 16 x 1,024 1,240 -> 1,313.
FEW_SEQUENCES_SCAN = (1, 32, 4)
# A prefill's one-token sequences (a mixed step's decode rows) through decode's recurrent kernel
# (gdn_decode's ragged form), the two passes skipping them: a mixed step's 16 decode rows cost
# 2.0 ms of GDN in the two passes against ~0.6 ms in decode's kernel
# (profile_step_mixed16_s16.json). Measured on the H200: a mixed step of 16 rows + 16/64/128
# prompt tokens 7.09/7.42/8.96 -> 6.16/6.44/8.11 ms (mixed_step_s17.json), bf16 parity holds.
MIXED_ROWS_RECURRENT = True
# That kernel after the two passes, beside the scan (gdn_decode's `beside`: no wait before it
# starts; its rows of the scan's o in place), instead of before them. With MIXED_ROWS_SPLIT
# (H200, 16 rows + 112 prompt tokens): 7.07 -> 6.37 ms a mixed step, 6.83 with this alone; the
# twin-sequence check holds (mixed_step_{sw,ovl,ovl2}_s26.json).
MIXED_ROWS_BESIDE_SCAN = True
# The prep's blocks a (chunk, key head), each taking its value heads in turn, so q and k are
# loaded, convolved and normed once for them, not once each; and a full chunk whose conv
# history is its sequence's own rows loading its conv inputs unclamped. Built, off: not yet
# run on a GPU. Session 50 (H100): the prep is 63% of the pair at 16 x 1,024 (770 of 1,228
# µs) and issue-bound (0.58 instructions a scheduler a cycle), 44% of its SASS before its first
# barrier (the conv inputs, conv and SiLU); by key head its static SASS for two value heads is
# ~4,100 instructions against ~3,900 for one (ptxas spills 176 bytes at 3 blocks an SM).
PREP_BY_KEY_HEAD = False
PREP_INTERIOR_LOADS = False


def _arch(target: Target) -> int:
    return int(str(target.attrs.get("arch", "sm_80"))[3:]) if target.kind.name == "cuda" else 0


def two_pass_applies(
    k_heads: int, v_heads: int, k_dim: int, v_dim: int, target: Target, act_dtype: str
) -> bool:
    """Whether `two_pass` gives kernels: bf16 activations on CUDA sm_80+, dims that tile."""
    if _arch(target) < 80 or act_dtype != "bfloat16":
        return False
    return not (
        k_dim % 64 or 256 % k_dim or v_dim % 32 or k_dim + v_dim > 256 or v_heads % k_heads
    )


def core_out_dtype(
    k_heads: int, v_heads: int, k_dim: int, v_dim: int, target: Target, act_dtype: str
) -> str:
    """The dtype of the delta rule's output o, which gated_norm reads: the activation dtype
    where the two passes apply, since HF rounds o to it before the norm anyway (the same
    values, half the bytes: 268 -> 134 MB a layer written by the scan and read by the norm at
    16 x 1,024 tokens); fp32 elsewhere (fp32 models, and the CPU, whose kernels keep it)."""
    applies = two_pass_applies(k_heads, v_heads, k_dim, v_dim, target, act_dtype)
    return act_dtype if applies else "float32"


def two_pass(
    k_heads: int,
    v_heads: int,
    k_dim: int,
    v_dim: int,
    target: Target,
    act_dtype: str = "bfloat16",
    chunk: int | None = None,
    col_tile: int | None = None,
    kernel: int = 4,
    skip_single: bool = False,
    scan_warps: int | None = None,
    few: tuple[int, int, int] | None = FEW_SEQUENCES_SCAN,
    by_key_head: bool | None = None,
    interior_loads: bool | None = None,
) -> TwoPass | None:
    """The two-pass kernels where they apply (bf16 activations on CUDA sm_80+, dims that tile),
    else None (the caller takes gdn_input and `chunked_gated_delta_rule`). The first pass
    starts from in_proj's output: `kernel` is the causal conv1d's width. `skip_single`: both
    kernels leave one-token sequences alone, for gdn_decode's ragged kernel (the caller's).
    `few`: chunk_scan's second kernel for steps of few sequences (None: one kernel).
    `by_key_head`, `interior_loads`: the prep's forms (None: PREP_BY_KEY_HEAD,
    PREP_INTERIOR_LOADS)."""
    if not two_pass_applies(k_heads, v_heads, k_dim, v_dim, target, act_dtype):
        return None
    arch = _arch(target)
    c, ct = chunk or TWO_PASS[0], col_tile or min(TWO_PASS[1], v_dim)
    limit = _SMEM_KIB.get(arch, 99) * 1024
    scan_tiles = [ct] if few is None else [ct, few[1]]
    scan_bytes = max(sum(scan_shared_bytes(c, t, k_dim)) for t in scan_tiles)
    if sum(prep_shared_bytes(c, k_dim, v_dim)) > limit or scan_bytes > limit:
        raise ValueError(f"chunk {c} x col_tile {ct}: too much shared memory for sm_{arch}")
    blocks = blocks_per_sm(c, k_dim, v_dim, limit)
    by_key_head = PREP_BY_KEY_HEAD if by_key_head is None else by_key_head
    interior_loads = PREP_INTERIOR_LOADS if interior_loads is None else interior_loads
    heads = v_heads // k_heads if by_key_head else 1
    prep = chunk_prep(k_heads, v_heads, k_dim, v_dim, c, kernel, blocks, skip_single, heads,
                      interior_loads)  # fmt: skip
    warps = scan_warps or WARPS
    o_dtype = core_out_dtype(k_heads, v_heads, k_dim, v_dim, target, act_dtype)
    scan = chunk_scan(k_heads, v_heads, k_dim, v_dim, c, ct, skip_single, warps, few, o_dtype)
    # a module may hold both forms (prefill's and prefill_prompts'): names apart
    tag = "" if skip_single else "_all"
    prep = prep.with_attr("global_symbol", f"gdn_chunk_prep{tag}")
    scan = scan.with_attr("global_symbol", f"gdn_chunk_scan{tag}")
    return TwoPass(prep, scan, c, k_heads, v_heads, k_dim, v_dim, skip_single)
