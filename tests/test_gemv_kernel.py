"""The decode GEMV (schedules/gemv.py), checked without a GPU.

- The CPU variant (the kernel's loop nest: row tiles, k-splitting warps, lanes, n-tiles,
  partial sums, their reduction n-tile by n-tile and the epilogue; decode_wide's dispatch over
  batch buckets) against numpy at odd shapes (n off the tile, k below one step or with a tail,
  batch 1, 7, 8, 9, 16, 33 and 64), with each epilogue kind: plain, residual, silu(.) * y, a
  [n] bias and a [batch] scale, a fp32 output.
- Mutations: a wrong split of k between warps, a dropped epilogue, X rows that disagree with
  the output rows and a dropped n-tile each make the same checks fail.
- The rules and the configs the pipeline picks; with nvcc, that decode_wide's kernels at the 4B
  shapes neither spill nor pass 255 registers.
The GPU variant's data movement is emulated in tests/test_gemv_emulated.py; the bulk ring is
checked in tests/test_gemv_bulk.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from qwen35_tvm.compile.layers import Linear
from qwen35_tvm.compile.pipeline import fusion_passes
from qwen35_tvm.compile.targets import make_target
from qwen35_tvm.schedules import gemv, gemv_body, gemv_config
from qwen35_tvm.schedules.gemm_match import match_gemm
from qwen35_tvm.schedules.gemv import GemvConfig, gemv_kernel
from qwen35_tvm.schedules.gemv_rule import DecodeGemv, gemv_for, plan
from qwen35_tvm.schedules.matmul_config import ROWS_ATTR

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
    # sm_90's bulk ring: on the CPU the same nest as any config (its ring is emulated in
    # tests/test_gemv_emulated.py)
    (72, 384, 7, GemvConfig(m_tiles=1, warps_k=3, stages=4, x_stages=2, bulk=2)),
]


def _plain(n: int, k: int, batch: int, cfg) -> tuple[np.ndarray, np.ndarray]:
    """(kernel's, numpy's) x · wᵀ; `cfg` a config, buckets, None or "wide" (the pipeline's)."""
    cfg = plan(n, k, "wide") if cfg == "wide" else cfg
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
    monkeypatch.setattr(gemv_body, "warp_step", lambda j, warp, warps_k: j * warps_k)
    got, ref = _plain(72, 200, 7, GemvConfig(warps_k=3))
    assert _off(got, ref)


# decode_wide: n-tiles (8 batch rows each) a pass, both weight rings (the CPU variant has one
# loop nest for both), buckets chosen by the batch at run time
SMEM = dict(w_smem=True, unroll=1)
WIDE = [
    (72, 200, 8, "wide"),  # the 8-row bucket: decode's config
    (72, 200, 9, "wide"),
    (40, 136, 16, "wide"),
    (130, 512, 33, "wide"),
    (40, 200, 64, "wide"),
    (40, 24, 16, GemvConfig(m_tiles=1, warps_k=2, n_tiles=2)),  # k below one step
    (72, 200, 33, GemvConfig(m_tiles=2, warps_k=3, stages=3, n_tiles=2, x_stages=1, **SMEM)),
    (72, 200, 64, GemvConfig(m_tiles=4, warps_k=3, stages=4, n_tiles=4, x_stages=2, **SMEM)),
    (24, 64, 9, ((8, GemvConfig(warps_k=2)), (16, GemvConfig(warps_k=2, n_tiles=2)))),
]


@pytest.mark.parametrize("n, k, batch, cfg", WIDE)
def test_cpu_wide_kernel_matches_numpy(n, k, batch, cfg) -> None:
    got, ref = _plain(n, k, batch, cfg)
    assert not _off(got, ref)


def test_wrong_column_mapping_is_caught(monkeypatch) -> None:
    # n-tile j reads X rows col + 8 g + j while its sums go to rows col + 8 j + c
    monkeypatch.setattr(gemv_body, "x_row", lambda col, j, g: col + g * 8 + j)
    for n, k, batch, cfg in [WIDE[1], WIDE[4], WIDE[7]]:
        got, ref = _plain(n, k, batch, cfg)
        assert _off(got, ref), (n, k, batch)


def test_dropped_n_tile_is_caught(monkeypatch) -> None:
    # the last n-tile's products land in the first's accumulators (and are read from there)
    right = gemv_body.acc_index
    monkeypatch.setattr(
        gemv_body, "acc_index", lambda m, j, e, nt: right(m, j % max(nt - 1, 1), e, nt)
    )
    for n, k, batch, cfg in [WIDE[1], WIDE[4], WIDE[7]]:
        got, ref = _plain(n, k, batch, cfg)
        assert _off(got, ref), (n, k, batch)


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
    match = match_gemm(func)
    # decode's batches with a config of 3 warps, decode_wide's with the pipeline's buckets
    cfg = GemvConfig(warps_k=3) if batch < 8 else plan(n, k, "wide")
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
@pytest.mark.parametrize("batch", [1, 7, 9, 16, 33, 64])
def test_fused_epilogues_match_numpy(kind, batch) -> None:
    got, fused, ref = _fused(kind, 40, 200, batch)
    assert got.dtype == fused.dtype == ref.dtype
    # the sums are exact, so the epilogue's roundings are the only difference: none from the
    # fused function, one bf16 step at most from numpy's order of roundings
    assert not _off(got, fused)
    assert not _off(got, ref, rtol=2**-7)


@pytest.mark.parametrize("kind", ["residual", "silu_mul"])
@pytest.mark.parametrize("batch", [7, 33])
def test_dropped_epilogue_is_caught(kind, batch) -> None:
    got, fused, ref = _fused(kind, 40, 200, batch, drop_epilogue=True)
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


# ---- the rule --------------------------------------------------------------------------------


def test_rules_take_their_bf16_gemms_only() -> None:
    bf16 = _small_gemm(64, 40, "residual")
    wide = bf16.with_attr(ROWS_ATTR, "wide")
    sch = DecodeGemv().apply(bf16, CUDA, False)
    assert sch is not None and sch.mod["main"].attrs[gemv.KERNEL_ATTR] == "gemv"
    assert "mma" in sch.mod["main"].script()
    # decode_wide's: its buckets, the 16-64 row ones with the weight ring in shared memory
    sch = DecodeGemv(rows="wide").apply(wide, CUDA, False)
    assert sch is not None and sch.mod["main"].attrs[gemv.KERNEL_ATTR] == "gemv"
    assert "cp_async" in sch.mod["main"].script()
    # fp32 keeps dlight's GEMV; prefill's GEMMs and the other class's are not these rules'
    assert DecodeGemv().apply(_small_gemm(64, 40, "plain", "float32"), CUDA, False) is None
    assert DecodeGemv().apply(wide, CUDA, False) is None
    assert DecodeGemv(rows="wide").apply(bf16, CUDA, False) is None
    assert DecodeGemv(rows="wide").apply(bf16.with_attr(ROWS_ATTR, "large"), CUDA, False) is None
    assert DecodeGemv().apply(bf16, LLVM, False) is None
    # k not a multiple of 8 (no 128-bit loads): dlight keeps it
    assert DecodeGemv().apply(_small_gemm(36, 40, "plain"), CUDA, False) is None


SHAPES = [(12352, 2560), (2560, 4096), (10240, 2560), (18432, 2560), (2560, 9216),
          (12352, 4096), (4096, 4096), (10240, 4096), (24576, 4096), (4096, 12288)]  # fmt: skip


def test_default_configs_fill_one_wave() -> None:
    """Every 4B and 9B decode shape: all row tiles in one wave on 132 SMs, >= 1k warps."""
    for n, k in SHAPES:
        cfg = gemv_config.default_config(n, k)
        tiles = gemv_config.cdiv(n, cfg.rows)
        assert tiles <= gemv_config.SMS * gemv_config.min_blocks_per_sm(n, cfg), (n, k, cfg)
        assert tiles * cfg.warps_k >= 1024, (n, k, cfg)


def test_grids_a_little_past_the_sms_start_after_their_producer() -> None:
    """Decode GEMVs of SMS < row tiles <= START_AFTER_PRODUCER_TILES (4B's n = 2,560: 160) are
    plain launches, with no wait, release or L2 prefetch in their CUDA; the other 4B and 9B
    shapes, and a grid of fewer tiles than SMs, wait for their producer."""
    plain = {(n, k) for n, k in SHAPES if not gemv_config.default_config(n, k).dependent}
    assert plain == {(2560, 4096), (2560, 9216)}
    for n, k, waits in ((2560, 4096, False), (4096, 4096, True), (1024, 4096, True)):
        lib = tvm.compile(tvm.IRModule({"main": gemv_kernel(n, k, CUDA)}), target=CUDA)
        (cuda,) = [m for m in lib.mod.imports if m.kind == "cuda"]
        src = cuda.inspect_source()
        for call in ("griddepcontrol_wait()", "griddepcontrol_launch_dependents()", "prefetch"):
            assert (call in src) == waits, (n, k, call)


def test_wide_buckets_read_the_weight_once_up_to_64_rows() -> None:
    """Every 4B and 9B shape, the GEMV's plan (where the swapped tensor-core GEMM takes the
    16-64-row buckets instead: tests/test_gemv_wide_mma.py): 8 rows as decode, then buckets up
    to 64 rows each one pass, in one wave within the registers and the shared memory left to
    L1; every SM has a row tile."""
    for n, k in SHAPES:
        buckets = gemv_config.wide_buckets(n, k, mma=False)
        assert buckets[0] == (8, gemv_config.default_config(n, k))
        assert [limit for limit, _ in buckets] == [8, 16, 32, 64]
        for limit, cfg in buckets[1:]:
            assert cfg.cols >= limit, (n, k, cfg)  # one pass
            assert cfg.w_smem != gemv_config.ring_in_registers(n, k, cfg.n_tiles), (n, k, cfg)
            assert gemv_config.one_wave(n, k, cfg, gemv_config.WIDE_SHARED_PER_SM), (n, k, cfg)
            assert gemv_config.cdiv(n, cfg.rows) >= gemv_config.SMS, (n, k, cfg)
            # beside its producer: register rings where decode's rule would, never shared rings
            beside = gemv_config.starts_beside_producer(gemv_config.cdiv(n, cfg.rows))
            assert cfg.dependent == (not cfg.w_smem and beside), (n, k, cfg)


def test_k_tail_zero_fills_the_shared_ring() -> None:
    """k not a multiple of the step: the last copies are predicated cp.async, zero-filling
    their slots (CUDA source; the CPU tests check the sums)."""
    cfg = GemvConfig(m_tiles=2, warps_k=2, stages=3, n_tiles=4, x_stages=1, **SMEM)
    lib = tvm.compile(tvm.IRModule({"main": gemv_kernel(72, 200, CUDA, cfg)}), target=CUDA)
    (cuda,) = [m for m in lib.mod.imports if m.kind == "cuda"]
    assert "@!p st.shared.v4.u32" in cuda.inspect_source()


def _residual(acc, row, col, extras):
    return tvm.tirx.Cast("bfloat16", acc) + extras[0][row, col]


@pytest.mark.parametrize("rows", ["small", "wide"])
def test_residual_is_loaded_before_the_weight_stream(rows: str) -> None:
    """The epilogue's residual is read right after the kernel's wait, into a register the store
    reads: its latency hides behind the stream (CUDA source; the CPU tests check the values)."""
    func = gemv_kernel(2560, 4096, CUDA, plan(2560, 4096, rows), ("mn",), ("bfloat16",),
                       "bfloat16", _residual)  # fmt: skip
    lib = tvm.compile(tvm.IRModule({"main": func}), target=CUDA)
    (cuda,) = [m for m in lib.mod.imports if m.kind == "cuda"]
    src = cuda.inspect_source()
    bodies = [c for c in src.split("__global__")[1:] if c.split("\n", 1)[0].endswith("{")]
    assert len(bodies) == len(plan(2560, 4096, rows) if rows == "wide" else [0])
    for body in bodies:  # each bucket's kernel
        reads = [m.start() for m in re.finditer(r"e0_ptr\[", body)]
        first_mma = body.index("mma.sync")
        assert reads and max(reads) < first_mma, body[:200]  # one a batch tile
        assert re.search(r"out_ptr\[[^;]*\] = [^;]*early_ptr", body), body[:200]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_wide_kernels_do_not_spill(tmp_path) -> None:
    """ptxas -v on decode_wide's kernels (every bucket) at the 4B shapes: no spills, and the
    launch bounds met (ptxas fits the registers to them, spilling if it must); in_proj and
    gate_up (with its SwiGLU) also with their norm folded in (norm_fusion.FOLD_WIDE)."""
    from qwen35_tvm.compile.cuda_toolchain import guard_sm90_asm
    from qwen35_tvm.schedules.sm90a import SM90A_PRELUDE

    # o_proj / out_proj and down add the residual: it is loaded early, into registers
    residual = dict(extra_shapes=("mn",), extra_dtypes=("bfloat16",), epilogue=_residual)
    cases = [(12352, 2560, {}), (2560, 4096, residual), (18432, 2560, {}), (2560, 9216, residual),
             (12352, 2560, {"rms_eps": 1e-6}),
             (18432, 2560, {"rms_eps": 1e-6, "swiglu": True})]  # fmt: skip
    for n, k, kw in cases:
        func = gemv_kernel(n, k, CUDA, plan(n, k, "wide"), out_dtype="bfloat16", **kw)
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "g")})
        lib = tvm.compile(mod, target=CUDA)  # no nvcc here: TVM keeps the source
        (cuda,) = [m for m in lib.mod.imports if m.kind == "cuda"]
        # the 16-64-row buckets of in_proj and gate_up branch to sm_90a's wgmma ring
        (tmp_path / "g.cu").write_text(SM90A_PRELUDE + guard_sm90_asm(cuda.inspect_source()))
        cmd = ["nvcc", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "g.cubin"),
               str(tmp_path / "g.cu")]  # fmt: skip
        info = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
        regs = [int(r) for r in re.findall(r"Used (\d+) registers", info)]
        assert len(regs) == 4 and max(regs) <= 255, (n, k, kw, info)
        assert all(a == b == "0" for a, b in spills) and len(spills) == 4, (n, k, kw, info)
