"""The paged KV cache's layout and the kernels that write it.

K and V live in two page pools, each [layers, pages, kv_heads, PAGE_SIZE, head_dim] in the
activation dtype, and a page table [slots, pages_per_seq] of int32 page ids: row `slot` lists
the pages of the sequence in that slot, in order (written by `assign_pages` when the runtime
gives a sequence its pages). A step is a ragged token array (`indptr` marks where each sequence
starts, `slots` names its rows, `positions[t]` is token t's absolute position); `append_kv`
writes each token's K/V to its page before attention reads them (schedules/attention.py).
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .loops import block_loop, thread_loop

PAGE_SIZE = 16


@T.macro
def seq_of_token(indptr, n_seq, t, lo, hi):
    # lo[0] <- the sequence b with indptr[b] <= t < indptr[b + 1]; a while loop, so one
    # sequence costs no step (a kernel with a thread per token and channel runs this a lot)
    lo[0] = 0
    hi[0] = n_seq
    while hi[0] - lo[0] > 1:
        if indptr[(lo[0] + hi[0]) // 2] <= t:
            lo[0] = (lo[0] + hi[0]) // 2
        else:
            hi[0] = (lo[0] + hi[0]) // 2


def first_tile(indptr, s, tile: int):
    """Tiles of `tile` tokens numbered sequence after sequence: sequence s's first number. The
    gap to the next sequence's is at least s's tile count, so n_tok // tile + n_seq numbers
    cover any batch (a few go unused)."""
    return indptr[s] // tile + s


@T.macro
def seq_of_tile(indptr, n_seq, g, tile, lo, hi):
    # lo[0] <- the last sequence whose first tile number (first_tile) is <= g
    lo[0] = 0
    hi[0] = n_seq
    while hi[0] - lo[0] > 1:
        if first_tile(indptr, (lo[0] + hi[0]) // 2, tile) <= g:
            lo[0] = (lo[0] + hi[0]) // 2
        else:
            hi[0] = (lo[0] + hi[0]) // 2


def append_kv(kv_heads: int, head_dim: int, dtype: str, target: Target) -> PrimFunc:
    """Write each token's K and V into its page: (k, v, indptr, slots, positions, page_table,
    k_pool, v_pool, layer), the pools in place."""
    gpu = target.kind.name == "cuda"
    tj = PAGE_SIZE
    width = kv_heads * head_dim

    tokens, lanes = block_loop(gpu), thread_loop(width, gpu)

    @T.prim_func(s_tir=True)
    def attn_append_kv(
        k_h: T.handle,
        v_h: T.handle,
        indptr_h: T.handle,
        slots_h: T.handle,
        pos_h: T.handle,
        table_h: T.handle,
        kp_h: T.handle,
        vp_h: T.handle,
        layer: T.int32,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n_tok, n_ptr, n_seq = T.int32(), T.int32(), T.int32()
        n_slots, width_pt = T.int32(), T.int32()
        n_layers, n_pages = T.int64(), T.int64()
        k = T.match_buffer(k_h, (n_tok, kv_heads, head_dim), dtype)
        v = T.match_buffer(v_h, (n_tok, kv_heads, head_dim), dtype)
        indptr = T.match_buffer(indptr_h, (n_ptr,), "int32")
        slots = T.match_buffer(slots_h, (n_seq,), "int32")
        positions = T.match_buffer(pos_h, (n_tok,), "int32")
        table = T.match_buffer(table_h, (n_slots, width_pt), "int32")
        kp = T.match_buffer(kp_h, (n_layers, n_pages, kv_heads, tj, head_dim), dtype)
        vp = T.match_buffer(vp_h, (n_layers, n_pages, kv_heads, tj, head_dim), dtype)
        for t in tokens(n_tok):
            with T.sblock("append"):
                T.reads()
                T.writes()
                lo = T.sblock_alloc_buffer((1,), "int32", scope="local")
                hi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                seq_of_token(indptr, n_ptr - 1, t, lo, hi)
                pos: T.let[T.int32] = positions[t]
                page: T.let[T.int64] = T.Cast("int64", table[slots[lo[0]], pos // tj])
                for x in lanes():
                    with T.sblock("copy"):
                        T.reads()
                        T.writes()
                        kp[T.Cast("int64", layer), page, x // head_dim, pos % tj, x % head_dim] = k[
                            t, x // head_dim, x % head_dim
                        ]
                        vp[T.Cast("int64", layer), page, x // head_dim, pos % tj, x % head_dim] = v[
                            t, x // head_dim, x % head_dim
                        ]

    return attn_append_kv


def assign_pages(target: Target) -> PrimFunc:
    """page_table[slot[0], :len(pages)] = pages, in place."""
    gpu = target.kind.name == "cuda"

    def one():
        return T.thread_binding(1, thread="blockIdx.x") if gpu else T.serial(1)

    def entries(n):
        return T.thread_binding(n, thread="threadIdx.x") if gpu else T.serial(n)

    @T.prim_func(s_tir=True)
    def attn_assign_pages(table_h: T.handle, slot_h: T.handle, pages_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n_slots, width, count = T.int32(), T.int32(), T.int32()
        table = T.match_buffer(table_h, (n_slots, width), "int32")
        slot = T.match_buffer(slot_h, (1,), "int32")
        pages = T.match_buffer(pages_h, (count,), "int32")
        for _ in one():
            for tx in entries(256):
                with T.sblock("assign"):
                    T.reads()
                    T.writes()
                    for e in T.serial((count + 255) // 256):
                        if e * 256 + tx < count:
                            table[slot[0], e * 256 + tx] = pages[e * 256 + tx]

    return attn_assign_pages
