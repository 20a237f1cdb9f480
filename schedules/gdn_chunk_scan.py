"""Prefill's chunked GDN, second pass (CUDA sm_80+, tensor cores): the serial walk over a
sequence's chunks that carries the state, on `gdn_chunk_prep`'s workspace.

A block owns (sequence, value head, `col_tile` value columns); 8 warps. The state S (rows =
value columns) stays fp32 in the accumulators of its update for the whole sequence, with a bf16
copy in shared memory as an operand. Per chunk, with W, U0, P, G, K and Q from the first pass:
1. [W; Q] x Sᵀ (one matmul): U = U0 - W Sᵀ and e^(G_last - G) U as bf16, e^G Q Sᵀ in fp32;
2. O = scale (e^G Q Sᵀ + P U) (stored), S <- e^G_last S + (e^(G_last - G) U)ᵀ K, and S's copy.
Two barriers a chunk. The next chunk's operands arrive by cp.async into a second stage while
this one computes, so the loop waits on no global load. The buffers the two phases exchange
(S's copy, U, its decayed copy, e^G Q Sᵀ) live in static shared memory, which TVM's barrier
planner tracks apart from the dynamic stages: a phase reads one kind and writes the other.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.tirx import PrimFunc

from .gdn import stored
from .gdn_chunk_ops import warp_mm
from .gdn_chunk_prep import FPAD, chunked_here
from .gdn_mma_tiles import WARPS, acc_rc, job_tile, n_group, swz
from .kv_cache import first_tile
from .pdl import release_dependents, wait_for_producers
from .ptx import cp_async_16

DTYPE = "bfloat16"
STAGES = 2


def scan_shared_bytes(c: int, ct: int, dk: int) -> tuple[int, int]:
    """(dynamic, static) shared memory of a block."""
    stage = 2 * (3 * c * dk + c * ct + c * c) + 4 * c
    static = 2 * (ct * dk + 2 * c * ct) + 4 * c * (ct + FPAD)
    return STAGES * stage, static


def walked(tokens, skip_single: bool):
    """The tokens a block walks: none for a sequence that is not the chunked rule's."""
    return tokens if not skip_single else T.if_then_else(tokens == 1, 0, tokens)


def _scan_blocks(
    k_heads: int, v_heads: int, dk: int, dv: int, c: int, ct: int, warps: int, skip_single: bool
):
    """The macro of one scan kernel: its grid over (sequence, value head, column tile)."""
    group, nt = v_heads // k_heads, 32 * warps
    if c % 16 or dv % ct or ct % 32 or dk % 64 or v_heads % k_heads:
        raise ValueError(f"chunk {c} (16 |), col_tile {ct} (32 | ct | dv), dk {dk} (64 |)")
    if scan_shared_bytes(c, ct, dk)[1] > 48 * 1024:
        raise ValueError(
            f"chunk {c} x col_tile {ct}: exchanged tiles over 48 KiB of static shared memory"
        )
    scale = float(dk) ** -0.5
    tiles = dv // ct
    ft = ct + FPAD
    sh = "shared.dyn"
    wq_n, k_n, u_n, p_n = 2 * c * dk, c * dk, c * ct, c * c  # elements a stage
    # 1. [W; Q] (2C rows) x Sᵀ (ct columns), over dk
    m1_mt, m1_n8 = 2 * c // 16, ct // 8
    m1_ng = n_group(m1_n8, m1_mt, warps)
    m1_jobs = m1_mt * m1_n8 // m1_ng // warps
    # 2. P (C x C) x U (C x ct); the state: (wU)ᵀ (ct x C) x K (C x dk), one job a warp
    o_mt, o_n8 = c // 16, ct // 8
    o_ng = n_group(o_n8, o_mt, warps)
    o_jobs = o_mt * o_n8 // o_ng // warps
    s_mt, s_n8 = ct // 16, dk // 8
    s_ng = s_mt * s_n8 // warps
    if s_n8 % s_ng or s_ng % 2:
        raise ValueError(f"state tile {ct} x {dk} does not split into {warps} warp tiles")

    @T.macro
    def s_copy(sb, st, smt, sn0, lane):
        # the state's bf16 copy, the operand of [W; Q] x Sᵀ (each warp its own tile)
        for i in T.unroll(s_ng * 4):
            sr, sc = T.meta_var(acc_rc(lane, i % 4))
            sb[swz(smt * 16 + sr, (sn0 + i // 4) * 8 + sc, dk)] = T.Cast(DTYPE, st[i])

    def chunks_of(width) -> int:  # 16-byte chunks of a row of `width` bf16
        return int(width) // 8

    @T.macro
    def copy_rows(dst, dst_at, src, src_at, width, row_stride, tx):
        # C rows of `width` bf16 to the swizzled [C][width] tile at dst_at, by 16-byte cp.async;
        # source row r at src_at + r * row_stride
        k = T.meta_var(chunks_of(width))
        for e in T.unroll(-(-c * k // nt)):
            x: T.let[T.int32] = e * nt + tx
            if c * k % nt == 0 or x < c * k:
                T.evaluate(cp_async_16(
                    dst.data, dst_at + swz(x // k, x % k * 8, width),
                    src.data, src_at + x // k * row_stride + x % k * 8,
                ))  # fmt: skip

    @T.macro
    def load_stage(kb, qb, w, u, p, gc, wq_s, k_s, u_s, p_s, g_s, stage, row0, h, kh, col0, tx):
        vrow: T.let[T.int32] = row0 * v_heads + h
        krow: T.let[T.int32] = row0 * k_heads + kh
        copy_rows(wq_s, stage * wq_n, w, vrow * dk, dk, v_heads * dk, tx)  # [W; Q]
        copy_rows(wq_s, stage * wq_n + c * dk, qb, krow * dk, dk, k_heads * dk, tx)
        copy_rows(k_s, stage * k_n, kb, krow * dk, dk, k_heads * dk, tx)
        copy_rows(u_s, stage * u_n, u, vrow * dv + col0, ct, v_heads * dv, tx)
        copy_rows(p_s, stage * p_n, p, vrow * c, c, v_heads * c, tx)
        if tx < c // 4:  # G: 4 fp32 a copy
            T.evaluate(T.s_tir.cp_async_raw.legacy(
                g_s.data, stage * c + tx * 4, gc.data, h * gc.shape[1] + row0 + tx * 4, 16,
                dtype="float32",
            ))  # fmt: skip
        T.evaluate(T.ptx["cp.async.commit_group"]())

    @T.macro
    def blocks(kb, qb, w, u, p, gc, indptr, slots, pool, layer, out, batch):
        for blk in T.thread_binding(batch * v_heads * tiles, thread="blockIdx.x"):
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                with T.sblock("gdn_chunk_scan"):
                    T.reads()
                    T.writes()
                    wq_s = T.sblock_alloc_buffer((STAGES * wq_n,), DTYPE, scope=sh)
                    k_s = T.sblock_alloc_buffer((STAGES * k_n,), DTYPE, scope=sh)
                    u_s = T.sblock_alloc_buffer((STAGES * u_n,), DTYPE, scope=sh)
                    p_s = T.sblock_alloc_buffer((STAGES * p_n,), DTYPE, scope=sh)
                    g_s = T.sblock_alloc_buffer((STAGES * c,), "float32", scope=sh)
                    sb = T.sblock_alloc_buffer((ct * dk,), DTYPE, scope="shared")
                    ub = T.sblock_alloc_buffer((c * ct,), DTYPE, scope="shared")
                    wub = T.sblock_alloc_buffer((c * ct,), DTYPE, scope="shared")
                    os_ = T.sblock_alloc_buffer((c * ft,), "float32", scope="shared")
                    st = T.sblock_alloc_buffer((s_ng * 4,), "float32", scope="local")
                    acc = T.sblock_alloc_buffer((max(m1_ng, o_ng) * 4,), "float32",
                                                scope="local")  # fmt: skip
                    af = T.sblock_alloc_buffer((8,), DTYPE, scope="local")
                    bf = T.sblock_alloc_buffer((8,), DTYPE, scope="local")
                    gi = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    gl = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    uv = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    T.evaluate(wait_for_producers(True))  # first: schedules/pdl.py
                    T.evaluate(release_dependents(True))
                    b: T.let[T.int32] = blk // (v_heads * tiles)
                    h: T.let[T.int32] = blk // tiles % v_heads
                    col0: T.let[T.int32] = blk % tiles * ct
                    kh: T.let[T.int32] = h // group
                    start: T.let[T.int32] = indptr[b]
                    tokens: T.let[T.int32] = indptr[b + 1] - start
                    live = T.meta_var(chunked_here(tokens, skip_single))
                    length: T.let[T.int32] = walked(tokens, skip_single)
                    slot: T.let[T.int32] = slots[b]
                    first: T.let[T.int32] = first_tile(indptr, b, c)
                    warp: T.let[T.int32] = tx // 32
                    lane: T.let[T.int32] = tx % 32
                    smt: T.let[T.int32] = warp // (s_n8 // s_ng)  # the warp's state tile
                    sn0: T.let[T.int32] = warp % (s_n8 // s_ng) * s_ng
                    if live:
                        for i in T.unroll(s_ng * 4):
                            sr, sc = T.meta_var(acc_rc(lane, i % 4))
                            st[i] = pool[slot, layer, h, col0 + smt * 16 + sr,
                                         (sn0 + i // 4) * 8 + sc]  # fmt: skip
                    s_copy(sb, st, smt, sn0, lane)
                    if length > 0:
                        load_stage(kb, qb, w, u, p, gc, wq_s, k_s, u_s, p_s, g_s, 0, first * c,
                                   h, kh, col0, tx)  # fmt: skip
                    for ch in T.serial((length + c - 1) // c):
                        stage: T.let[T.int32] = ch % STAGES
                        nv: T.let[T.int32] = T.min(c, length - ch * c)
                        T.evaluate(T.ptx["cp.async.wait_group"](0))
                        T.tvm_storage_sync("shared.dyn")  # one barrier serves both kinds
                        if ch * c + c < length:
                            load_stage(kb, qb, w, u, p, gc, wq_s, k_s, u_s, p_s, g_s, 1 - stage,
                                       (first + ch + 1) * c, h, kh, col0, tx)  # fmt: skip
                        # 1. [W; Q] x Sᵀ -> U, e^(G_last - G) U (bf16), e^G Q Sᵀ (fp32)
                        gl[0] = g_s[stage * c + c - 1]  # a store: TVM's shared planner wants one
                        for jb in T.unroll(m1_jobs):
                            mt, n0 = T.meta_var(job_tile(jb * warps + warp, m1_ng, m1_n8))
                            for i in T.unroll(m1_ng * 4):
                                acc[i] = T.float32(0)
                            warp_mm(wq_s, stage * wq_n, dk, False, sb, 0, dk, False, acc, af, bf,
                                    mt, n0, m1_ng, dk // 16, lane)  # fmt: skip
                            for hr in T.unroll(2):
                                gi[hr] = g_s[stage * c + (mt * 16 + lane // 4 + hr * 8) % c]
                            for i in T.unroll(m1_ng * 4):
                                er, ec = T.meta_var(acc_rc(lane, i % 4))
                                row: T.let[T.int32] = mt * 16 + er
                                col: T.let[T.int32] = (n0 + i // 4) * 8 + ec
                                ri: T.let[T.int32] = row % c
                                g_i: T.let[T.float32] = gi[i % 4 // 2]
                                if row < c:
                                    uv[0] = (
                                        T.Cast("float32", u_s[stage * u_n + swz(ri, col, ct)])
                                        - acc[i]
                                    )
                                    ub[swz(ri, col, ct)] = T.Cast(DTYPE, uv[0])
                                    wub[swz(ri, col, ct)] = T.Cast(
                                        DTYPE, T.exp(gl[0] - g_i) * uv[0]
                                    )
                                else:
                                    os_[ri * ft + col] = T.exp(g_i) * acc[i]
                        T.tvm_storage_sync("shared")
                        # 2. the state update, S's copy, and the outputs
                        for i in T.unroll(s_ng * 4):
                            st[i] = st[i] * T.exp(gl[0])
                        warp_mm(wub, 0, ct, True, k_s, stage * k_n, dk, True, st, af, bf, smt,
                                sn0, s_ng, c // 16, lane)  # fmt: skip
                        for jb in T.unroll(o_jobs):
                            mt, n0 = T.meta_var(job_tile(jb * warps + warp, o_ng, o_n8))
                            for i in T.unroll(o_ng * 4):
                                er, ec = T.meta_var(acc_rc(lane, i % 4))
                                acc[i] = os_[(mt * 16 + er) * ft + (n0 + i // 4) * 8 + ec]
                            warp_mm(p_s, stage * p_n, c, False, ub, 0, ct, True, acc, af, bf,
                                    mt, n0, o_ng, c // 16, lane)  # fmt: skip
                            for i in T.unroll(o_ng * 4):
                                er, ec = T.meta_var(acc_rc(lane, i % 4))
                                if mt * 16 + er < nv:
                                    out[
                                        start + ch * c + mt * 16 + er, h,
                                        col0 + (n0 + i // 4) * 8 + ec,
                                    ] = stored(acc[i] * T.float32(scale), out.dtype)  # fmt: skip
                        s_copy(sb, st, smt, sn0, lane)
                    if live:
                        for i in T.unroll(s_ng * 4):
                            sr, sc = T.meta_var(acc_rc(lane, i % 4))
                            pool[slot, layer, h, col0 + smt * 16 + sr,
                                 (sn0 + i // 4) * 8 + sc] = st[i]  # fmt: skip

    return blocks


def chunk_scan(
    k_heads: int,
    v_heads: int,
    dk: int,
    dv: int,
    chunk: int,
    col_tile: int,
    skip_single: bool = False,
    warps: int = WARPS,
    few: tuple[int, int, int] | None = None,
    o_dtype: str = "float32",
) -> PrimFunc:
    """(K, Q, W, U0, P, G from gdn_chunk_prep; indptr, slots, pool, layer) -> (pool, out): the
    state pool updated in place, out [n_tok, v_heads, dv] of `o_dtype`. `skip_single`: one-token
    sequences are gdn_decode's ragged kernel's (their state and rows untouched here).

    `few` = (sequences, col_tile, warps): a step of at most that many sequences runs a second
    kernel with those tiles, chosen on the host from the batch's size (a sequence's chunks are
    serial, so a few sequences fill the GPU only with narrower blocks)."""
    c = chunk
    wide = _scan_blocks(k_heads, v_heads, dk, dv, c, col_tile, warps, skip_single)
    if few is not None:
        few_seqs, narrow = few[0], _scan_blocks(k_heads, v_heads, dk, dv, c, *few[1:], skip_single)

    @T.prim_func(s_tir=True)
    def gdn_chunk_scan(
        kb_h: T.handle,
        qb_h: T.handle,
        w_h: T.handle,
        u_h: T.handle,
        p_h: T.handle,
        gc_h: T.handle,
        indptr_h: T.handle,
        slots_h: T.handle,
        pool_h: T.handle,
        layer: T.int32,
        out_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n_rows, n_tok, n_ptr, batch = T.int32(), T.int32(), T.int32(), T.int32()
        n_slots, n_layers = T.int32(), T.int32()
        kb = T.match_buffer(kb_h, (n_rows, k_heads, dk), DTYPE)
        qb = T.match_buffer(qb_h, (n_rows, k_heads, dk), DTYPE)
        w = T.match_buffer(w_h, (n_rows, v_heads, dk), DTYPE)
        u = T.match_buffer(u_h, (n_rows, v_heads, dv), DTYPE)
        p = T.match_buffer(p_h, (n_rows, v_heads, c), DTYPE)
        gc = T.match_buffer(gc_h, (v_heads, n_rows), "float32")
        indptr = T.match_buffer(indptr_h, (n_ptr,), "int32")
        slots = T.match_buffer(slots_h, (batch,), "int32")
        pool = T.match_buffer(pool_h, (n_slots, n_layers, v_heads, dv, dk), "float32")
        out = T.match_buffer(out_h, (n_tok, v_heads, dv), o_dtype)
        if few is None:
            wide(kb, qb, w, u, p, gc, indptr, slots, pool, layer, out, batch)
        elif batch <= few_seqs:
            narrow(kb, qb, w, u, p, gc, indptr, slots, pool, layer, out, batch)
        else:
            wide(kb, qb, w, u, p, gc, indptr, slots, pool, layer, out, batch)

    return gdn_chunk_scan
