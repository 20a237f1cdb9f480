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
shared memory were one buffer. Index maps are plain functions so that the numpy emulation in
tests/test_gdn_mma_emulated.py runs the very same arithmetic.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.tirx import PrimFunc

from .ptx import ldmatrix_x4, mma_bf16

DTYPE = "bfloat16"
WARPS = 8
FPAD = 4  # row padding of fp32 shared tiles (keeps 16-byte rows aligned)


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


def shared_bytes(c: int, ct: int, dk: int) -> int:
    bf16 = (2 * c + ct) * dk + 2 * c * c + 2 * c * ct
    fp32 = c * (c + FPAD) + 2 * c * (ct + FPAD) + 2 * c
    return 2 * bf16 + 4 * fp32


def gdn_chunked_mma(
    k_heads: int, v_heads: int, dk: int, dv: int, chunk: int = 64, col_tile: int = 128
) -> PrimFunc:
    """The kernel; `col_tile` value columns a block (a divisor of dv, a multiple of 64)."""
    c, ct, group, nt = chunk, col_tile, v_heads // k_heads, WARPS * 32
    if c % 16 or c > 128 or dv % ct or ct % 64 or dk % 64 or v_heads % k_heads:
        raise ValueError(f"chunk {c} (16 | C <= 128), col_tile {ct} (64 | ct | dv), dk {dk}")
    scale = float(dk) ** -0.5
    tiles = dv // ct
    fc, ft = c + FPAD, ct + FPAD  # fp32 row strides of [., C] and [., ct] tiles
    sh = "shared.dyn"
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

    @T.macro
    def solve_off(blk16, ab, ub, rs, acc, af, bf, rg, warp, lane):
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
            for i in T.unroll(8):
                er, ec = T.meta_var(acc_rc(lane, i % 4))
                if jb * WARPS + warp < sv_pairs:
                    rs[(r0 + er) * ft + p * 16 + i // 4 * 8 + ec] = rg[i] - acc[i]

    @T.macro
    def solve_diag(blk16, am, rs, gs, ub, wub, uu, rg, tx):
        # the 16x16 diagonal block, a value column a thread, fp32 in registers (every thread
        # reads, so that only the writes sit under a condition)
        r0: T.let[T.int32] = blk16 * 16
        col: T.let[T.int32] = tx % ct
        for i in T.unroll(16):
            uu[i] = rs[(r0 + i) * ft + col]
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
        for blk in T.thread_binding(batch * v_heads * tiles, thread="blockIdx.x"):
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                with T.sblock("gdn_mma"):
                    T.reads()
                    T.writes()
                    kqs = T.sblock_alloc_buffer(((2 * c + ct) * dk,), DTYPE, scope=sh)
                    ab = T.sblock_alloc_buffer((c * c,), DTYPE, scope=sh)
                    qkb = T.sblock_alloc_buffer((c * c,), DTYPE, scope=sh)
                    ub = T.sblock_alloc_buffer((c * ct,), DTYPE, scope=sh)
                    wub = T.sblock_alloc_buffer((c * ct,), DTYPE, scope=sh)
                    am = T.sblock_alloc_buffer((c * fc,), "float32", scope=sh)
                    rs = T.sblock_alloc_buffer((c * ft,), "float32", scope=sh)
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
                    for i in T.unroll(s_ng * 4):
                        sr, sc = T.meta_var(acc_rc(lane, i % 4))
                        kqs[swz(2 * c + smt * 16 + sr, (sn0 + i // 4) * 8 + sc, dk)] = T.Cast(
                            DTYPE, st[i]
                        )
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
                        if tx < c:
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
                                    rs[ri * ft + col - c] = bi[i % 4 // 2] * (
                                        vi - T.exp(g_i) * acc[i]
                                    )
                                else:  # Q Sᵀ -> e^G Q Sᵀ
                                    os_[ri * ft + col - c] = T.exp(g_i) * acc[i]
                        T.tvm_storage_sync("shared.dyn")
                        # 3. (I + A) U = R, 16 rows at a time
                        solve_diag(0, am, rs, gs, ub, wub, uu, rg, tx)
                        T.tvm_storage_sync("shared.dyn")
                        for blk16 in T.unroll(1, c // 16):
                            solve_off(blk16, ab, ub, rs, acc, af, bf, rg, warp, lane)
                            T.tvm_storage_sync("shared.dyn")
                            solve_diag(blk16, am, rs, gs, ub, wub, uu, rg, tx)
                            T.tvm_storage_sync("shared.dyn")
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
                            for kk in T.unroll(c // 16):
                                ar, ac = T.meta_var(a_lane(lane, kk, False))
                                T.evaluate(ldmatrix_x4(af, 0, qkb, swz(mt * 16 + ar, ac, c)))
                                for np_ in T.unroll(o_ng // 2):
                                    br, bc = T.meta_var(b_lane(lane, kk, True))
                                    T.evaluate(ldmatrix_x4(
                                        bf, 0, ub, swz(br, (n0 + np_ * 2) * 8 + bc, ct), True
                                    ))  # fmt: skip
                                    for h2 in T.unroll(2):
                                        T.evaluate(mma_bf16(
                                            af.data, 0, bf.data, h2 * 4, acc.data,
                                            (np_ * 2 + h2) * 4,
                                        ))  # fmt: skip
                            for i in T.unroll(o_ng * 4):
                                er, ec = T.meta_var(acc_rc(lane, i % 4))
                                if mt * 16 + er < nv:
                                    out[t0 + mt * 16 + er, h, col0 + (n0 + i // 4) * 8 + ec] = acc[
                                        i
                                    ] * T.float32(scale)
                        # S's bf16 copy (its rows of kqs are not read in this phase)
                        for i in T.unroll(s_ng * 4):
                            sr, sc = T.meta_var(acc_rc(lane, i % 4))
                            kqs[swz(2 * c + smt * 16 + sr, (sn0 + i // 4) * 8 + sc, dk)] = T.Cast(
                                DTYPE, st[i]
                            )
                    for i in T.unroll(s_ng * 4):
                        sr, sc = T.meta_var(acc_rc(lane, i % 4))
                        pool[slot, layer, h, col0 + smt * 16 + sr, (sn0 + i // 4) * 8 + sc] = st[i]

    return gdn_chunked_mma_kernel
