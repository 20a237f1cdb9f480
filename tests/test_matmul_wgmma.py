"""The sm_90a path of the prefill GEMM (schedules/matmul_wgmma.py), checked without a GPU.

A numpy emulation runs the kernel's data movement: cp.async writes each 16-byte chunk where
the kernel puts it, at a shared-memory base that is not 1,024-byte aligned; wgmma reads A and B
through the descriptors the kernel builds (decoded from their bits), with the 128-byte swizzle
as the PTX ISA defines it on absolute shared addresses (bits 4-6 XOR bits 7-9); the fp32
accumulators go out through the kernel's epilogue mapping. It must reproduce A · Bᵀ, edge tiles
(m and n not multiples of the tile) included, and it fails if the layout loses its swizzle.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from tvm.script import tirx as T

from qwen35_tvm.schedules import matmul_rule as rule
from qwen35_tvm.schedules import matmul_wgmma as mw
from qwen35_tvm.schedules import split_k
from qwen35_tvm.schedules.gemm_layout import acc_coords, copy_coords
from qwen35_tvm.schedules.ptx import wgmma_desc_sw128

_ROW_BYTES = mw.BLOCK_K * 2


_OPS = {
    "BitwiseOr": lambda x, y: x | y,
    "BitwiseAnd": lambda x, y: x & y,
    "LShift": lambda x, y: x << y,
    "RShift": lambda x, y: x >> y,
}


def _evaluate(e) -> int:
    """The value of a constant integer expression (TVM's simplifier leaves 64-bit bit ops)."""
    bits = int(str(e.ty).removeprefix("u").removeprefix("int"))
    name = type(e).__name__
    if name == "IntImm":
        value = int(e.value)
    elif name == "Cast":
        value = _evaluate(e.value)
    else:
        value = _OPS[name](_evaluate(e.a), _evaluate(e.b))
    return value & (2**bits - 1)


def _descriptor(address: int) -> dict[str, int]:
    """The fields of the kernel's descriptor for a tile at shared `address` (PTX ISA,
    matrix descriptor: start >> 4 in bits 0-13, leading offset >> 4 in 16-29, stride offset
    >> 4 in 32-45, layout type in 62-63, 1 being the 128-byte swizzle)."""
    bits = _evaluate(wgmma_desc_sw128(T.uint32(address)))
    return {
        "start": (bits & 0x3FFF) << 4,
        "leading": (bits >> 16 & 0x3FFF) << 4,
        "stride": (bits >> 32 & 0x3FFF) << 4,
        "layout": bits >> 62,
    }


def _read_k_major(smem: np.ndarray, base: int, address: int, rows: int) -> np.ndarray:
    """[rows, 16] bf16 that wgmma reads for one k16 step of a K-major operand whose descriptor
    names `address`: row r, k j at start + (r // 8) * stride + (r % 8) * 128 + 2 j, swizzled."""
    d = _descriptor(address)
    assert d["layout"] == 1 and d["start"] == address & 0x3FFF0
    r, j = np.arange(rows)[:, None], np.arange(16)[None, :]
    logical = address + r // 8 * d["stride"] + r % 8 * 128 + 2 * j
    physical = logical ^ ((logical >> 7 & 7) << 4)
    return smem[(physical - base) // 2]


def _swizzled(address: int) -> int:
    """The 128-byte swizzle (PTX ISA; TMA's CU_TENSOR_MAP_SWIZZLE_128B applies the same)."""
    return address ^ ((address >> 7 & 7) << 4)


def _emulate(
    a: np.ndarray,
    b: np.ndarray,
    cfg: mw.WgmmaConfig,
    base: int,
    swiglu: bool = False,
    splits: int = 1,
    a_pair: int = 0,
) -> np.ndarray:
    """The kernel at shared base address `base`; with `swiglu` (TMA only), b is a gate_up
    weight and the result silu(gate) · up [m, n / 2], exact (no bf16 rounding). A CTA runs
    one tile, or with `cfg.ctas` (persistent) every ctas-th tile, its ring running on. With
    `splits`, split z's CTAs run their tiles over split_k.k_range's k tiles, and the tiles'
    partials are summed before the epilogue (what the reduce kernel does). With `a_pair`, A's
    tile is two boxes of 64 rows `a_pair` apart (wgmma_tile's): result row 128 bx + r is A row
    64 bx + r % 64 + r // 64 * a_pair."""
    (m, k), n = a.shape, b.shape[0]
    bn, stages = cfg.block_n, cfg.stages
    chunks, k_tiles = mw.BLOCK_K // 8, k // mw.BLOCK_K
    n_out, out_tiles = (n // 2, bn // 16) if swiglu else (n, bn // 8)
    out = np.full((m, n_out), np.nan)
    pad = (1024 - base % 1024) % 1024
    ring = base + pad
    m_tiles, tiles = -(-m // mw.BLOCK_M), -(-m // mw.BLOCK_M) * -(-n // bn)
    ctas = cfg.ctas or tiles
    partials: dict[tuple[int, int], np.ndarray] = {}
    for z, cta in itertools.product(range(splits), range(ctas)):
        first, count = split_k.k_range(z, splits, k_tiles)
        smem = np.full(cfg.shared_bytes // 2, np.nan)
        # the CTA's ring steps: (bx, by, kt), tile by tile (m fastest), k tile by k tile
        mine = [(i % m_tiles, i // m_tiles) for i in range(cta, tiles, ctas)]
        steps = [(bx, by, first + j) for bx, by in mine for j in range(count)]

        def load(s: int, step: tuple, smem: np.ndarray = smem) -> None:
            bx, by, kt = step
            for src, rows, first, at in (
                (a, mw.BLOCK_M, bx * mw.BLOCK_M, 0),
                (b, bn, by * bn, mw.BLOCK_M * mw.BLOCK_K),
            ):
                for index in range(rows * chunks):  # every (iteration, thread) pair
                    row, chunk = copy_coords(index, chunks)
                    col = kt * mw.BLOCK_K + chunk * 8
                    if cfg.tma:  # the box lands swizzled; rows past the tensor read zeros
                        tile = ring + s * cfg.stage_bytes + at * 2
                        dst = (_swizzled(tile + row * _ROW_BYTES + chunk * 16) - base) // 2
                        at_row = first + row
                        if swiglu and src is b:  # two boxes: the gate rows, then the up rows
                            box = bn // 2
                            at_row = by * box + row % box + row // box * (n // 2)
                        if a_pair and src is a:  # A's two boxes, `a_pair` rows apart
                            box = mw.BLOCK_M // 2
                            at_row = bx * box + row % box + row // box * a_pair
                        got = src[at_row, col : col + 8] if at_row < len(src) else 0
                    else:  # the kernel's own placement, edge rows clamped
                        dst = pad // 2 + s * cfg.stage_bytes // 2 + at
                        dst += mw.tile_offset(row, chunk, chunks)
                        got = src[min(first + row, len(src) - 1), col : col + 8]
                    smem[dst : dst + 8] = got

        # cp.async keeps `stages` - 2 steps of copies in flight; TMA refills a stage once both
        # warpgroups have released it, `stages` - 1 steps ahead
        ahead = stages if cfg.tma else stages - 2
        for s in range(min(ahead, len(steps))):
            load(s, steps[s])
        for g, (bx, by, kt) in enumerate(steps):
            if kt == first:
                d = np.zeros((mw.BLOCK_M, bn))
            if not cfg.tma:
                target = (g + ahead) % stages
                # never a stage whose wgmma may still run (step g, or g - 1 not waited)
                assert target not in (g % stages, (g - 1) % stages)
                if g + ahead < len(steps):
                    load(target, steps[g + ahead])
            stage = ring + g % stages * cfg.stage_bytes
            for wg in range(2):
                for kk in range(mw.BLOCK_K // 16):
                    at = stage + wg * 64 * _ROW_BYTES + kk * 32
                    a_op = _read_k_major(smem, base, at, 64)
                    at = stage + mw.BLOCK_M * _ROW_BYTES + kk * 32
                    b_op = _read_k_major(smem, base, at, bn)
                    d[wg * 64 : wg * 64 + 64] += a_op @ b_op.T
            # TMA: after step g's wgmma, step g - 1's (waited for) frees its stage, which takes
            # step g - 1 + stages, the next tile's where the CTA runs on; g's is not touched
            if cfg.tma and g > 0 and g - 1 + stages < len(steps):
                assert (g - 1) % stages != g % stages
                load((g - 1) % stages, steps[g - 1 + stages])
            if kt == first + count - 1:
                partials[bx, by] = partials.get((bx, by), 0) + d
    for (bx, by), d in partials.items():
        _store(out, d, bx, by, swiglu, n_out, out_tiles, bn, m)
    return out


def _store(out, d, bx, by, swiglu, n_out, out_tiles, bn, m) -> None:
    """A tile's accumulators, laid out per thread as the PTX ISA lays out wgmma's D
    (m64nNk16, fp32: warp w of the warpgroup rows 16w + lane / 4 (+ 8), columns 8i +
    2 (lane % 4) (+ 1)), out through the kernel's epilogue mapping: with a SwiGLU, gate in n8
    tile nt, up in nt + out_tiles."""
    for tid in range(mw.THREADS):
        lane, w = tid % 32, tid // 32
        frag = np.empty(bn // 2)
        for i in range(bn // 8):
            for v in range(4):
                frag[4 * i + v] = d[
                    16 * w + lane // 4 + 8 * (v // 2), 8 * i + 2 * (lane % 4) + v % 2
                ]
        for nt in range(out_tiles):
            for e in range(4):
                er, ec = acc_coords(lane, e)
                r, c = bx * mw.BLOCK_M + w * 16 + er, by * (bn // 2 if swiglu else bn) + nt * 8 + ec
                got = frag[nt * 4 + e]
                if swiglu:
                    got = got / (1 + np.exp(-got)) * frag[(nt + out_tiles) * 4 + e]
                if r < m and c < n_out:
                    out[r, c] = got


CONFIGS = [
    mw.WgmmaConfig(160, 4),
    mw.WgmmaConfig(128, 5),
    mw.WgmmaConfig(192, 3),
    mw.WgmmaConfig(160, 4, tma=True),
    mw.WgmmaConfig(160, 3, tma=True),
    mw.WgmmaConfig(256, 3, tma=True),
    mw.WgmmaConfig(192, 4, tma=True),
    mw.WgmmaConfig(96, 4, tma=True),  # one m tile's (matmul_rule.small_m_config)
    mw.WgmmaConfig(64, 4, tma=True),
    # persistent: 3 CTAs over the tiles (some with none), the ring across tile boundaries
    mw.WgmmaConfig(160, 4, tma=True, ctas=3),
    mw.WgmmaConfig(128, 5, tma=True, ctas=2),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize(
    "m, n, k, base", [(130, 200, 192, 16 * 37), (1, 96, 64, 1024), (128, 160, 320, 48)]
)
def test_emulated_wgmma_path_computes_a_times_b_transposed(cfg, m, n, k, base) -> None:
    rng = np.random.default_rng(m + n + k)
    a = rng.integers(-3, 4, (m, k)).astype(np.float64)  # exact in any summation order
    b = rng.integers(-3, 4, (n, k)).astype(np.float64)
    np.testing.assert_array_equal(_emulate(a, b, cfg, base), a @ b.T)


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.tma], ids=str)
@pytest.mark.parametrize("m, inter, k", [(130, 200, 128), (1, 40, 64)])
def test_emulated_swiglu_epilogue_pairs_gate_and_up(cfg, m, inter, k) -> None:
    rng = np.random.default_rng(m + inter)
    a = rng.integers(-3, 4, (m, k)).astype(np.float64)
    b = rng.integers(-3, 4, (2 * inter, k)).astype(np.float64)
    gate, up = a @ b[:inter].T, a @ b[inter:].T
    got = _emulate(a, b, cfg, 16 * 37, swiglu=True)
    np.testing.assert_allclose(got, gate / (1 + np.exp(-gate)) * up, rtol=1e-12)


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if not c.ctas], ids=str)
@pytest.mark.parametrize(
    "m, n, k, splits",
    [
        (130, 200, 512, 2),  # edge tiles, two halves of 4 k tiles
        (1, 96, 448, 3),  # 7 k tiles in runs of 2, 2, 3: shorter than the ring
        (64, 160, 64 * 13, 4),  # runs of 3 and 4, past the ring's depth
    ],
)
def test_emulated_split_k_sums_to_a_times_b_transposed(cfg, m, n, k, splits) -> None:
    rng = np.random.default_rng(m + n + k + splits)
    a = rng.integers(-3, 4, (m, k)).astype(np.float64)
    b = rng.integers(-3, 4, (n, k)).astype(np.float64)
    np.testing.assert_array_equal(_emulate(a, b, cfg, 16 * 37, splits=splits), a @ b.T)
    if cfg.tma:
        gate, up = a @ b[: n // 2].T, a @ b[n // 2 :].T
        got = _emulate(a, b, cfg, 16 * 37, swiglu=True, splits=splits)
        np.testing.assert_allclose(got, gate / (1 + np.exp(-gate)) * up, rtol=1e-12)


def test_split_k_ranges_off_by_one_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation check: each split's run starts a tile late (the first k tile is never read)."""
    real = split_k.k_range

    def late(z: int, splits: int, k_tiles: int) -> tuple[int, int]:
        first, count = real(z, splits, k_tiles)
        return (first + 1, count - 1) if z == 0 else (first, count)

    monkeypatch.setattr(split_k, "k_range", late)
    a, b = np.ones((5, 256)), np.ones((96, 256))
    got = _emulate(a, b, mw.WgmmaConfig(160, 4, tma=True), 16, splits=2)
    assert not np.array_equal(got, a @ b.T)


def test_an_unswizzled_layout_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation check: chunks written in row order (what the descriptor does not read)."""
    monkeypatch.setattr(mw, "tile_offset", lambda row, chunk, chunks: row * chunks * 8 + chunk * 8)
    a = np.arange(130 * 128, dtype=np.float64).reshape(130, 128) % 7
    b = np.arange(96 * 128, dtype=np.float64).reshape(96, 128) % 5
    assert not np.array_equal(_emulate(a, b, mw.WgmmaConfig(160, 4), 16), a @ b.T)


def test_configs_fit_sm80_and_share_its_launch() -> None:
    for n in (64, 2560, 4096, 10240, 12352, 18432, 24576):
        wg = mw.default_wgmma_config(n)
        wg.check()
        sm80 = rule.shared_launch_config(wg)
        sm80.check()
        assert (sm80.block_m, sm80.block_n, sm80.threads) == (mw.BLOCK_M, wg.block_n, mw.THREADS)
        assert max(sm80.shared_bytes, wg.shared_bytes) <= mw.SM80_SHARED_BYTES
    # qkv's tiling leaves room for a second CTA an SM on sm_90 (the reason it is chosen)
    wide_qkv = mw.default_wgmma_config(10240)
    launch = max(rule.shared_launch_config(wide_qkv).shared_bytes, wide_qkv.shared_bytes)
    assert (wide_qkv.block_n, wide_qkv.stages) == (160, 3) and 2 * launch <= mw.SM90_SHARED_BYTES
    with pytest.raises(ValueError):
        mw.WgmmaConfig(256, 4).check()  # 197 KB: over sm_80's 163 KB
    mw.WgmmaConfig(256, 4, sm90_only=True).check()  # a library without sm_80 code: 227 KB
    with pytest.raises(ValueError):
        mw.WgmmaConfig(256, 5, sm90_only=True).check()


@pytest.mark.parametrize("ctas", [0, 132])
def test_tma_ring_fences_its_barriers_init_before_the_first_copy(ctas: int) -> None:
    """sm_90a's TMA ring (a CTA a tile, and persistent): thread 0 inits the mbarriers, fences
    the init for the async proxy, and only then issues the first tensor copy that completes on
    them. Mutation: without the fences (as before) this fails."""
    import tvm

    from qwen35_tvm.compile.targets import make_target
    from qwen35_tvm.schedules.matmul import gemm_kernel

    target, _ = make_target("cuda", "sm_80,sm_90")
    wg = mw.WgmmaConfig(block_n=160, stages=4, tma=True, ctas=ctas)
    func = gemm_kernel(2560, 2560, rule.shared_launch_config(wg), out_dtype="bfloat16", wgmma=wg)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "g")}), target=target)
    (cuda,) = [m for m in lib.mod.imports if m.kind == "cuda"]
    src = cuda.inspect_source()
    # each kernel's sm_90a branch (the module holds more than one: the m buckets)
    bodies = [b for b in src.split("qwen35_sm90a()")[1:] if "mbarrier_init_init_shared" in b]
    assert bodies
    for body in bodies:
        last_init = body.rindex("mbarrier_init_init_shared")
        fence, proxy = body.index("fence_mbarrier_init"), body.index("fence_proxy_proxy_async")
        assert last_init < fence < proxy < body.index("cp_async_bulk_tensor")
