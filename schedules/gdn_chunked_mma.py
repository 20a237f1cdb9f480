"""The chunked gated delta rule on tensor cores (CUDA sm_80+), for bf16 models' prefill.

The same algorithm, buffers and in-place state pool as `gdn_chunked` (see its docstring), but
every matmul is mma.sync m16n8k16 with bf16 operands and fp32 accumulation. The state stays
fp32 for the whole sequence in the accumulator registers of the state-update matmul (a warp
owns a fixed [16 x n] tile); a bf16 copy in shared memory is the operand of the next chunk's
K Sᵀ and Q Sᵀ. The decays, A's entries and the 16x16 diagonal solves stay fp32; what is
rounded to bf16 (K, Q, S as operands, A and the masked QKᵀ, U) is what HF's bf16 model
computes in its activation dtype (fla's chunked kernels use the same split).

A block owns (sequence, value head, `col_tile` value columns); 8 warps. Per chunk of C tokens:
1. K, Q -> bf16 rows of one shared tile [K; Q; S] (rows XOR-swizzled by 16-byte chunks);
   cumulative decays G and betas in shared memory;
2. one matmul [K; Q] x [K; S]ᵀ gives K Kᵀ, Q Kᵀ, K Sᵀ and Q Sᵀ; its epilogue forms A (fp32
   and bf16), the causal decayed QKᵀ (bf16), R = beta (V - e^G K Sᵀ) and e^G Q Sᵀ (fp32);
3. (I + A) U = R, 16 rows at a time: the rows above on tensor cores, then the diagonal block
   a column a thread in fp32 registers; U and e^(G_last - G) U go to shared memory as bf16;
4. O = e^G Q Sᵀ + QKᵀ U (stored), S <- e^G_last S + (e^(G_last - G) U)ᵀ K (registers), and
   S's bf16 copy for the next chunk.
Each phase reads shared memory before it writes any: TVM plans barriers as if all dynamic
shared memory were one buffer. The index maps are gdn_mma_tiles'.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .gdn_mma_tiles import WARPS, a_lane, acc_rc, b_lane, job_tile, n_group, swz
from .pdl import release_dependents, wait_for_producers
from .ptx import ldmatrix_x4, mma_bf16

DTYPE = "bfloat16"
FULL_MASK = 0xFFFFFFFF
FPAD = 4  # row padding of fp32 shared tiles (keeps 16-byte rows aligned)


def shared_bytes(c: int, ct: int, dk: int) -> int:
    bf16 = (2 * c + ct) * dk + 2 * c * c + 2 * c * ct
    fp32 = c * (c + FPAD) + 2 * c * (ct + FPAD) + 2 * c
    return 2 * bf16 + 4 * fp32


def mma_launch(
    k_heads: int, v_heads: int, dk: int, dv: int, chunk: int, col_tile: int, scan: bool = True
):
    """A macro (q, k, v, g, beta, indptr, slots, pool, layer, out, batch) that launches the
    kernel: `col_tile` value columns a block (a divisor of dv, a multiple of 32). `scan`: the
    chunk's cumulative decays by a warp-shuffle scan of one load a lane; False keeps the first
    version's loop of C dependent loads a thread (the benchmark's baseline). With `scan`,
    every barrier is also explicit (TVM's planner inserts none, so the kernel may sit under a
    host-level `if`) and there are fewer: the solve's buffers (rs, ub, wub) live in static
    shared memory when they fit, which TVM's planner tracks apart from the dynamic one, so a
    phase that reads one kind and writes the other needs no barrier in between; S's bf16 copy
    is written with the next chunk's K and Q, after the barrier that frees them."""
    c, ct, group, nt = chunk, col_tile, v_heads // k_heads, WARPS * 32
    if c % 16 or c > 128 or dv % ct or ct % 32 or dk % 64 or v_heads % k_heads:
        raise ValueError(f"chunk {c} (16 | C <= 128), col_tile {ct} (32 | ct | dv), dk {dk}")
    g_warps = -(-c // 32)  # warps that scan G: 32 tokens each
    scale = float(dk) ** -0.5
    tiles = dv // ct
    fc, ft = c + FPAD, ct + FPAD  # fp32 row strides of [., C] and [., ct] tiles
    sh = "shared.dyn"
    # the solve's buffers: static shared memory (48 KiB at most) in the new version
    small = "shared" if scan and 4 * c * ct + 4 * (c + 16) * (ct + FPAD) <= 48 * 1024 else sh
    # matmul 1: [K; Q] (2C rows) x [K; S]ᵀ (C + ct columns), over dk
    g1_mt, g1_n8 = 2 * c // 16, (c + ct) // 8
    g1_ng = n_group(g1_n8, g1_mt)
    g1_jobs = g1_mt * g1_n8 // g1_ng // WARPS
    # outputs: QKᵀ (C x C) x U (C x ct)
    o_mt, o_n8 = c // 16, ct // 8
    o_ng = n_group(o_n8, o_mt)
    o_jobs = o_mt * o_n8 // o_ng // WARPS
    # state: (wU)ᵀ (ct x C) x K (C x dk): one job a warp, for the whole sequence
    s_mt, s_n8 = ct // 16, dk // 8
    s_ng = s_mt * s_n8 // WARPS
    if s_n8 % s_ng or s_ng % 2:
        raise ValueError(f"state tile {ct} x {dk} does not split into {WARPS} warp tiles")
    # the solve's off-diagonal rows: one n16 pair of U's columns a warp (a spare warp repeats
    # the last pair and stores nothing)
    sv_pairs = ct // 16
    sv_jobs = -(-sv_pairs // WARPS)
    # one copy a thread: K and Q rows (4 floats), the state (acc layout)
    kq_copies = -(-2 * c * dk // nt)
    # at 128 columns TVM's StorageRewrite packs rc into rs's allocation, and then the planner
    # wants a barrier between reading rs and writing rc: an explicit one (C32 t128 compiled)
    off_sync = scan and ct >= 128

    @T.macro
    def solve_off(blk16, ab, ub, rs, rd, rd0, acc, af, bf, rg, warp, lane):
        # rows r0..r0+15 of R -= A[those rows, :r0] U[:r0] (reads all, then writes)
        r0: T.let[T.int32] = blk16 * 16
        for jb in T.unroll(sv_jobs):
            p: T.let[T.int32] = T.min(jb * WARPS + warp, sv_pairs - 1)
            for i in T.unroll(8):
                acc[i] = T.float32(0)
            for kk in T.unroll(c // 16 - 1):
                if kk < blk16:
                    ar, ac = T.meta_var(a_lane(lane, kk, False))
                    T.evaluate(ldmatrix_x4(af, 0, ab, swz(r0 + ar, ac, c)))
                    br, bc = T.meta_var(b_lane(lane, kk, True))
                    T.evaluate(ldmatrix_x4(bf, 0, ub, swz(br, p * 16 + bc, ct), True))
                    for h2 in T.unroll(2):
                        T.evaluate(mma_bf16(af.data, 0, bf.data, h2 * 4, acc.data, h2 * 4))
            for i in T.unroll(8):
                er, ec = T.meta_var(acc_rc(lane, i % 4))
                rg[i] = rs[(r0 + er) * ft + p * 16 + i // 4 * 8 + ec]
            if off_sync:
                T.tvm_storage_sync(small)
            for i in T.unroll(8):
                er, ec = T.meta_var(acc_rc(lane, i % 4))
                if jb * WARPS + warp < sv_pairs:
                    rd[(rd0 + er) * ft + p * 16 + i // 4 * 8 + ec] = rg[i] - acc[i]

    @T.macro
    def solve_diag(blk16, am, rs, rs0, gs, ub, wub, uu, rg, tx):
        # the 16x16 diagonal block, a value column a thread, fp32 in registers (every thread
        # reads, so that only the writes sit under a condition)
        r0: T.let[T.int32] = blk16 * 16
        col: T.let[T.int32] = tx % ct
        for i in T.unroll(16):
            uu[i] = rs[(rs0 + i) * ft + col]
        for jj in T.unroll(16):
            for ii in T.unroll(16):
                if ii > jj:
                    uu[ii] = uu[ii] - am[(r0 + ii) * fc + r0 + jj] * uu[jj]
        for i in T.unroll(16):
            rg[i] = T.exp(gs[c - 1] - gs[r0 + i])
        if tx < ct:
            for i in T.unroll(16):
                ub[swz(r0 + i, col, ct)] = T.Cast(DTYPE, uu[i])
                wub[swz(r0 + i, col, ct)] = T.Cast(DTYPE, rg[i] * uu[i])

    @T.macro
    def tile_mm(a_tile, b_tile, acc, af, bf, mt, n0, lane):
        # acc += a_tile [m16 rows at mt] x b_tile [C x ct, n8 tiles n0..n0+o_ng), over k = C
        for kk in T.unroll(c // 16):
            ar, ac = T.meta_var(a_lane(lane, kk, False))
            T.evaluate(ldmatrix_x4(af, 0, a_tile, swz(mt * 16 + ar, ac, c)))
            for np_ in T.unroll(o_ng // 2):
                br, bc = T.meta_var(b_lane(lane, kk, True))
                T.evaluate(ldmatrix_x4(
                    bf, 0, b_tile, swz(br, (n0 + np_ * 2) * 8 + bc, ct), True
                ))  # fmt: skip
                for h2 in T.unroll(2):
                    T.evaluate(mma_bf16(
                        af.data, 0, bf.data, h2 * 4, acc.data, (np_ * 2 + h2) * 4
                    ))  # fmt: skip

    @T.macro
    def s_copy(kqs, st, smt, sn0, lane):
        # the state's bf16 copy: S's rows of kqs, the operand of K Sᵀ and Q Sᵀ
        for i in T.unroll(s_ng * 4):
            sr, sc = T.meta_var(acc_rc(lane, i % 4))
            kqs[swz(2 * c + smt * 16 + sr, (sn0 + i // 4) * 8 + sc, dk)] = T.Cast(DTYPE, st[i])

    @T.macro
    def scan_g(g, gs, cum, gv, t0, nv, h, warp, lane):
        # G = cumsum of the chunk's log decays (0 past its end): 32 tokens a piece, each an
        # inclusive Hillis-Steele scan over the lanes plus the pieces before; warp w stores
        # piece w. One load a lane instead of a chain of C dependent loads.
        cum[0] = T.float32(0)
        for piece in T.unroll(g_warps):
            j: T.let[T.int32] = piece * 32 + lane
            gv[0] = T.Select(j < nv, g[t0 + T.min(j, nv - 1), h], T.float32(0))
            for s in T.unroll(5):
                gv[1] = T.tvm_warp_shuffle_up(FULL_MASK, gv[0], 1 << s, 32, 32)
                gv[0] = gv[0] + T.Select(lane >= (1 << s), gv[1], T.float32(0))
            gv[0] = gv[0] + cum[0]
            cum[0] = T.tvm_warp_shuffle(FULL_MASK, gv[0], 31, 32, 32)
            if piece == warp and j < c:
                gs[j] = gv[0]

    @T.macro
    def launch(q, k, v, g, beta, indptr, slots, pool, layer, out, batch):
        for blk in T.thread_binding(batch * v_heads * tiles, thread="blockIdx.x"):
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                with T.sblock("gdn_mma"):
                    T.reads()
                    T.writes()
                    kqs = T.sblock_alloc_buffer(((2 * c + ct) * dk,), DTYPE, scope=sh)
                    ab = T.sblock_alloc_buffer((c * c,), DTYPE, scope=sh)
                    qkb = T.sblock_alloc_buffer((c * c,), DTYPE, scope=sh)
                    ub = T.sblock_alloc_buffer((c * ct,), DTYPE, scope=small)
                    wub = T.sblock_alloc_buffer((c * ct,), DTYPE, scope=small)
                    am = T.sblock_alloc_buffer((c * fc,), "float32", scope=sh)
                    rs = T.sblock_alloc_buffer((c * ft,), "float32", scope=small)
                    rc = T.sblock_alloc_buffer((16 * ft,), "float32", scope=small)
                    os_ = T.sblock_alloc_buffer((c * ft,), "float32", scope=sh)
                    gs = T.sblock_alloc_buffer((c,), "float32", scope=sh)
                    bs = T.sblock_alloc_buffer((c,), "float32", scope=sh)
                    st = T.sblock_alloc_buffer((s_ng * 4,), "float32", scope="local")
                    acc = T.sblock_alloc_buffer((max(g1_ng, o_ng, 2) * 4,), "float32",
                                                scope="local")  # fmt: skip
                    af = T.sblock_alloc_buffer((8,), DTYPE, scope="local")
                    bf = T.sblock_alloc_buffer((8,), DTYPE, scope="local")
                    rg = T.sblock_alloc_buffer((16,), "float32", scope="local")
                    gi = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    bi = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    gj = T.sblock_alloc_buffer((g1_ng * 2,), "float32", scope="local")
                    uu = T.sblock_alloc_buffer((16,), "float32", scope="local")
                    cum = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    gv = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    T.evaluate(wait_for_producers(True))  # first: schedules/pdl.py
                    T.evaluate(release_dependents(True))
                    b: T.let[T.int32] = blk // (v_heads * tiles)
                    h: T.let[T.int32] = blk // tiles % v_heads
                    col0: T.let[T.int32] = blk % tiles * ct
                    kh: T.let[T.int32] = h // group
                    start: T.let[T.int32] = indptr[b]
                    length: T.let[T.int32] = indptr[b + 1] - start
                    slot: T.let[T.int32] = slots[b]
                    warp: T.let[T.int32] = tx // 32
                    lane: T.let[T.int32] = tx % 32
                    smt: T.let[T.int32] = warp // (s_n8 // s_ng)  # the warp's state tile
                    sn0: T.let[T.int32] = warp % (s_n8 // s_ng) * s_ng
                    # the state: fp32 in this warp's accumulators, bf16 in S's rows of kqs
                    for i in T.unroll(s_ng * 4):
                        sr, sc = T.meta_var(acc_rc(lane, i % 4))
                        st[i] = pool[slot, layer, h, col0 + smt * 16 + sr, (sn0 + i // 4) * 8 + sc]
                    if not scan:
                        s_copy(kqs, st, smt, sn0, lane)
                    for ch in T.serial((length + c - 1) // c):
                        t0: T.let[T.int32] = start + ch * c
                        nv: T.let[T.int32] = T.min(c, length - ch * c)
                        T.tvm_storage_sync("shared.dyn")
                        # 1. K and Q rows as bf16 (rows past the end zero); G and beta
                        for e in T.unroll(kq_copies):
                            x: T.let[T.int32] = e * nt + tx
                            r: T.let[T.int32] = x // dk % c
                            tok: T.let[T.int32] = t0 + T.min(r, nv - 1)
                            val: T.let[T.float32] = T.if_then_else(
                                x // (c * dk) == 0, k[tok, kh, x % dk], q[tok, kh, x % dk]
                            )
                            if x < 2 * c * dk:
                                kqs[swz(x // dk, x % dk, dk)] = T.Cast(
                                    DTYPE, T.Select(r < nv, val, T.float32(0))
                                )
                        if scan:
                            s_copy(kqs, st, smt, sn0, lane)
                            if warp < g_warps:  # warp-uniform: every lane shuffles
                                scan_g(g, gs, cum, gv, t0, nv, h, warp, lane)
                        if tx < c:
                            if not scan:
                                cum[0] = T.float32(0)
                                for j in T.serial(c):  # fixed trip count, clamped loads
                                    cum[0] = cum[0] + T.Select(
                                        j <= T.min(tx, nv - 1),
                                        g[t0 + T.min(j, nv - 1), h],
                                        T.float32(0),
                                    )
                                gs[tx] = cum[0]
                            bs[tx] = T.Select(
                                tx < nv, beta[t0 + T.min(tx, nv - 1), h], T.float32(0)
                            )
                        T.tvm_storage_sync("shared.dyn")
                        # 2. [K; Q] x [K; S]ᵀ and its epilogue
                        for jb in T.unroll(g1_jobs):
                            mt, n0 = T.meta_var(job_tile(jb * WARPS + warp, g1_ng, g1_n8))
                            for i in T.unroll(g1_ng * 4):
                                acc[i] = T.float32(0)
                            for kk in T.unroll(dk // 16):
                                ar, ac = T.meta_var(a_lane(lane, kk, False))
                                T.evaluate(ldmatrix_x4(af, 0, kqs, swz(mt * 16 + ar, ac, dk)))
                                for np_ in T.unroll(g1_ng // 2):
                                    br, bc = T.meta_var(b_lane(lane, kk, False))
                                    n: T.let[T.int32] = (n0 + np_ * 2) * 8 + br
                                    T.evaluate(ldmatrix_x4(
                                        bf, 0, kqs, swz(n + T.Select(n >= c, c, 0), bc, dk)
                                    ))  # fmt: skip
                                    for h2 in T.unroll(2):
                                        T.evaluate(mma_bf16(
                                            af.data, 0, bf.data, h2 * 4,
                                            acc.data, (np_ * 2 + h2) * 4,
                                        ))  # fmt: skip
                            # reads (G, beta) before any shared write
                            for hr in T.unroll(2):
                                gi[hr] = gs[(mt * 16 + lane // 4 + hr * 8) % c]
                                bi[hr] = bs[(mt * 16 + lane // 4 + hr * 8) % c]
                            for i in T.unroll(g1_ng * 2):
                                gj[i] = gs[T.min((n0 + i // 2) * 8 + lane % 4 * 2 + i % 2, c - 1)]
                            if scan:  # where the planner would put them
                                T.tvm_storage_sync("shared.dyn")
                            for i in T.unroll(g1_ng * 4):
                                er, ec = T.meta_var(acc_rc(lane, i % 4))
                                row: T.let[T.int32] = mt * 16 + er
                                col: T.let[T.int32] = (n0 + i // 4) * 8 + ec
                                ri: T.let[T.int32] = row % c
                                g_i: T.let[T.float32] = gi[i % 4 // 2]
                                if col < c:  # K Kᵀ -> A, Q Kᵀ -> causal QKᵀ
                                    # min(., 0): the masked-out half never overflows
                                    dec: T.let[T.float32] = T.exp(
                                        T.min(g_i - gj[i // 4 * 2 + i % 2], T.float32(0))
                                    )
                                    if row < c:
                                        a_: T.let[T.float32] = T.Select(
                                            col < ri, bi[i % 4 // 2] * dec * acc[i], T.float32(0)
                                        )
                                        am[ri * fc + col] = a_
                                        ab[swz(ri, col, c)] = T.Cast(DTYPE, a_)
                                    else:
                                        qkb[swz(ri, col, c)] = T.Cast(
                                            DTYPE, T.Select(col <= ri, dec * acc[i], T.float32(0))
                                        )
                                elif row < c:  # K Sᵀ -> R = beta (V - e^G K Sᵀ)
                                    vi: T.let[T.float32] = v[
                                        t0 + T.min(ri, nv - 1), h, col0 + col - c
                                    ]
                                    r_: T.let[T.float32] = bi[i % 4 // 2] * (
                                        vi - T.exp(g_i) * acc[i]
                                    )
                                    rs[ri * ft + col - c] = r_
                                else:  # Q Sᵀ -> e^G Q Sᵀ
                                    os_[ri * ft + col - c] = T.exp(g_i) * acc[i]
                            if scan and jb + 1 < g1_jobs:
                                T.tvm_storage_sync("shared.dyn")
                        T.tvm_storage_sync("shared.dyn")
                        if small != sh:
                            T.tvm_storage_sync(small)
                        # 3. (I + A) U = R, 16 rows at a time
                        solve_diag(0, am, rs, 0, gs, ub, wub, uu, rg, tx)
                        T.tvm_storage_sync(small)
                        for blk16 in T.unroll(1, c // 16):
                            if scan:  # rows to rc: the planner sees no read-then-write of rs
                                solve_off(blk16, ab, ub, rs, rc, 0, acc, af, bf, rg, warp, lane)
                                T.tvm_storage_sync(small)
                                solve_diag(blk16, am, rc, 0, gs, ub, wub, uu, rg, tx)
                            else:
                                solve_off(
                                    blk16, ab, ub, rs, rs, blk16 * 16, acc, af, bf, rg, warp, lane
                                )
                                T.tvm_storage_sync(small)
                                solve_diag(blk16, am, rs, blk16 * 16, gs, ub, wub, uu, rg, tx)
                            T.tvm_storage_sync(small)
                        # 4. outputs, and the state update
                        for i in T.unroll(s_ng * 4):
                            st[i] = st[i] * T.exp(gs[c - 1])
                        for kk in T.unroll(c // 16):
                            ar, ac = T.meta_var(a_lane(lane, kk, True))
                            T.evaluate(ldmatrix_x4(af, 0, wub, swz(ar, smt * 16 + ac, ct), True))
                            for np_ in T.unroll(s_ng // 2):
                                br, bc = T.meta_var(b_lane(lane, kk, True))
                                T.evaluate(ldmatrix_x4(
                                    bf, 0, kqs, swz(br, (sn0 + np_ * 2) * 8 + bc, dk), True
                                ))  # fmt: skip
                                for h2 in T.unroll(2):
                                    T.evaluate(mma_bf16(
                                        af.data, 0, bf.data, h2 * 4, st.data, (np_ * 2 + h2) * 4
                                    ))  # fmt: skip
                        for jb in T.unroll(o_jobs):
                            mt, n0 = T.meta_var(job_tile(jb * WARPS + warp, o_ng, o_n8))
                            for i in T.unroll(o_ng * 4):
                                er, ec = T.meta_var(acc_rc(lane, i % 4))
                                acc[i] = os_[(mt * 16 + er) * ft + (n0 + i // 4) * 8 + ec]
                            tile_mm(qkb, ub, acc, af, bf, mt, n0, lane)
                            for i in T.unroll(o_ng * 4):
                                er, ec = T.meta_var(acc_rc(lane, i % 4))
                                if mt * 16 + er < nv:
                                    out[t0 + mt * 16 + er, h, col0 + (n0 + i // 4) * 8 + ec] = acc[
                                        i
                                    ] * T.float32(scale)
                        if not scan:  # S's bf16 copy (its rows of kqs are not read here)
                            s_copy(kqs, st, smt, sn0, lane)
                    for i in T.unroll(s_ng * 4):
                        sr, sc = T.meta_var(acc_rc(lane, i % 4))
                        pool[slot, layer, h, col0 + smt * 16 + sr, (sn0 + i // 4) * 8 + sc] = st[i]

    return launch
