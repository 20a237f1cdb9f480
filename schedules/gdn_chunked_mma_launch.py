"""PrimFuncs around `gdn_chunked_mma.mma_launch`: one kernel, or a pick by the batch at run time.

Few sequences leave most SMs idle with wide column tiles (1 x 32 heads x 1 tile = 32 blocks on
132 SMs), and the chunk loop is serial, so narrow tiles (more blocks, each re-doing the chunk's
K Kᵀ and Q Kᵀ) win there; many sequences fill the GPU anyway and wide tiles do less work in
all. `gdn_chunked_mma_dispatch` holds both kernels and launches one, chosen on the host by
(sequences x value heads x wide tiles) against the SM count.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.tirx import PrimFunc

from .gdn_chunked_mma import mma_launch

H200_SMS = 132


def _prim_func(k_heads: int, v_heads: int, dk: int, dv: int, body, name: str) -> PrimFunc:
    """The kernels' common signature around `body(..., batch)` (a macro)."""

    @T.prim_func(s_tir=True)
    def gdn_chunked_mma_kernel(
        q_h: T.handle,
        k_h: T.handle,
        v_h: T.handle,
        g_h: T.handle,
        beta_h: T.handle,
        indptr_h: T.handle,
        slots_h: T.handle,
        pool_h: T.handle,
        layer: T.int32,
        out_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n_tok, n_ptr, batch = T.int32(), T.int32(), T.int32()
        n_slots, n_layers = T.int32(), T.int32()
        q = T.match_buffer(q_h, (n_tok, k_heads, dk), "float32")
        k = T.match_buffer(k_h, (n_tok, k_heads, dk), "float32")
        v = T.match_buffer(v_h, (n_tok, v_heads, dv), "float32")
        g = T.match_buffer(g_h, (n_tok, v_heads), "float32")
        beta = T.match_buffer(beta_h, (n_tok, v_heads), "float32")
        indptr = T.match_buffer(indptr_h, (n_ptr,), "int32")
        slots = T.match_buffer(slots_h, (batch,), "int32")
        pool = T.match_buffer(pool_h, (n_slots, n_layers, v_heads, dv, dk), "float32")
        out = T.match_buffer(out_h, (n_tok, v_heads, dv), "float32")
        body(q, k, v, g, beta, indptr, slots, pool, layer, out, batch)

    return gdn_chunked_mma_kernel.with_attr("global_symbol", name)


def gdn_chunked_mma(
    k_heads: int,
    v_heads: int,
    dk: int,
    dv: int,
    chunk: int = 64,
    col_tile: int = 128,
    scan: bool = True,
) -> PrimFunc:
    """One tensor-core kernel (see `gdn_chunked_mma.mma_launch`)."""
    body = mma_launch(k_heads, v_heads, dk, dv, chunk, col_tile, scan)
    return _prim_func(k_heads, v_heads, dk, dv, body, "gdn_chunked_mma_kernel")


def gdn_chunked_mma_dispatch(
    k_heads: int,
    v_heads: int,
    dk: int,
    dv: int,
    narrow: tuple[int, int],
    wide: tuple[int, int],
    sms: int = H200_SMS,
) -> PrimFunc:
    """Both kernels, (chunk, col_tile) `narrow` and `wide`; the wide one runs when its blocks
    (sequences x v_heads x dv / wide col_tile) fill at least half of the `sms`, else the narrow
    one. H200, 4B heads (gdn_kernel.json): 32 wide blocks take 253 us where narrow take 157; 128
    wide blocks 273 us where narrow take 414."""
    first = mma_launch(k_heads, v_heads, dk, dv, *wide)
    other = mma_launch(k_heads, v_heads, dk, dv, *narrow)
    wide_tiles = v_heads * (dv // wide[1])

    @T.macro
    def pick(q, k, v, g, beta, indptr, slots, pool, layer, out, batch):
        if batch * wide_tiles * 2 >= sms:
            first(q, k, v, g, beta, indptr, slots, pool, layer, out, batch)
        else:
            other(q, k, v, g, beta, indptr, slots, pool, layer, out, batch)

    return _prim_func(k_heads, v_heads, dk, dv, pick, "gdn_chunked_mma_dispatch")
