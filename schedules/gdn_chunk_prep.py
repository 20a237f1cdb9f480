"""Prefill's chunked GDN, first pass (CUDA sm_80+, tensor cores): what each chunk needs from
the state-free half of the algorithm, for every chunk of every sequence at once.

With the notation of `gdn_chunked`, a chunk's update U solves (I + A) U = beta (V - e^G K Sᵀ).
The solve is linear, so U = U0 - W Sᵀ, where (I + A) U0 = beta V and (I + A) W = beta e^G K
depend on no state. This pass computes, per (chunk, value head), in one block of 8 warps (or
per (chunk, key head), the key head's value heads one after another: `heads`):
- the chunk's q, k and v from in_proj's rows, as gdn_prep.gdn_input makes them (causal conv1d
  over the slot's conv history, SiLU, l2 norms summed in its order) and its gates g and beta:
  no kernel of its own and no fp32 round trip between the two (with `heads`, q and k's loads,
  conv and norms once for the key head's value heads);
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

from .gdn_chunk_ops import conv_window, decay_scan, warp_mm
from .gdn_mma_tiles import WARPS, a_lane, acc_rc, b_lane, job_tile, n_group, swz
from .gdn_prep import beta_gate, conv_silu, l2_parts
from .kv_cache import first_tile, seq_of_tile
from .pdl import release_dependents, wait_for_producers
from .ptx import ldmatrix_x4, mma_bf16

DTYPE = "bfloat16"
FPAD = 4  # row padding of fp32 shared tiles (keeps 16-byte rows aligned)
THREADS = WARPS * 32
MAX_BLOCKS_PER_SM = 3  # at 80 registers a thread (ptxas spills little); 85 at most


def workspace_rows(n_tok, n_seq, chunk: int):
    """Rows of the chunk-indexed workspace: every chunk number `first_tile` can give."""
    return (n_tok // chunk + n_seq) * chunk


def prep_shared_bytes(c: int, dk: int, dv: int) -> tuple[int, int]:
    """(dynamic, static) shared memory of a block."""
    rw, part = dk + dv, -(-2 * c * l2_parts(dk, dv) // THREADS) * THREADS  # the norms' partials
    dyn = 2 * 2 * c * dk + 4 * (c * (c + FPAD + rw + FPAD) + part)
    return dyn, 2 * (c * c + c * rw) + 4 * 4 * c  # ..., G, beta, 1/norm of K and Q


def blocks_per_sm(c: int, dk: int, dv: int, smem_bytes: int) -> int:
    """Blocks an SM holds, by shared memory, up to MAX_BLOCKS_PER_SM: ptxas is told, so that
    it keeps to their registers (left to itself, the conv's loads in flight take 95 a thread
    at C = 32 and two blocks an SM where three fit)."""
    return max(1, min(MAX_BLOCKS_PER_SM, smem_bytes // sum(prep_shared_bytes(c, dk, dv))))


def chunked_here(length, skip_single: bool):
    """Whether a sequence of `length` tokens is the chunked rule's: every one, or with
    `skip_single` those of more than one token (a prefill's one-token sequences take
    gdn_decode's ragged kernel). Block-uniform, so barriers may sit under it."""
    return True if not skip_single else length != 1


def chunk_prep(
    k_heads: int,
    v_heads: int,
    dk: int,
    dv: int,
    chunk: int,
    kernel: int,
    blocks: int = 1,
    skip_single: bool = False,
    heads: int = 1,
    interior_loads: bool = False,
) -> PrimFunc:
    """(proj [n_tok, width], conv weight [conv_dim, kernel], A_log, dt_bias, indptr, slots,
    conv pool (read only), layer) -> (K, Q bf16 [rows, k_heads, dk]; W bf16 [rows, v_heads,
    dk]; U0 bf16 [rows, v_heads, dv]; P bf16 [rows, v_heads, chunk]; G fp32 [v_heads, rows]),
    rows = workspace_rows(n_tok, n_seq, chunk). proj, the weights and the pool are in_proj's
    and gdn_input's (gdn_prep). `blocks`: blocks an SM, for ptxas (`blocks_per_sm`).
    `skip_single`: the blocks of one-token sequences exit (`chunked_here`). `heads`: value
    heads a block takes in turn, 1 or a key head's all (v_heads // k_heads), which then load,
    convolve and norm q and k once for them all. `interior_loads`: a full chunk whose conv
    history is its sequence's own rows loads its conv inputs without clamps or selects."""
    c, group, nt = chunk, v_heads // k_heads, THREADS
    if heads not in (1, group):
        raise ValueError(f"heads {heads}: a block takes one value head or its key head's {group}")
    per_chunk = v_heads // heads  # blocks a chunk
    rw = dk + dv  # R's columns
    if c % 16 or c > 128 or dk % 64 or dv % 16 or v_heads % k_heads or rw > nt or nt % dk:
        raise ValueError(f"chunk {c} (16 | C <= 128), dk {dk} (64 | dk | {nt}), dk + dv <= {nt}")
    if prep_shared_bytes(c, dk, dv)[1] > 48 * 1024:
        raise ValueError(f"chunk {c}: A and X in bf16 exceed 48 KiB of static shared memory")
    fc, fr = c + FPAD, rw + FPAD
    sh = "shared.dyn"
    hist = kernel - 1
    key_dim, value_dim = k_heads * dk, v_heads * dv
    conv_dim = 2 * key_dim + value_dim
    width = conv_dim + value_dim + 2 * v_heads
    # A thread convolves one channel of k (tx < dk) or v (dk <= tx < rw) over the whole chunk,
    # and one of q over a 1/q_pieces of it.
    q_pieces = nt // dk
    q_len = c // q_pieces
    parts = l2_parts(dk, dv)  # gdn_input's order of an l2 norm's sum
    if dk % parts or nt % parts:
        raise ValueError(f"dk {dk}: the l2 norms' {parts} partial sums must split it evenly")
    part_rounds = -(-2 * c * parts // nt)  # partial sums a thread
    # [K; Q] (2C rows) x Kᵀ (C columns), over dk
    g1_mt, g1_n8 = 2 * c // 16, c // 8
    g1_ng = n_group(g1_n8, g1_mt)
    g1_jobs = g1_mt * g1_n8 // g1_ng // WARPS
    # the solve's off-diagonal rows: one n16 pair of R's columns a warp job
    sv_pairs = rw // 16
    sv_jobs = -(-sv_pairs // WARPS)

    def v_chan(h, tx):  # the conv channel of value head h's column of a thread tx >= dk
        return 2 * key_dim + h * dv + T.min(tx - dk, dv - 1)

    @T.macro
    def gates(x, a_log, dt_bias, gs, bs, gc, cum, gv, t0, nv, h, row0, warp, lane, tx):
        # value head h's cumulative log decays G (to gs and the workspace) and betas (to bs)
        if warp < -(-c // 32):  # warp-uniform: every lane shuffles
            decay_scan(x, conv_dim + value_dim + v_heads + h, a_log, dt_bias, gs, gc, cum, gv,
                       t0, nv, h, row0, warp, lane, c)  # fmt: skip
        if tx < c:
            bs[tx] = beta_gate(
                T.Cast("float32", x[t0 + T.min(tx, nv - 1), conv_dim + value_dim + h])
            ) * T.Cast("float32", tx < nv)

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
        x_h: T.handle,
        cw_h: T.handle,
        a_log_h: T.handle,
        dt_bias_h: T.handle,
        indptr_h: T.handle,
        slots_h: T.handle,
        pool_h: T.handle,
        layer: T.int32,
        kb_h: T.handle,
        qb_h: T.handle,
        w_h: T.handle,
        u_h: T.handle,
        p_h: T.handle,
        gc_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n_tok, n_ptr, n_rows, batch = T.int32(), T.int32(), T.int32(), T.int32()
        n_slots, n_layers = T.int32(), T.int32()
        x = T.match_buffer(x_h, (n_tok, width), DTYPE)
        cw = T.match_buffer(cw_h, (conv_dim, kernel), DTYPE)
        a_log = T.match_buffer(a_log_h, (v_heads,), "float32")
        dt_bias = T.match_buffer(dt_bias_h, (v_heads,), "float32")
        indptr = T.match_buffer(indptr_h, (n_ptr,), "int32")
        slots = T.match_buffer(slots_h, (batch,), "int32")
        pool = T.match_buffer(pool_h, (n_slots, n_layers, conv_dim, hist), DTYPE)
        kb = T.match_buffer(kb_h, (n_rows, k_heads, dk), DTYPE)
        qb = T.match_buffer(qb_h, (n_rows, k_heads, dk), DTYPE)
        w = T.match_buffer(w_h, (n_rows, v_heads, dk), DTYPE)
        u = T.match_buffer(u_h, (n_rows, v_heads, dv), DTYPE)
        p = T.match_buffer(p_h, (n_rows, v_heads, c), DTYPE)
        gc = T.match_buffer(gc_h, (v_heads, n_rows), "float32")
        for blk in T.thread_binding(n_rows // c * per_chunk, thread="blockIdx.x"):
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                with T.sblock("gdn_chunk_prep"):
                    T.reads()
                    T.writes()
                    T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", blocks)
                    kq = T.sblock_alloc_buffer((2 * c * dk,), DTYPE, scope=sh)
                    part = T.sblock_alloc_buffer((part_rounds * nt,), "float32", scope=sh)
                    inv = T.sblock_alloc_buffer((2 * c,), "float32", scope="shared")
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
                    mw = T.sblock_alloc_buffer((c + hist,), "float32", scope="local")
                    qw = T.sblock_alloc_buffer((q_len + hist,), "float32", scope="local")
                    wm = T.sblock_alloc_buffer((kernel,), "float32", scope="local")
                    wq = T.sblock_alloc_buffer((kernel,), "float32", scope="local")
                    sq = T.sblock_alloc_buffer((part_rounds,), "float32", scope="local")
                    rg = T.sblock_alloc_buffer((sv_jobs * 8,), "float32", scope="local")
                    uu = T.sblock_alloc_buffer((16,), "float32", scope="local")
                    cum = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    gv = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    lo = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    hi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    seq = T.sblock_alloc_buffer((3,), "int32", scope="local")
                    T.evaluate(wait_for_producers(True))  # first: schedules/pdl.py
                    cno: T.let[T.int32] = blk // per_chunk
                    h0: T.let[T.int32] = blk % per_chunk * heads  # the block's first value head
                    kh: T.let[T.int32] = h0 // group
                    warp: T.let[T.int32] = tx // 32
                    lane: T.let[T.int32] = tx % 32
                    seq_of_tile(indptr, n_ptr - 1, cno, c, lo, hi)
                    # What depends on the search is stored, never let-bound (TVM's shared memory
                    # planner refuses a local buffer read by a let at the kernel's top). A chunk
                    # number no sequence has computes a token's chunk into rows no one reads: no
                    # branch around the barriers below.
                    seq[0] = indptr[lo[0]]
                    seq[1] = slots[lo[0]]
                    if skip_single:
                        seq[2] = indptr[lo[0] + 1] - indptr[lo[0]]
                    lo[0] = T.min(
                        indptr[lo[0]] + (cno - first_tile(indptr, lo[0], c)) * c, n_tok - 1
                    )
                    hi[0] = T.max(T.min(c, indptr[hi[0]] - lo[0]), 1)
                    t0 = T.meta_var(lo[0])
                    nv = T.meta_var(hi[0])
                    row0: T.let[T.int32] = cno * c
                    # this thread's k channel (tx < dk) or the first value head's v channel
                    mc = T.meta_var(T.Select(tx < dk, key_dim + kh * dk + tx, v_chan(h0, tx)))
                    qc = T.meta_var(kh * dk + tx % dk)
                    q0 = T.meta_var(tx // dk * q_len)  # the chunk's first token of its q piece
                    # 1. The conv inputs, unconditional loads (k's or the first value head's v
                    # all in flight, then q's): chunk token i (i < 0: earlier tokens of the
                    # sequence, else its conv history in the pool; past the chunk's end the last
                    # token again, zeroed below).
                    if chunked_here(seq[2], skip_single):
                        for i in T.unroll(kernel):
                            wm[i] = T.Cast("float32", cw[mc, i])
                            wq[i] = T.Cast("float32", cw[qc, i])
                        conv_window(x, pool, mw, mc, -hist, c, t0, nv, seq, layer, n_tok, hist, c,
                                    interior_loads)  # fmt: skip
                        gates(x, a_log, dt_bias, gs, bs, gc, cum, gv, t0, nv, h0, row0, warp, lane,
                              tx)  # fmt: skip
                        # the conv in place (window t is inputs t .. t + hist); q and k unnormalised
                        # to kq for the norms' sums (bf16 holds them exactly: the conv rounds). q's
                        # inputs load after k's or v's conv: all in flight at once took 112
                        # registers.
                        for t in T.unroll(c):
                            mw[t] = conv_silu(wm, mw, kernel, DTYPE, t)
                            if tx < dk:
                                kq[swz(t, tx, dk)] = T.Cast(DTYPE, mw[t])
                        conv_window(x, pool, qw, qc, q0 - hist, q_len, t0, nv, seq, layer, n_tok,
                                    hist, c, interior_loads)  # fmt: skip
                        for t in T.unroll(q_len):
                            qw[t] = conv_silu(wq, qw, kernel, DTYPE, t)
                            kq[swz(c + q0 + t, tx % dk, dk)] = T.Cast(DTYPE, qw[t])
                    T.tvm_storage_sync("shared.dyn")
                    # 2. l2 norms of the K and Q rows, in gdn_input's order: partial sums of
                    # every parts-th square, then a thread a row adds its row's partials
                    for e in T.unroll(part_rounds):  # partial e * nt + tx (rows past 2C: 0)
                        sq[e] = T.float32(0)
                        for j in T.unroll(dk // parts):
                            sv = T.meta_var(T.Cast("float32", kq[swz(
                                T.min((e * nt + tx) // parts, 2 * c - 1),
                                j * parts + tx % parts, dk,
                            )]))  # fmt: skip
                            sq[e] = sq[e] + sv * sv
                    for e in T.unroll(part_rounds):
                        part[e * nt + tx] = sq[e]
                    T.tvm_storage_sync("shared.dyn")
                    if chunked_here(seq[2], skip_single):
                        if tx < 2 * c:
                            sq[0] = T.float32(0)
                            for j in T.unroll(parts):
                                sq[0] = sq[0] + part[tx * parts + j]
                            inv[tx] = T.float32(1) / T.sqrt(sq[0] + T.float32(1e-6))
                    T.tvm_storage_sync("shared")
                    # 3. The block's value heads in turn: its key head's K and Q (and their
                    # conv and norms) serve them all
                    for vh in T.unroll(heads):
                        h: T.let[T.int32] = h0 + vh
                        if chunked_here(seq[2], skip_single):
                            if vh > 0:
                                # the next value head's v (its conv in place) and gates; K stays
                                # in the k threads' registers, normalised
                                if tx >= dk:  # warp-uniform
                                    for i in T.unroll(kernel):
                                        wm[i] = T.Cast("float32", cw[v_chan(h, tx), i])
                                    conv_window(x, pool, mw, v_chan(h, tx), -hist, c, t0,
                                                nv, seq, layer, n_tok, hist, c,
                                                interior_loads)  # fmt: skip
                                    for t in T.unroll(c):
                                        mw[t] = conv_silu(wm, mw, kernel, DTYPE, t)
                                gates(x, a_log, dt_bias, gs, bs, gc, cum, gv, t0, nv, h, row0,
                                      warp, lane, tx)  # fmt: skip
                        if heads > 1:  # (one head: the norms' barrier just passed)
                            T.tvm_storage_sync("shared")
                        if chunked_here(seq[2], skip_single):
                            # K and Q normalised as bf16 (zero past the end), also to the
                            # workspace, by the first value head; R = [beta e^G K | beta V] in
                            # fp32, a column a thread; then [K; Q] x Kᵀ -> A, P
                            if tx < dk:  # warp-uniform
                                for t in T.unroll(c):
                                    if vh == 0:
                                        mw[t] = mw[t] * inv[t] * T.Cast("float32", t < nv)
                                        kq[swz(t, tx, dk)] = T.Cast(DTYPE, mw[t])
                                        if h0 % group == 0:  # once a key head
                                            kb[row0 + t, kh, tx] = T.Cast(DTYPE, mw[t])
                                    rs[t * fr + tx] = mw[t] * bs[t] * T.exp(gs[t])
                            elif rw == nt or tx < rw:  # bs is 0 past the end
                                for t in T.unroll(c):
                                    rs[t * fr + tx] = mw[t] * bs[t]
                            if vh == 0:
                                for t in T.unroll(q_len):
                                    qw[t] = qw[t] * inv[c + q0 + t] * T.Cast("float32", q0 + t < nv)
                                    kq[swz(c + q0 + t, tx % dk, dk)] = T.Cast(DTYPE, qw[t])
                                    if h0 % group == 0:
                                        qb[row0 + q0 + t, kh, tx % dk] = T.Cast(DTYPE, qw[t])
                        T.tvm_storage_sync("shared.dyn")
                        for jb in T.unroll(g1_jobs):
                            mt, n0 = T.meta_var(job_tile(jb * WARPS + warp, g1_ng, g1_n8))
                            for i in T.unroll(g1_ng * 4):
                                acc[i] = T.float32(0)
                            warp_mm(kq, 0, dk, False, kq, 0, dk, False, acc, af, bf, mt, n0,
                                    g1_ng, dk // 16, lane)  # fmt: skip
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
                        if chunked_here(seq[2], skip_single):
                            # 4. (I + A) X = R, 16 rows at a time; X = [W | U0]
                            solve_diag(0, rs, am, xb, w, u, uu, row0, h, tx)
                        T.tvm_storage_sync("shared")
                        for blk16 in T.unroll(1, c // 16):
                            solve_off(blk16, ab, xb, rs, acc, af, bf, rg, warp, lane)
                            T.tvm_storage_sync("shared.dyn")
                            if chunked_here(seq[2], skip_single):
                                solve_diag(blk16, rs, am, xb, w, u, uu, row0, h, tx)
                            T.tvm_storage_sync("shared")
                    # released last, not after the wait: the scan is one wave of long blocks,
                    # and launched early they land on the SMs this grid's last wave frees
                    # first, two or three to an SM, where later they run at a third of the pace
                    T.evaluate(release_dependents(True))

    return gdn_chunk_prep
