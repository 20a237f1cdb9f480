"""The fp32 chunked gated delta rule kernel (`gdn_chunked`'s algorithm), for CUDA and the CPU.

The fp32 and CPU path of `gdn_chunked.chunked_gated_delta_rule`; bf16 models on CUDA sm_80+
take the tensor-core kernels (`gdn_chunked.two_pass`) instead.

One loop nest serves both targets. A "block" owns (sequence, value head, tile of value
columns) and runs phases, each a loop over the block's threads: on CUDA they are threadIdx
loops separated by barriers (TVM inserts them between phases that share memory) and the
block's buffers live in shared memory; on the CPU the same loops run serially, so the CPU
tests exercise the exact index arithmetic of the GPU kernel when built with its layout.
Every thread computes a micro-tile of TM x TN outputs whose rows (columns) are strided by
the number of tiles, so a warp's shared-memory reads fall in distinct banks.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.tirx import PrimFunc

from .loops import block_loop, thread_loop

GPU_THREADS = 256
GPU_COL_TILE = 64  # value columns per block: 2 blocks per head at v_dim 128
SOLVE_BLOCK = 16
PAD = 1  # row padding of shared buffers: a warp reading one column hits distinct banks


def _micro_tile(rows: int, cols: int, threads: int, cap: int = 8) -> tuple[int, int]:
    """The smallest (TM, TN) with at most `threads` tiles (or the cap): one tile a thread."""
    tm = tn = 1
    while (rows // tm) * (cols // tn) > threads:
        if tn <= tm and tn < cap and cols % (2 * tn) == 0:
            tn *= 2
        elif tm < cap and rows % (2 * tm) == 0:
            tm *= 2
        elif tn < cap and cols % (2 * tn) == 0:
            tn *= 2
        else:
            break
    return tm, tn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def shared_bytes(c: int, ct: int, dk: int, sb: int) -> int:
    """Shared memory a CUDA block of the kernel uses: chunk `c`, `ct` value columns, solve
    block `sb`."""
    kst, ast, ust = dk + PAD, c + PAD, ct + PAD
    return 4 * (c * (2 * kst + 2 * ast + ust + 2) + ct * kst + sb * ust)


def gdn_chunked_fp32(
    k_heads: int, v_heads: int, dk: int, dv: int, c: int, nt: int, ct: int, sb: int, gpu: bool
) -> PrimFunc:
    """The kernel for chunk `c`, `nt` threads and `ct` value columns a block, triangular solve
    in `sb`-row blocks (a divisor of `c`); `gpu` binds blocks and threads to CUDA's and puts
    the block's buffers in shared memory."""
    group = v_heads // k_heads
    scale = float(dk) ** -0.5
    tiles = dv // ct
    shared = "shared.dyn" if gpu else "global"
    kst, ast, ust = dk + PAD, c + PAD, ct + PAD  # row strides of [., dk], [., c], [., ct] tiles

    grid, lanes = block_loop(gpu), thread_loop(nt, gpu)

    # (TM, TN) micro-tile, tile grid (mt, nt) and passes per thread of each matmul phase.
    def plan(rows: int, cols: int) -> tuple[int, int, int, int, int]:
        tm, tn = _micro_tile(rows, cols, nt)
        mt, ntl = rows // tm, cols // tn
        return tm, tn, mt, ntl, _cdiv(mt * ntl, nt)

    a_tm, a_tn, a_mt, a_nt, a_rep = plan(c, c)  # A and masked QKᵀ    [C, C]
    r_tm, r_tn, r_mt, r_nt, r_rep = plan(c, ct)  # residuals, outputs  [C, CT]
    s_tm, s_tn, s_mt, s_nt, s_rep = plan(sb, ct)  # off-diagonal solve  [SB, CT]
    u_tm, u_tn, u_mt, u_nt, u_rep = plan(ct, dk)  # state update        [CT, DK]

    @T.macro
    def zero(acc: T.Buffer, n: T.int32):
        for x in T.unroll(n):
            acc[x] = T.float32(0)

    @T.macro
    def outer(acc: T.Buffer, ra: T.Buffer, rb: T.Buffer, tm: T.int32, tn: T.int32):
        # the register micro-tile update acc += ra ⊗ rb
        for r in T.unroll(tm):
            for s in T.unroll(tn):
                acc[r * tn + s] += ra[r] * rb[s]

    @T.prim_func(s_tir=True)
    def gdn_chunked_delta_rule(
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
        for blk in grid(batch * v_heads * tiles):
            with T.sblock("chunked"):
                T.reads()
                T.writes()
                # Row-major tiles, flat with padded row strides: a warp reading one column
                # hits distinct banks (TVM's buffer compaction would drop a padded 2-D shape).
                ks = T.sblock_alloc_buffer((c * kst,), scope=shared)
                qs = T.sblock_alloc_buffer((c * kst,), scope=shared)
                st = T.sblock_alloc_buffer((ct * kst,), scope=shared)
                am = T.sblock_alloc_buffer((c * ast,), scope=shared)
                qk = T.sblock_alloc_buffer((c * ast,), scope=shared)
                us = T.sblock_alloc_buffer((c * ust,), scope=shared)
                rs = T.sblock_alloc_buffer((sb * ust,), scope=shared)
                gs = T.sblock_alloc_buffer((c,), scope=shared)
                bs = T.sblock_alloc_buffer((c,), scope=shared)
                b: T.let[T.int32] = blk // (v_heads * tiles)
                h: T.let[T.int32] = blk // tiles % v_heads
                col0: T.let[T.int32] = blk % tiles * ct
                kh: T.let[T.int32] = h // group
                start: T.let[T.int32] = indptr[b]
                length: T.let[T.int32] = indptr[b + 1] - start
                slot: T.let[T.int32] = slots[b]
                for tx in lanes():
                    with T.sblock("load_state"):
                        T.reads()
                        T.writes()
                        for e in T.serial(_cdiv(ct * dk, nt)):
                            x: T.let[T.int32] = e * nt + tx
                            if x < ct * dk:
                                st[x // dk * kst + x % dk] = pool[
                                    slot, layer, h, col0 + x // dk, x % dk
                                ]
                for ch in T.serial((length + c - 1) // c):
                    t0: T.let[T.int32] = start + ch * c
                    n_valid: T.let[T.int32] = T.min(c, length - ch * c)
                    # Phase 1: the chunk's keys, queries, cumulative decays and betas; rows past
                    # the sequence's end are zero (beta 0, decay 1), so they change nothing.
                    for tx in lanes():
                        with T.sblock("load_chunk"):
                            T.reads()
                            T.writes()
                            cum = T.sblock_alloc_buffer((1,), scope="local")
                            for e in T.serial(_cdiv(c * dk, nt)):
                                x: T.let[T.int32] = e * nt + tx
                                if x < c * dk:
                                    tok: T.let[T.int32] = t0 + T.min(x // dk, n_valid - 1)
                                    ks[x // dk * kst + x % dk] = T.if_then_else(
                                        x // dk < n_valid, k[tok, kh, x % dk], 0.0
                                    )
                                    qs[x // dk * kst + x % dk] = T.if_then_else(
                                        x // dk < n_valid, q[tok, kh, x % dk], 0.0
                                    )
                            for e in T.serial(_cdiv(c, nt)):
                                i: T.let[T.int32] = e * nt + tx
                                if i < c:
                                    cum[0] = T.float32(0)
                                    # fixed trip count, clamped loads: the loads pipeline
                                    for j in T.serial(c):
                                        cum[0] = cum[0] + T.Select(
                                            j <= T.min(i, n_valid - 1),
                                            g[t0 + T.min(j, n_valid - 1), h],
                                            T.float32(0),
                                        )
                                    gs[i] = cum[0]
                                    bs[i] = T.if_then_else(
                                        i < n_valid, beta[t0 + T.min(i, n_valid - 1), h], 0.0
                                    )
                    # Each phase below reads shared memory into registers, then only writes:
                    # TVM plans barriers as if all dynamic shared memory were one buffer, and a
                    # barrier between a read and a write must not fall inside a condition.
                    # Phase 2: A (strictly lower) and the causal, decayed QKᵀ (lower).
                    for tx in lanes():
                        with T.sblock("kk_qk"):
                            T.reads()
                            T.writes()
                            acc_a = T.sblock_alloc_buffer((a_tm * a_tn,), scope="local")
                            acc_q = T.sblock_alloc_buffer((a_tm * a_tn,), scope="local")
                            ra = T.sblock_alloc_buffer((a_tm,), scope="local")
                            rq = T.sblock_alloc_buffer((a_tm,), scope="local")
                            rb = T.sblock_alloc_buffer((a_tn,), scope="local")
                            gi = T.sblock_alloc_buffer((a_tm,), scope="local")
                            bi = T.sblock_alloc_buffer((a_tm,), scope="local")
                            gj = T.sblock_alloc_buffer((a_tn,), scope="local")
                            for e in T.serial(a_rep):
                                ti: T.let[T.int32] = (e * nt + tx) // a_nt
                                tj: T.let[T.int32] = (e * nt + tx) % a_nt
                                if e * nt + tx < a_mt * a_nt:
                                    zero(acc_a, a_tm * a_tn)
                                    zero(acc_q, a_tm * a_tn)
                                    for d in T.serial(dk):
                                        for r in T.unroll(a_tm):
                                            ra[r] = ks[(r * a_mt + ti) * kst + d]
                                            rq[r] = qs[(r * a_mt + ti) * kst + d]
                                        for s in T.unroll(a_tn):
                                            rb[s] = ks[(s * a_nt + tj) * kst + d]
                                        outer(acc_a, ra, rb, a_tm, a_tn)
                                        outer(acc_q, rq, rb, a_tm, a_tn)
                                    for r in T.unroll(a_tm):
                                        gi[r] = gs[r * a_mt + ti]
                                        bi[r] = bs[r * a_mt + ti]
                                    for s in T.unroll(a_tn):
                                        gj[s] = gs[s * a_nt + tj]
                                for r in T.unroll(a_tm):
                                    for s in T.unroll(a_tn):
                                        if e * nt + tx < a_mt * a_nt:
                                            i: T.let[T.int32] = r * a_mt + ti
                                            j: T.let[T.int32] = s * a_nt + tj
                                            # min(., 0): the masked-out half never overflows
                                            decay: T.let[T.float32] = T.exp(T.min(gi[r] - gj[s], 0))
                                            am[i * ast + j] = T.if_then_else(
                                                j < i, bi[r] * decay * acc_a[r * a_tn + s], 0.0
                                            )
                                            qk[i * ast + j] = T.if_then_else(
                                                j <= i, decay * acc_q[r * a_tn + s], 0.0
                                            )
                    # Phase 3: right-hand sides beta_i (v_i - exp(G_i) S0 k_i).
                    for tx in lanes():
                        with T.sblock("residual"):
                            T.reads()
                            T.writes()
                            acc = T.sblock_alloc_buffer((r_tm * r_tn,), scope="local")
                            ra = T.sblock_alloc_buffer((r_tm,), scope="local")
                            rb = T.sblock_alloc_buffer((r_tn,), scope="local")
                            gi = T.sblock_alloc_buffer((r_tm,), scope="local")
                            bi = T.sblock_alloc_buffer((r_tm,), scope="local")
                            for e in T.serial(r_rep):
                                ti: T.let[T.int32] = (e * nt + tx) // r_nt
                                tj: T.let[T.int32] = (e * nt + tx) % r_nt
                                if e * nt + tx < r_mt * r_nt:
                                    zero(acc, r_tm * r_tn)
                                    for d in T.serial(dk):
                                        for r in T.unroll(r_tm):
                                            ra[r] = ks[(r * r_mt + ti) * kst + d]
                                        for s in T.unroll(r_tn):
                                            rb[s] = st[(s * r_nt + tj) * kst + d]
                                        outer(acc, ra, rb, r_tm, r_tn)
                                    for r in T.unroll(r_tm):
                                        gi[r] = T.exp(gs[r * r_mt + ti])
                                        bi[r] = bs[r * r_mt + ti]
                                for r in T.unroll(r_tm):
                                    for s in T.unroll(r_tn):
                                        if e * nt + tx < r_mt * r_nt:
                                            i: T.let[T.int32] = r * r_mt + ti
                                            cc: T.let[T.int32] = s * r_nt + tj
                                            vi: T.let[T.float32] = v[
                                                t0 + T.min(i, n_valid - 1), h, col0 + cc
                                            ]
                                            us[i * ust + cc] = bi[r] * (
                                                vi - gi[r] * acc[r * r_tn + s]
                                            )
                    # Phase 4: U = (I + A)^-1 R, SB rows at a time.
                    for blk_row in T.serial(c // sb):
                        r0: T.let[T.int32] = blk_row * sb
                        # the block's right-hand sides minus the solved rows above it
                        for tx in lanes():
                            with T.sblock("solve_off"):
                                T.reads()
                                T.writes()
                                acc = T.sblock_alloc_buffer((s_tm * s_tn,), scope="local")
                                ra = T.sblock_alloc_buffer((s_tm,), scope="local")
                                rb = T.sblock_alloc_buffer((s_tn,), scope="local")
                                for e in T.serial(s_rep):
                                    ti: T.let[T.int32] = (e * nt + tx) // s_nt
                                    tj: T.let[T.int32] = (e * nt + tx) % s_nt
                                    if e * nt + tx < s_mt * s_nt:
                                        zero(acc, s_tm * s_tn)
                                        for j in T.serial(r0):
                                            for r in T.unroll(s_tm):
                                                ra[r] = am[(r0 + r * s_mt + ti) * ast + j]
                                            for s in T.unroll(s_tn):
                                                rb[s] = us[j * ust + s * s_nt + tj]
                                            outer(acc, ra, rb, s_tm, s_tn)
                                        for r in T.unroll(s_tm):
                                            for s in T.unroll(s_tn):
                                                acc[r * s_tn + s] = (
                                                    us[(r0 + r * s_mt + ti) * ust + s * s_nt + tj]
                                                    - acc[r * s_tn + s]
                                                )
                                    for r in T.unroll(s_tm):
                                        for s in T.unroll(s_tn):
                                            if e * nt + tx < s_mt * s_nt:
                                                rs[(r * s_mt + ti) * ust + s * s_nt + tj] = acc[
                                                    r * s_tn + s
                                                ]
                        # the diagonal block, one value column per thread, in registers
                        for tx in lanes():
                            with T.sblock("solve_diag"):
                                T.reads()
                                T.writes()
                                uu = T.sblock_alloc_buffer((sb,), scope="local")
                                for e in T.serial(_cdiv(ct, nt)):
                                    if e * nt + tx < ct:
                                        for ii in T.unroll(sb):
                                            uu[ii] = rs[ii * ust + e * nt + tx]
                                            for jj in T.unroll(sb):
                                                if jj < ii:
                                                    uu[ii] -= am[(r0 + ii) * ast + r0 + jj] * uu[jj]
                                    for ii in T.unroll(sb):
                                        if e * nt + tx < ct:
                                            us[(r0 + ii) * ust + e * nt + tx] = uu[ii]
                    # Phase 5: outputs, from the incoming state and within the chunk.
                    for tx in lanes():
                        with T.sblock("output"):
                            T.reads()
                            T.writes()
                            acc = T.sblock_alloc_buffer((r_tm * r_tn,), scope="local")
                            acc2 = T.sblock_alloc_buffer((r_tm * r_tn,), scope="local")
                            ra = T.sblock_alloc_buffer((r_tm,), scope="local")
                            rb = T.sblock_alloc_buffer((r_tn,), scope="local")
                            for e in T.serial(r_rep):
                                ti: T.let[T.int32] = (e * nt + tx) // r_nt
                                tj: T.let[T.int32] = (e * nt + tx) % r_nt
                                if e * nt + tx < r_mt * r_nt:
                                    zero(acc, r_tm * r_tn)
                                    zero(acc2, r_tm * r_tn)
                                    for d in T.serial(dk):
                                        for r in T.unroll(r_tm):
                                            ra[r] = qs[(r * r_mt + ti) * kst + d]
                                        for s in T.unroll(r_tn):
                                            rb[s] = st[(s * r_nt + tj) * kst + d]
                                        outer(acc, ra, rb, r_tm, r_tn)
                                    for j in T.serial(c):
                                        for r in T.unroll(r_tm):
                                            ra[r] = qk[(r * r_mt + ti) * ast + j]
                                        for s in T.unroll(r_tn):
                                            rb[s] = us[j * ust + s * r_nt + tj]
                                        outer(acc2, ra, rb, r_tm, r_tn)
                                    for r in T.unroll(r_tm):
                                        i: T.let[T.int32] = r * r_mt + ti
                                        if i < n_valid:
                                            ge: T.let[T.float32] = T.exp(gs[i])
                                            for s in T.unroll(r_tn):
                                                o: T.let[T.float32] = (
                                                    ge * acc[r * r_tn + s] + acc2[r * r_tn + s]
                                                )
                                                out[t0 + i, h, col0 + s * r_nt + tj] = o * scale
                    # Phase 6: S <- exp(G_last) S + sum_j exp(G_last - G_j) u_j k_jᵀ.
                    for tx in lanes():
                        with T.sblock("update"):
                            T.reads()
                            T.writes()
                            acc = T.sblock_alloc_buffer((u_tm * u_tn,), scope="local")
                            ra = T.sblock_alloc_buffer((u_tm,), scope="local")
                            rb = T.sblock_alloc_buffer((u_tn,), scope="local")
                            for e in T.serial(u_rep):
                                ti: T.let[T.int32] = (e * nt + tx) // u_nt
                                tj: T.let[T.int32] = (e * nt + tx) % u_nt
                                if e * nt + tx < u_mt * u_nt:
                                    zero(acc, u_tm * u_tn)
                                    for j in T.serial(c):
                                        w: T.let[T.float32] = T.exp(gs[c - 1] - gs[j])
                                        for r in T.unroll(u_tm):
                                            ra[r] = us[j * ust + r * u_mt + ti] * w
                                        for s in T.unroll(u_tn):
                                            rb[s] = ks[j * kst + s * u_nt + tj]
                                        outer(acc, ra, rb, u_tm, u_tn)
                                    for r in T.unroll(u_tm):
                                        for s in T.unroll(u_tn):
                                            acc[r * u_tn + s] += (
                                                T.exp(gs[c - 1])
                                                * st[(r * u_mt + ti) * kst + s * u_nt + tj]
                                            )
                                for r in T.unroll(u_tm):
                                    for s in T.unroll(u_tn):
                                        if e * nt + tx < u_mt * u_nt:
                                            st[(r * u_mt + ti) * kst + s * u_nt + tj] = acc[
                                                r * u_tn + s
                                            ]
                for tx in lanes():
                    with T.sblock("store_state"):
                        T.reads()
                        T.writes()
                        for e in T.serial(_cdiv(ct * dk, nt)):
                            x: T.let[T.int32] = e * nt + tx
                            if x < ct * dk:
                                pool[slot, layer, h, col0 + x // dk, x % dk] = st[
                                    x // dk * kst + x % dk
                                ]

    return gdn_chunked_delta_rule
