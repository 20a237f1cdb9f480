"""The decode GEMV (schedules/gemv.py), checked without a GPU.

- The CPU variant (the kernel's loop nest: row tiles, k-splitting warps, lanes, partial sums,
  their reduction and the epilogue) against numpy at odd shapes (n off the tile, k below one
  step or with a tail, batch 1, 7 and 9), with each epilogue kind: plain, residual, silu(.) * y,
  a [n] bias and a [batch] scale, a fp32 output.
- The GPU variant's data movement (register ring, 128-bit load addresses, mma fragments) in a
  numpy emulation whose mma follows the PTX ISA's m16n8k16 layouts.
- Mutations: a wrong split of k between warps, a dropped epilogue and a wrong fragment map
  each make the same checks fail.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from qwen35_tvm.compile.model import Linear
from qwen35_tvm.compile.pipeline import fusion_passes
from qwen35_tvm.compile.targets import make_target
from qwen35_tvm.schedules import gemv
from qwen35_tvm.schedules.gemv import DecodeGemv, GemvConfig, gemv_for, gemv_kernel
from qwen35_tvm.schedules.matmul import ROWS_ATTR, acc_coords

LLVM = tvm.target.Target("llvm")
CUDA, _ = make_target("cuda", "sm_80,sm_90")
BF16 = ml_dtypes.bfloat16


def _exact(rng: np.random.Generator, shape) -> np.ndarray:
    """Multiples of 1/8 in [-1, 1]: every product and fp32 sum here is exact."""
    return (rng.integers(-8, 9, shape) / 8).astype(BF16)


def _call(func: tvm.tirx.PrimFunc, *arrays: np.ndarray) -> np.ndarray:
    """Run `func` on the CPU; the last array is the output."""
    lib = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)
    args = [tvm.runtime.tensor(a) for a in arrays]
    lib["main"](*args)
    return args[-1].numpy()


def _off(got: np.ndarray, ref: np.ndarray, rtol: float = 0.0) -> bool:
    """Whether `got` misses `ref` (by more than rtol of ref's largest magnitude)."""
    got, ref = got.astype(np.float32), ref.astype(np.float32)
    return bool(np.abs(got - ref).max() > rtol * np.abs(ref).max())


# (n, k, batch, config): n off the tile, k below one step (64) or with a tail, uneven warps
CASES = [
    (40, 24, 1, GemvConfig(m_tiles=1, warps_k=3)),
    (40, 24, 7, GemvConfig(m_tiles=2, warps_k=1)),
    (72, 200, 7, GemvConfig(m_tiles=1, warps_k=3, stages=3)),
    (72, 200, 9, GemvConfig(m_tiles=2, warps_k=2, unroll=1)),  # two passes of 8 rows
    (16, 8, 1, GemvConfig(warps_k=4)),  # more warps than k steps
    (130, 512, 4, None),  # the default config
]


def _plain(n: int, k: int, batch: int, cfg: GemvConfig | None) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(n * k + batch)
    x, w = _exact(rng, (batch, k)), _exact(rng, (n, k))
    got = _call(gemv_kernel(n, k, LLVM, cfg), x, w, np.zeros((batch, n), np.float32))
    return got, x.astype(np.float32) @ w.astype(np.float32).T


@pytest.mark.parametrize("n, k, batch, cfg", CASES)
def test_cpu_kernel_matches_numpy(n, k, batch, cfg) -> None:
    got, ref = _plain(n, k, batch, cfg)
    assert not _off(got, ref)


def test_wrong_split_k_is_caught(monkeypatch) -> None:
    # every warp takes warp 0's k steps: some are summed 3 times, the others never
    monkeypatch.setattr(gemv, "warp_step", lambda j, warp, warps_k: j * warps_k)
    got, ref = _plain(72, 200, 7, GemvConfig(warps_k=3))
    assert _off(got, ref)


# ---- epilogues, as FuseOps builds them behind `Linear` --------------------------------------


class _Proj(nn.Module):
    def __init__(self, k: int, n: int, kind: str, dtype: str = "bfloat16"):
        self.proj = Linear(k, n, dtype)
        self.kind = kind

    def decode(self, x: nn.Tensor, y: nn.Tensor) -> nn.Tensor:
        out = self.proj(x)
        if self.kind == "residual":
            return y + out
        if self.kind == "residual_f32":  # the last layer's down_proj: the stream leaves in fp32
            return (y + out).astype("float32")
        if self.kind == "silu_mul":
            return op.silu(out) * y
        return out


def _small_gemm(k: int, n: int, kind: str, dtype: str = "bfloat16") -> tvm.tirx.PrimFunc:
    """The decode ("small") PrimFunc the CUDA pipeline fuses from the projection."""
    spec = {
        "decode": {
            "x": nn.spec.Tensor(["batch", k], dtype),
            "y": nn.spec.Tensor(["batch", n], dtype),
            "$": {"param_mode": "plain"},
        }
    }
    with CUDA:
        mod, _ = _Proj(k, n, kind, dtype).export_tvm(spec=spec)
        mod = tvm.transform.Sequential(fusion_passes(CUDA))(mod)
    (func,) = [f for _, f in mod.functions_items() if f.attrs and f.attrs.get(ROWS_ATTR)]
    assert func.attrs[ROWS_ATTR] == "small"
    return func


def _reference(x: np.ndarray, w: np.ndarray, y: np.ndarray, kind: str) -> np.ndarray:
    out = (x.astype(np.float32) @ w.astype(np.float32).T).astype(BF16)
    if kind in ("residual", "residual_f32"):
        out = (out.astype(np.float32) + y.astype(np.float32)).astype(BF16)
        return out.astype(np.float32) if kind == "residual_f32" else out
    if kind == "silu_mul":
        o = out.astype(np.float32)
        return (o / (1 + np.exp(-o)) * y.astype(np.float32)).astype(BF16)
    return out


def _fused(kind: str, n: int, k: int, batch: int, drop_epilogue: bool = False):
    func = _small_gemm(k, n, kind)
    match = gemv.match_gemm(func)
    cfg = GemvConfig(warps_k=3)
    kernel = gemv_for(func, LLVM, cfg)
    if drop_epilogue:  # the same kernel with only the cast to the output dtype behind the sum
        kernel = gemv_kernel(n, k, LLVM, cfg, match.extra_shapes, match.extra_dtypes,
                             match.out_dtype,
                             lambda acc, r, c, e: tvm.tirx.Cast(match.out_dtype, acc))  # fmt: skip
    rng = np.random.default_rng(k)
    x, w, y = _exact(rng, (batch, k)), _exact(rng, (n, k)), _exact(rng, (batch, n)) * 4
    out = np.zeros((batch, n), np.float32 if kind == "residual_f32" else BF16)
    arrays: list = [None] * len(func.params)  # in the fused function's order, as gemv_for keeps
    arrays[match.a_param], arrays[match.b_param], arrays[match.out_param] = x, w, out
    for pos in match.extra_params:
        arrays[pos] = y
    # the fused function itself, run by TVM's default CPU lowering: the same bf16 roundings
    fused = _call(func.with_attr("global_symbol", "main"), *arrays[:-1], out.copy())
    if drop_epilogue:  # gemv_kernel's own order
        arrays = [x, w, *([y] * len(match.extra_params)), out]
    return _call(kernel, *arrays), fused, _reference(x, w, y, kind)


@pytest.mark.parametrize("kind", ["plain", "residual", "residual_f32", "silu_mul"])
@pytest.mark.parametrize("batch", [1, 7])
def test_fused_epilogues_match_numpy(kind, batch) -> None:
    got, fused, ref = _fused(kind, 40, 200, batch)
    assert got.dtype == fused.dtype == ref.dtype
    # the sums are exact, so the epilogue's roundings are the only difference: none from the
    # fused function, one bf16 step at most from numpy's order of roundings
    assert not _off(got, fused)
    assert not _off(got, ref, rtol=2**-7)


@pytest.mark.parametrize("kind", ["residual", "silu_mul"])
def test_dropped_epilogue_is_caught(kind) -> None:
    got, fused, ref = _fused(kind, 40, 200, 7, drop_epilogue=True)
    assert _off(got, fused) and _off(got, ref, rtol=2**-7)


def test_bias_and_row_scale_epilogue() -> None:
    """Extras indexed [n] and [batch] (kinds gemm_match accepts besides [batch, n])."""
    n, k, batch = 40, 24, 7
    rng = np.random.default_rng(1)
    x, w = _exact(rng, (batch, k)), _exact(rng, (n, k))
    bias = _exact(rng, (n,)).astype(np.float32)
    scale = _exact(rng, (batch,)).astype(np.float32)
    func = gemv_kernel(n, k, LLVM, GemvConfig(warps_k=2), ("n", "m"), ("float32", "float32"),
                       "float32", lambda acc, r, c, e: (acc + e[0][c]) * e[1][r])  # fmt: skip
    got = _call(func, x, w, bias, scale, np.zeros((batch, n), np.float32))
    ref = (x.astype(np.float32) @ w.astype(np.float32).T + bias) * scale[:, None]
    assert not _off(got, ref)


# ---- the GPU variant's data movement, emulated ----------------------------------------------

_LANES = np.arange(32)
_G, _Q = _LANES // 4, _LANES % 4
_E8, _E4 = np.arange(8), np.arange(4)
# PTX ISA, mma.m16n8k16 .bf16: (row, k) of A's a0..a7, (k, n) of B's b0..b3, (row, n) of C's
_A_ROW, _A_K = _G[:, None] + 8 * (_E8 // 2 % 2), 2 * _Q[:, None] + _E8 % 2 + 8 * (_E8 // 4)
_B_K, _B_N = 2 * _Q[:, None] + _E4 % 2 + 8 * (_E4 // 2), np.broadcast_to(_G[:, None], (32, 4))
_C_ROW, _C_N = _G[:, None] + 8 * (_E4 // 2), 2 * _Q[:, None] + _E4 % 2


def _mma(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The [32, 4] accumulator fragments of A [32, 8] (16 x 16) times B [32, 4] (16 x 8)."""
    am, bm = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    am[_A_ROW, _A_K] = a
    bm[_B_K, _B_N] = b
    return (am @ bm)[_C_ROW, _C_N]


def _emulate_gpu(x: np.ndarray, w: np.ndarray, cfg: GemvConfig) -> np.ndarray:
    """accumulate_gpu and the store phase, lane by lane, with gemv's own index maps."""
    (batch, k), n = x.shape, w.shape[0]
    mt, wks, unroll, stages, rb, step = (cfg.m_tiles, cfg.warps_k, cfg.unroll, cfg.stages,
                                         cfg.rows, cfg.step)  # fmt: skip
    n_steps = gemv.cdiv(k, step)
    iters = gemv.cdiv(gemv.cdiv(n_steps, wks), stages)
    out = np.full((batch, n), np.nan)
    for p in range(gemv.cdiv(batch, gemv.COLS)):
        for tile in range(gemv.cdiv(n, rb)):
            part = np.zeros((wks, gemv.COLS, rb))
            for wk in range(wks):
                w_reg = np.full((stages, 32, unroll, 2 * mt, 8), np.nan)
                x_reg = np.full((stages, 32, unroll, 8), np.nan)
                acc = np.zeros((32, mt, 4))

                def load(d: int, ks: int, w_reg=w_reg, x_reg=x_reg, tile=tile, p=p) -> None:
                    for lane in range(32) if ks < n_steps else ():
                        g, q = gemv.lane_coords(lane)
                        for u in range(unroll):
                            k0 = gemv.load_k(ks, u, q, step)
                            live = k0 < k
                            xr = min(p * gemv.COLS + g, batch - 1)
                            x_reg[d, lane, u] = x[xr, k0 : k0 + 8] if live else 0
                            for h in range(2 * mt):
                                row = min(gemv.load_row(tile, h, g, mt), n - 1)
                                w_reg[d, lane, u, h] = w[row, k0 : k0 + 8] if live else 0

                def product(d: int, ks: int, w_reg=w_reg, x_reg=x_reg, acc=acc) -> None:
                    for u in range(unroll) if ks < n_steps else ():
                        for m in range(mt):
                            for s in range(2):
                                src = [gemv.frag_source(m, s, e) for e in range(8)]
                                a = np.stack([[w_reg[d, ln, u, h, v] for h, v in src]
                                              for ln in range(32)])  # fmt: skip
                                acc[:, m] += _mma(a, x_reg[d, :, u, s * 4 : s * 4 + 4])

                for d in range(stages):
                    load(d, gemv.warp_step(d, wk, wks))
                for it in range(iters):
                    for d in range(stages):
                        product(d, gemv.warp_step(it * stages + d, wk, wks))
                        load(d, gemv.warp_step((it + 1) * stages + d, wk, wks))
                for lane in range(32):
                    for m in range(mt):
                        for e in range(4):
                            er, ec = acc_coords(lane, e)
                            part[wk, ec, m * 16 + er] = acc[lane, m, e]
            total = part.sum(axis=0)  # [column, row]
            for b in range(gemv.COLS):
                rows = np.arange(tile * rb, min(tile * rb + rb, n))
                if p * gemv.COLS + b < batch:
                    out[p * gemv.COLS + b, rows] = total[b, rows - tile * rb]
    return out


EMULATED = [
    (40, 200, 7, GemvConfig(m_tiles=1, warps_k=3, stages=3)),
    (72, 64, 3, GemvConfig(m_tiles=2, warps_k=2, unroll=1)),
    (24, 136, 1, GemvConfig(m_tiles=1, warps_k=1, unroll=4, stages=1)),
]


@pytest.mark.parametrize("n, k, batch, cfg", EMULATED)
def test_emulated_gpu_kernel_computes_x_times_w_transposed(n, k, batch, cfg) -> None:
    rng = np.random.default_rng(n + k)
    x, w = _exact(rng, (batch, k)).astype(np.float64), _exact(rng, (n, k)).astype(np.float64)
    np.testing.assert_array_equal(_emulate_gpu(x, w, cfg), x @ w.T)


def test_wrong_fragment_map_is_caught(monkeypatch) -> None:
    # swap the two k halves of A only: A and B no longer agree on the physical k
    right = gemv.frag_source
    monkeypatch.setattr(gemv, "frag_source", lambda m, s, e: right(m, 1 - s, e))
    n, k, batch, cfg = EMULATED[0]
    rng = np.random.default_rng(n + k)
    x, w = _exact(rng, (batch, k)).astype(np.float64), _exact(rng, (n, k)).astype(np.float64)
    assert _off(_emulate_gpu(x, w, cfg), x @ w.T)


# ---- the rule --------------------------------------------------------------------------------


def test_rule_takes_small_bf16_gemms_only() -> None:
    bf16 = _small_gemm(64, 40, "residual")
    sch = DecodeGemv().apply(bf16, CUDA, False)
    assert sch is not None and sch.mod["main"].attrs[gemv.KERNEL_ATTR] == "gemv"
    assert "mma" in sch.mod["main"].script()
    # fp32 keeps dlight's GEMV; prefill's and wide decode's GEMMs are not this rule's
    assert DecodeGemv().apply(_small_gemm(64, 40, "plain", "float32"), CUDA, False) is None
    assert DecodeGemv().apply(bf16.with_attr(ROWS_ATTR, "wide"), CUDA, False) is None
    assert DecodeGemv().apply(bf16, LLVM, False) is None
    # k not a multiple of 8 (no 128-bit loads): dlight keeps it
    assert DecodeGemv().apply(_small_gemm(36, 40, "plain"), CUDA, False) is None


def test_default_configs_fill_one_wave() -> None:
    """Every 4B and 9B decode shape: all row tiles in one wave on 132 SMs, >= 1k warps."""
    shapes = [(12352, 2560), (2560, 4096), (10240, 2560), (18432, 2560), (2560, 9216),
              (12352, 4096), (4096, 4096), (10240, 4096), (24576, 4096), (4096, 12288)]  # fmt: skip
    for n, k in shapes:
        cfg = gemv.default_config(n, k)
        tiles = gemv.cdiv(n, cfg.rows)
        assert tiles <= gemv.SMS * gemv.min_blocks_per_sm(n, cfg), (n, k, cfg)
        assert tiles * cfg.warps_k >= 1024, (n, k, cfg)
