"""Prefill's chunked GDN, first pass (CUDA sm_80+, tensor cores): what each chunk needs from
the state-free half of the algorithm, for every chunk of every sequence at once.

With the notation of `gdn_chunked`, a chunk's update U solves (I + A) U = beta (V - e^G K Sᵀ).
The solve is linear, so U = U0 - W Sᵀ, where (I + A) U0 = beta V and (I + A) W = beta e^G K
depend on no state. This pass computes, per (chunk, value head), in one block of 8 warps:
- G, the cumulative log decays (fp32), and K, Q as bf16 (once per key head);
- W and U0 (bf16): one blocked triangular solve of the 256 columns [beta e^G K | beta V],
  16 rows at a time (rows above by mma, the 16x16 diagonal a column a thread in fp32);
- P = the causal decayed Q Kᵀ (bf16), the chunk's own part of its outputs.
Everything that needs the state (U = U0 - W Sᵀ, the outputs, the state update) is left to
`gdn_chunk_scan`, whose serial loop over chunks is then a few small matmuls with its inputs
prefetched. The workspace is indexed by chunk: row `first_tile(indptr, s, C) * C + i` holds
token i of sequence s's first chunk, and so on; rows past a sequence's end are written as zeros
(G holds the chunk's last value there), so the scan reads whole chunks without bounds.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.tirx import PrimFunc

from .gdn_mma_tiles import WARPS, a_lane, acc_rc, b_lane, job_tile, n_group, swz
from .kv_cache import first_tile, seq_of_tile
from .pdl import release_dependents, wait_for_producers
from .ptx import ldmatrix_x4, mma_bf16

DTYPE = "bfloat16"
FULL_MASK = 0xFFFFFFFF
FPAD = 4  # row padding of fp32 shared tiles (keeps 16-byte rows aligned)
THREADS = WARPS * 32


def workspace_rows(n_tok, n_seq, chunk: int):
    """Rows of the chunk-indexed workspace: every chunk number `first_tile` can give."""
    return (n_tok // chunk + n_seq) * chunk


def prep_shared_bytes(c: int, dk: int, dv: int) -> tuple[int, int]:
    """(dynamic, static) shared memory of a block."""
    rw = dk + dv
    return 2 * 2 * c * dk + 4 * c * (c + FPAD + rw + FPAD), 2 * (c * c + c * rw) + 4 * 2 * c


@T.macro
def warp_mm(
    a, a_at, a_width, a_km, b, b_at, b_width, b_kn, acc, af, bf, mt, n0, ng, k_steps, lane
):
    # acc[: 4 ng] += A[16 rows at m tile mt, : 16 k_steps] x B[:, n8 tiles n0 .. n0 + ng), one
    # warp: A stored [m][k] or, a_km, [k][m] in the swizzled tile at a_at of `a`; B as [n][k]
    # or, b_kn, [k][n]
    for kk in T.unroll(k_steps):
        ar, ac = T.meta_var(a_lane(lane, kk, a_km))
        if a_km:
            T.evaluate(ldmatrix_x4(af, 0, a, a_at + swz(ar, mt * 16 + ac, a_width), True))
        else:
            T.evaluate(ldmatrix_x4(af, 0, a, a_at + swz(mt * 16 + ar, ac, a_width)))
        for np_ in T.unroll(ng // 2):
            br, bc = T.meta_var(b_lane(lane, kk, b_kn))
            if b_kn:
                T.evaluate(ldmatrix_x4(
                    bf, 0, b, b_at + swz(br, (n0 + np_ * 2) * 8 + bc, b_width), True
                ))  # fmt: skip
            else:
                T.evaluate(ldmatrix_x4(
                    bf, 0, b, b_at + swz((n0 + np_ * 2) * 8 + br, bc, b_width)
                ))  # fmt: skip
            for h2 in T.unroll(2):
                T.evaluate(mma_bf16(af.data, 0, bf.data, h2 * 4, acc.data, (np_ * 2 + h2) * 4))


@T.macro
def decay_scan(g, gs, gc, cum, gv, t0, nv, h, row0, warp, lane, c: int):
    # G = cumsum of the chunk's log decays (0 past its end, so G stays at its last value
    # there): 32 tokens a piece, an inclusive Hillis-Steele scan over the lanes plus the pieces
    # before; warp w stores piece w. One load a lane, not a chain of C dependent loads.
    cum[0] = T.float32(0)
    for piece in T.unroll(-(-c // 32)):
        j: T.let[T.int32] = piece * 32 + lane
        gv[0] = T.Select(j < nv, g[t0 + T.min(j, nv - 1), h], T.float32(0))
        for s in T.unroll(5):
            gv[1] = T.tvm_warp_shuffle_up(FULL_MASK, gv[0], 1 << s, 32, 32)
            gv[0] = gv[0] + T.Select(lane >= (1 << s), gv[1], T.float32(0))
        gv[0] = gv[0] + cum[0]
        cum[0] = T.tvm_warp_shuffle(FULL_MASK, gv[0], 31, 32, 32)
        if piece == warp and j < c:
            gs[j] = gv[0]
            gc[h, row0 + j] = gv[0]


def chunk_prep(k_heads: int, v_heads: int, dk: int, dv: int, chunk: int) -> PrimFunc:
    """(q, k, v, g, beta, indptr) -> (K, Q bf16 [rows, k_heads, dk]; W bf16 [rows, v_heads,
    dk]; U0 bf16 [rows, v_heads, dv]; P bf16 [rows, v_heads, chunk]; G fp32 [v_heads, rows]),
    rows = workspace_rows(n_tok, n_seq, chunk)."""
    c, group, nt = chunk, v_heads // k_heads, THREADS
    rw = dk + dv  # R's columns
    if c % 16 or c > 128 or dk % 64 or dv % 16 or v_heads % k_heads or rw > nt:
        raise ValueError(f"chunk {c} (16 | C <= 128), dk {dk} (64 |), dk + dv <= {nt}")
    if prep_shared_bytes(c, dk, dv)[1] > 48 * 1024:
        raise ValueError(f"chunk {c}: A and X in bf16 exceed 48 KiB of static shared memory")
    fc, fr = c + FPAD, rw + FPAD
    sh = "shared.dyn"
    # [K; Q] (2C rows) x Kᵀ (C columns), over dk
    g1_mt, g1_n8 = 2 * c // 16, c // 8
    g1_ng = n_group(g1_n8, g1_mt)
    g1_jobs = g1_mt * g1_n8 // g1_ng // WARPS
    # the solve's off-diagonal rows: one n16 pair of R's columns a warp job
    sv_pairs = rw // 16
    sv_jobs = -(-sv_pairs // WARPS)
    half = c * dk // nt  # K (or Q) elements a thread

    @T.macro
    def solve_off(blk16, ab, xb, rs, acc, af, bf, rg, warp, lane):
        # rows r0..r0+15 of R -= A[those rows, :r0] X[:r0] (tensor cores, bf16 operands)
        r0: T.let[T.int32] = blk16 * 16
        for jb in T.unroll(sv_jobs):
            pr: T.let[T.int32] = T.min(jb * WARPS + warp, sv_pairs - 1)
            for i in T.unroll(8):
                acc[jb * 8 + i] = T.float32(0)
            for kk in T.unroll(c // 16 - 1):
                if kk < blk16:
                    ar, ac = T.meta_var(a_lane(lane, kk, False))
                    T.evaluate(ldmatrix_x4(af, 0, ab, swz(r0 + ar, ac, c)))
                    br, bc = T.meta_var(b_lane(lane, kk, True))
                    T.evaluate(ldmatrix_x4(bf, 0, xb, swz(br, pr * 16 + bc, rw), True))
                    for h2 in T.unroll(2):
                        T.evaluate(mma_bf16(
                            af.data, 0, bf.data, h2 * 4, acc.data, jb * 8 + h2 * 4
                        ))  # fmt: skip
        # every job's reads, then its writes: one barrier for TVM's planner, not one a job
        for jb in T.unroll(sv_jobs):
            pr: T.let[T.int32] = T.min(jb * WARPS + warp, sv_pairs - 1)
            for i in T.unroll(8):
                er, ec = T.meta_var(acc_rc(lane, i % 4))
                rg[jb * 8 + i] = rs[(r0 + er) * fr + pr * 16 + i // 4 * 8 + ec]
        for jb in T.unroll(sv_jobs):
            pr: T.let[T.int32] = T.min(jb * WARPS + warp, sv_pairs - 1)
            for i in T.unroll(8):
                er, ec = T.meta_var(acc_rc(lane, i % 4))
                # a spare warp repeats the last pair and stores nothing
                if sv_pairs % WARPS == 0 or jb * WARPS + warp < sv_pairs:
                    at: T.let[T.int32] = (r0 + er) * fr + pr * 16 + i // 4 * 8 + ec
                    rs[at] = rg[jb * 8 + i] - acc[jb * 8 + i]

    @T.macro
    def solve_diag(blk16, rs, am, xb, w, u, uu, row0, h, tx):
        # the 16x16 diagonal block, a column a thread, fp32 in registers; X rows to the
        # workspace as W (columns < dk) or U0
        r0: T.let[T.int32] = blk16 * 16
        for i in T.unroll(16):
            uu[i] = rs[(r0 + i) * fr + T.min(tx, rw - 1)]
        for jj in T.unroll(16):
            for ii in T.unroll(16):
                if ii > jj:
                    uu[ii] = uu[ii] - am[(r0 + ii) * fc + r0 + jj] * uu[jj]
        if rw == nt or tx < rw:
            for i in T.unroll(16):
                xb[swz(r0 + i, tx, rw)] = T.Cast(DTYPE, uu[i])
                if tx < dk:
                    w[row0 + r0 + i, h, tx] = T.Cast(DTYPE, uu[i])
                else:
                    u[row0 + r0 + i, h, tx - dk] = T.Cast(DTYPE, uu[i])

    @T.prim_func(s_tir=True)
    def gdn_chunk_prep(
        q_h: T.handle,
        k_h: T.handle,
        v_h: T.handle,
        g_h: T.handle,
        beta_h: T.handle,
        indptr_h: T.handle,
        kb_h: T.handle,
        qb_h: T.handle,
        w_h: T.handle,
        u_h: T.handle,
        p_h: T.handle,
        gc_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n_tok, n_ptr, n_rows = T.int32(), T.int32(), T.int32()
        q = T.match_buffer(q_h, (n_tok, k_heads, dk), "float32")
        k = T.match_buffer(k_h, (n_tok, k_heads, dk), "float32")
        v = T.match_buffer(v_h, (n_tok, v_heads, dv), "float32")
        g = T.match_buffer(g_h, (n_tok, v_heads), "float32")
        beta = T.match_buffer(beta_h, (n_tok, v_heads), "float32")
        indptr = T.match_buffer(indptr_h, (n_ptr,), "int32")
        kb = T.match_buffer(kb_h, (n_rows, k_heads, dk), DTYPE)
        qb = T.match_buffer(qb_h, (n_rows, k_heads, dk), DTYPE)
        w = T.match_buffer(w_h, (n_rows, v_heads, dk), DTYPE)
        u = T.match_buffer(u_h, (n_rows, v_heads, dv), DTYPE)
        p = T.match_buffer(p_h, (n_rows, v_heads, c), DTYPE)
        gc = T.match_buffer(gc_h, (v_heads, n_rows), "float32")
        for blk in T.thread_binding(n_rows // c * v_heads, thread="blockIdx.x"):
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                with T.sblock("gdn_chunk_prep"):
                    T.reads()
                    T.writes()
                    kq = T.sblock_alloc_buffer((2 * c * dk,), DTYPE, scope=sh)
                    am = T.sblock_alloc_buffer((c * fc,), "float32", scope=sh)
                    rs = T.sblock_alloc_buffer((c * fr,), "float32", scope=sh)
                    ab = T.sblock_alloc_buffer((c * c,), DTYPE, scope="shared")
                    xb = T.sblock_alloc_buffer((c * rw,), DTYPE, scope="shared")
                    gs = T.sblock_alloc_buffer((c,), "float32", scope="shared")
                    bs = T.sblock_alloc_buffer((c,), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer(
                        (max(g1_ng * 4, sv_jobs * 8),), "float32", scope="local"
                    )
                    af = T.sblock_alloc_buffer((8,), DTYPE, scope="local")
                    bf = T.sblock_alloc_buffer((8,), DTYPE, scope="local")
                    gi = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    bi = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    gj = T.sblock_alloc_buffer((g1_ng * 2,), "float32", scope="local")
                    ld = T.sblock_alloc_buffer((max(2 * half, c),), "float32", scope="local")
                    rg = T.sblock_alloc_buffer((sv_jobs * 8,), "float32", scope="local")
                    uu = T.sblock_alloc_buffer((16,), "float32", scope="local")
                    cum = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    gv = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    lo = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    hi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    T.evaluate(wait_for_producers(True))  # first: schedules/pdl.py
                    T.evaluate(release_dependents(True))
                    cno: T.let[T.int32] = blk // v_heads
                    h: T.let[T.int32] = blk % v_heads
                    kh: T.let[T.int32] = h // group
                    warp: T.let[T.int32] = tx // 32
                    lane: T.let[T.int32] = tx % 32
                    seq_of_tile(indptr, n_ptr - 1, cno, c, lo, hi)
                    # What depends on the search is stored, never let-bound (TVM's shared memory
                    # planner refuses a local buffer read by a let at the kernel's top). A chunk
                    # number no sequence has computes a token's chunk into rows no one reads: no
                    # branch around the barriers below.
                    lo[0] = T.min(
                        indptr[lo[0]] + (cno - first_tile(indptr, lo[0], c)) * c, n_tok - 1
                    )
                    hi[0] = T.max(T.min(c, indptr[hi[0]] - lo[0]), 1)
                    t0 = T.meta_var(lo[0])
                    nv = T.meta_var(hi[0])
                    row0: T.let[T.int32] = cno * c
                    # 1. K and Q rows as bf16 (zero past the end), also to the workspace
                    # once per key head; G and beta. Every load goes to registers first,
                    # unconditional (rows past the end read the last token and are zeroed by a
                    # multiply): one round of loads in flight, not a chain behind branches.
                    for e in T.unroll(half):
                        x: T.let[T.int32] = e * nt + tx
                        live = T.meta_var(T.Cast("float32", x // dk < nv))
                        ld[e] = k[t0 + T.min(x // dk, nv - 1), kh, x % dk] * live
                        ld[half + e] = q[t0 + T.min(x // dk, nv - 1), kh, x % dk] * live
                    for e in T.unroll(2 * half):
                        x: T.let[T.int32] = e * nt + tx
                        kq[swz(x // dk, x % dk, dk)] = T.Cast(DTYPE, ld[e])
                    if h % group == 0:
                        for e in T.unroll(half):
                            x: T.let[T.int32] = e * nt + tx
                            kb[row0 + x // dk, kh, x % dk] = T.Cast(DTYPE, ld[e])
                            qb[row0 + x // dk, kh, x % dk] = T.Cast(DTYPE, ld[half + e])
                    if warp < -(-c // 32):  # warp-uniform: every lane shuffles
                        decay_scan(g, gs, gc, cum, gv, t0, nv, h, row0, warp, lane, c)
                    if tx < c:
                        bs[tx] = beta[t0 + T.min(tx, nv - 1), h] * T.Cast("float32", tx < nv)
                    T.tvm_storage_sync("shared.dyn")
                    # 2. R = [beta e^G K | beta V] (fp32 inputs; a column a thread), then
                    # [K; Q] x Kᵀ -> A, P
                    if tx < dk:  # warp-uniform
                        for e in T.unroll(c):
                            ld[e] = k[t0 + T.min(e, nv - 1), kh, tx]
                    else:
                        for e in T.unroll(c):
                            ld[e] = v[t0 + T.min(e, nv - 1), h, T.min(tx - dk, dv - 1)]
                    for e in T.unroll(c):
                        if rw == nt or tx < rw:  # bs is 0 past the end
                            rs[e * fr + tx] = (
                                ld[e] * bs[e] * T.Select(tx < dk, T.exp(gs[e]), T.float32(1))
                            )
                    for jb in T.unroll(g1_jobs):
                        mt, n0 = T.meta_var(job_tile(jb * WARPS + warp, g1_ng, g1_n8))
                        for i in T.unroll(g1_ng * 4):
                            acc[i] = T.float32(0)
                        warp_mm(kq, 0, dk, False, kq, 0, dk, False, acc, af, bf, mt, n0, g1_ng,
                                dk // 16, lane)  # fmt: skip
                        for hr in T.unroll(2):
                            gi[hr] = gs[(mt * 16 + lane // 4 + hr * 8) % c]
                            bi[hr] = bs[(mt * 16 + lane // 4 + hr * 8) % c]
                        for i in T.unroll(g1_ng * 2):
                            gj[i] = gs[(n0 + i // 2) * 8 + lane % 4 * 2 + i % 2]
                        for i in T.unroll(g1_ng * 4):
                            er, ec = T.meta_var(acc_rc(lane, i % 4))
                            row: T.let[T.int32] = mt * 16 + er
                            col: T.let[T.int32] = (n0 + i // 4) * 8 + ec
                            ri: T.let[T.int32] = row % c
                            # min(., 0): the masked-out half never overflows
                            dec = T.meta_var(T.exp(
                                T.min(gi[i % 4 // 2] - gj[i // 4 * 2 + i % 2], T.float32(0))
                            ))  # fmt: skip
                            if row < c:  # K Kᵀ -> A (fp32 for the diagonal, bf16 operand)
                                a_ = T.meta_var(T.Select(
                                    col < ri, bi[i % 4 // 2] * dec * acc[i], T.float32(0)
                                ))  # fmt: skip
                                am[ri * fc + col] = a_
                                ab[swz(ri, col, c)] = T.Cast(DTYPE, a_)
                            else:  # Q Kᵀ -> P, causal and decayed
                                p[row0 + ri, h, col] = T.Cast(
                                    DTYPE, T.Select(col <= ri, dec * acc[i], T.float32(0))
                                )
                    T.tvm_storage_sync("shared.dyn")
                    # 3. (I + A) X = R, 16 rows at a time; X = [W | U0]
                    solve_diag(0, rs, am, xb, w, u, uu, row0, h, tx)
                    T.tvm_storage_sync("shared")
                    for blk16 in T.unroll(1, c // 16):
                        solve_off(blk16, ab, xb, rs, acc, af, bf, rg, warp, lane)
                        T.tvm_storage_sync("shared.dyn")
                        solve_diag(blk16, rs, am, xb, w, u, uu, row0, h, tx)
                        T.tvm_storage_sync("shared")

    return gdn_chunk_prep
