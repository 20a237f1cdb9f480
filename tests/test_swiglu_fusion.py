"""Decode's SwiGLU folded into the gate_up GEMV before it (gemv_kernel's `swiglu`, and the pass
in compile/swiglu_fusion.py that uses it).

- The kernel's CPU variant (its loop nest: a block's gate rows and up rows paired per m16
  tile, k-splitting warps, passes of 8 rows, the pair's epilogue) against the two kernels it
  replaces, the GEMV to bf16 then schedules/activation.py's SwiGLU, bit for bit (both sum
  the same rows in the same order), and against numpy to bf16's rounding; at odd widths and
  k, batches 1-7, 9 and decode_wide's 33, with and without the folded RMSNorm.
- Mutations: up read from gate's row (row j, not I + j), and gate and up swapped in the
  epilogue, fail those checks.
- The pass on a small CUDA module: decode's SwiGLU goes and its gate_up GEMV becomes the fused
  kernel (the norm folded in too where there is one); decode_wide's goes into its gate_up GEMV
  (`WIDE_SWIGLU`; off, it stays), with the norm (not with norm_fusion.FOLD_WIDE off); a gate_up
  with a second reader stays. The norm is the model's, without weight (compile/convert.py).
  Run for the CPU (the pass's mutators, as the pass itself folds for sm_80+ only), the folded
  decode and decode_wide compute what the unfolded ones do: the fused kernel gets its
  arguments where it reads them.
"""

from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend import nn
from tvm.script import tirx as T

from qwen35_tvm.compile import norm_fusion, swiglu_fusion
from qwen35_tvm.compile.layers import MLP, RMSNorm
from qwen35_tvm.compile.norm_fusion import NormFolder
from qwen35_tvm.compile.pipeline import fusion_passes
from qwen35_tvm.compile.swiglu_fusion import SwigluFolder
from qwen35_tvm.compile.targets import make_target
from qwen35_tvm.schedules import gemv_store
from qwen35_tvm.schedules.activation import INTER_ATTR, swiglu
from qwen35_tvm.schedules.gemv import KERNEL_ATTR, GemvConfig, gemv_kernel
from qwen35_tvm.schedules.gemv_rule import plan

LLVM = tvm.target.Target("llvm")
CUDA, _ = make_target("cuda", "sm_90")
BF16 = ml_dtypes.bfloat16
EPS = 1e-6


def _bf16_gate_up(acc, _row, _col, _extras):
    return T.Cast("bfloat16", acc)  # the gate_up GEMM's epilogue: fp32 sum rounded to bf16


def _call(func: tvm.tirx.PrimFunc, *arrays: np.ndarray) -> np.ndarray:
    """Run `func` on the CPU; the last array is the output."""
    lib = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)
    args = [tvm.runtime.tensor(a) for a in arrays]
    lib["main"](*args)
    return args[-1].numpy()


def _run(inter: int, k: int, batch: int, cfg, norm: bool) -> tuple[np.ndarray, ...]:
    """(fused kernel's, GEMV + SwiGLU kernels', numpy's) SwiGLU of x · W_gate_upᵀ, bf16, x
    RMSNorm'd first with `norm`. Without the norm, x and W are multiples of 1/8: every sum
    is exact in fp32."""
    cfg = plan(2 * inter, k, "wide") if cfg == "wide" else cfg
    rng = np.random.default_rng(inter * k + batch)
    x = (rng.integers(-8, 9, (batch, k)) / 8).astype(BF16)
    w = (rng.integers(-8, 9, (2 * inter, k)) / 8).astype(BF16)
    kw = {"out_dtype": "bfloat16", "epilogue": _bf16_gate_up, "rms_eps": EPS if norm else None}
    ins = (x, w)
    fused = _call(gemv_kernel(2 * inter, k, LLVM, cfg, swiglu=True, **kw), *ins,
                  np.zeros((batch, inter), BF16))  # fmt: skip
    gate_up = _call(gemv_kernel(2 * inter, k, LLVM, cfg, **kw), *ins,
                    np.zeros((batch, 2 * inter), BF16))  # fmt: skip
    two = _call(swiglu(inter, "bfloat16", LLVM), gate_up, np.zeros((batch, inter), BF16))
    xf = x.astype(np.float64)
    if norm:
        xf = xf / np.sqrt((xf * xf).mean(1, keepdims=True) + EPS)
    gu = (xf @ w.astype(np.float64).T).astype(BF16).astype(np.float64)
    gate, up = gu[:, :inter], gu[:, inter:]
    return fused, two, gate / (1 + np.exp(-gate)) * up


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a.view(np.uint16), b.view(np.uint16)))


def _off(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max())


# (inter, k, batch, config): I off the tile (8 columns an m-tile), k below one step (64) or
# with a tail, uneven warps, batch 1-7 and 9 (two passes), decode_wide's buckets
CASES = [
    (20, 24, 1, GemvConfig(m_tiles=1, warps_k=3)),
    (36, 200, 2, GemvConfig(m_tiles=2, warps_k=2, unroll=1)),
    (36, 200, 3, GemvConfig(m_tiles=1, warps_k=3, stages=3)),
    (65, 136, 4, None),
    (20, 24, 5, GemvConfig(m_tiles=2, warps_k=1)),
    (65, 136, 6, GemvConfig(m_tiles=1, warps_k=4)),
    (36, 200, 7, None),
    (36, 200, 9, GemvConfig(m_tiles=2, warps_k=3)),
    (36, 200, 33, "wide"),
]


@pytest.mark.parametrize("inter, k, batch, cfg", CASES)
@pytest.mark.parametrize("norm", [False, True])
def test_cpu_kernel_matches_gemv_then_swiglu(inter, k, batch, cfg, norm) -> None:
    fused, two, ref = _run(inter, k, batch, cfg, norm)
    assert _bits_equal(fused, two)
    assert _off(fused, ref) < 2**-8  # bf16's rounding of the output


@pytest.mark.parametrize(
    "mutation",
    [
        # up read from the gate's row j instead of I + j
        ("paired_row", lambda v: (v // 16 * 8 + v % 8, 0)),
        # the epilogue takes up's sum as gate and gate's as up
        ("pair_rows", lambda c: (c // 8 * 16 + c % 8 + 8, c // 8 * 16 + c % 8)),
    ],
)
def test_wrong_pairing_is_caught(monkeypatch, mutation) -> None:
    monkeypatch.setattr(gemv_store, *mutation)
    fused, two, ref = _run(36, 200, 7, GemvConfig(m_tiles=2, warps_k=3), norm=False)
    assert not _bits_equal(fused, two)
    assert _off(fused, ref) > 0.05


def test_swiglu_needs_an_even_n() -> None:
    with pytest.raises(ValueError, match="even"):
        gemv_kernel(41, 24, LLVM, GemvConfig(), swiglu=True)


# ---- the pass ---------------------------------------------------------------------------------

K, INTER = 64, 48


class _Block(nn.Module):
    """An MLP (compile/layers.py's), behind an RMSNorm with `norm`; with `shared` its gate_up
    also returned, so that it has a second reader."""

    def __init__(self, norm: bool, shared: bool):
        self.norm = RMSNorm(K, EPS, weighted=False) if norm else None
        self.mlp = MLP(SimpleNamespace(hidden_size=K, intermediate_size=INTER), "bfloat16")
        self.shared = shared

    def decode(self, x: nn.Tensor):
        gate_up = self.mlp.gate_up_proj(self.norm(x) if self.norm else x)
        y = self.mlp.down_proj(self.mlp.activate(gate_up))
        return (y, gate_up) if self.shared else y

    prefill = decode_wide = decode


def _exported(norm: bool, shared: bool, fns=("decode", "decode_wide", "prefill")):
    rows = {"decode": "batch", "decode_wide": "batch", "prefill": "tokens"}
    spec = {
        fn: {"x": nn.spec.Tensor([rows[fn], K], "bfloat16"), "$": {"param_mode": "plain"}}
        for fn in fns
    }
    return _Block(norm, shared).export_tvm(spec=spec)


def _lowered(norm: bool, shared: bool) -> tvm.IRModule:
    with CUDA:
        mod, _ = _exported(norm, shared)
        return tvm.transform.Sequential(fusion_passes(CUDA))(mod)


def _calls(mod: tvm.IRModule, fn: str) -> list[str]:
    text = mod[fn].script()
    return [line.split("R.call_tir(")[1].split(",")[0] for line in text.splitlines()
            if "R.call_tir(" in line]  # fmt: skip


def _swiglus(mod: tvm.IRModule, fn: str) -> list[str]:
    """The SwiGLU kernels `fn` calls, found by their attribute."""
    return [c for c in _calls(mod, fn) if (mod[c].attrs or {}).get(INTER_ATTR) is not None]


@pytest.mark.parametrize("norm", [False, True])
def test_decode_swiglu_folds_into_gate_up(norm) -> None:
    mod = _lowered(norm, shared=False)
    decode = _calls(mod, "decode")
    assert not _swiglus(mod, "decode"), decode
    suffix = "_rms_norm_swiglu" if norm else "_swiglu"
    fused = [c for c in decode if c.endswith(suffix)]
    assert len(fused) == 1, decode
    kernel = mod[fused[0]]
    assert kernel.attrs[KERNEL_ATTR] == "gemv" and kernel.attrs["tirx.is_scheduled"]
    out = kernel.params[-1]
    assert [int(d) for d in out.shape[1:]] == [INTER] and out.dtype == "bfloat16"
    weight = kernel.params[1]
    assert [int(d) for d in weight.shape] == [2 * INTER, K]  # the weight as stored
    # the norm went with it: nothing in decode normalises or reads gate_up any more
    assert not any(c.startswith("rms_") for c in decode), decode
    # decode_wide: the SwiGLU and the norm folded too (norm_fusion.FOLD_WIDE)
    wide = _calls(mod, "decode_wide")
    assert not _swiglus(mod, "decode_wide"), wide
    fused_wide = [c for c in wide if c.endswith("_swiglu")]
    assert len(fused_wide) == 1 and ("_rms_norm" in fused_wide[0]) == norm, wide
    assert mod[fused_wide[0]].attrs[KERNEL_ATTR] == "gemv"
    assert not any(c.startswith("rms_") for c in wide), wide


def test_wide_gate_up_leaves_its_norm_with_the_switch_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(norm_fusion, "FOLD_WIDE", False)
    mod = _lowered(norm=True, shared=False)
    wide = _calls(mod, "decode_wide")
    fused_wide = [c for c in wide if c.endswith("_swiglu")]
    assert len(fused_wide) == 1 and "_rms_norm" not in fused_wide[0], wide
    assert any(c.startswith("rms_scale") for c in wide), wide


def test_wide_swiglu_stays_with_the_flag_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(swiglu_fusion, "WIDE_SWIGLU", False)
    mod = _lowered(norm=True, shared=False)
    assert len(_swiglus(mod, "decode_wide")) == 1, _calls(mod, "decode_wide")
    assert not _swiglus(mod, "decode")


def test_prefill_swiglu_folds_into_the_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """With PREFILL_GEMM_SWIGLU (the default), prefill's gate_up GEMM becomes our tensor-core
    GEMM storing [tokens, INTER], its SwiGLU gone. Off, prefill keeps it."""
    assert swiglu_fusion.PREFILL_GEMM_SWIGLU
    mod = _lowered(norm=True, shared=False)
    prefill = _calls(mod, "prefill")
    assert not _swiglus(mod, "prefill"), prefill
    fused = [c for c in prefill if c.endswith("_swiglu")]
    assert len(fused) == 1, prefill
    kernel = mod[fused[0]]
    assert kernel.attrs["tirx.is_scheduled"] and "wgmma" in kernel.script()
    out, weight = kernel.params[-1], kernel.params[1]
    assert [int(d) for d in out.shape[1:]] == [INTER] and out.dtype == "bfloat16"
    assert [int(d) for d in weight.shape] == [2 * INTER, K]  # the weight as stored
    with_second_reader = _lowered(norm=True, shared=True)
    assert len(_swiglus(with_second_reader, "prefill")) == 1
    monkeypatch.setattr(swiglu_fusion, "PREFILL_GEMM_SWIGLU", False)
    assert len(_swiglus(_lowered(norm=True, shared=False), "prefill")) == 1


def test_gate_up_with_another_reader_stays() -> None:
    mod = _lowered(norm=True, shared=True)
    decode = _calls(mod, "decode")
    assert len(_swiglus(mod, "decode")) == 1, decode
    assert not any(c.endswith("_swiglu") for c in decode), decode
    # the norm still folds into the gate_up GEMV (compile/norm_fusion.py)
    assert any(c.endswith("_rms_norm") for c in decode), decode


def _cpu_decode(
    norm: bool, fold: bool, x: np.ndarray, rng: np.random.Generator, fn: str = "decode"
) -> np.ndarray:
    """`fn` (decode or decode_wide) of the block built for the CPU, with or without the two
    folds, on x and weights of multiples of 1/8."""
    with LLVM:
        mod, params = _exported(norm, False, (fn,))
        mod = tvm.transform.Sequential(fusion_passes(LLVM))(mod)  # the folds: no-ops here
        if fold:
            mod = NormFolder(SwigluFolder(mod, LLVM).fold_module(), LLVM).fold_module()
        assert not [p for _, p in params if p.dtype != "bfloat16"]  # the norm has no weight
        vm = relax.VirtualMachine(tvm.compile(mod, target=LLVM), tvm.cpu())
    assert any(c.endswith("_swiglu") for c in _calls(mod, fn)) == fold
    args = [x]
    for _, p in params:
        args.append((rng.integers(-8, 9, [int(d) for d in p.shape]) / 8).astype(BF16))
    return vm[fn](*(tvm.runtime.tensor(a) for a in args)).numpy().astype(np.float64)


@pytest.mark.parametrize("norm", [False, True])
def test_folded_decode_computes_the_same_on_the_cpu(norm) -> None:
    x = (np.random.default_rng(1).integers(-8, 9, (5, K)) / 8).astype(BF16)
    plain, folded = (_cpu_decode(norm, fold, x, np.random.default_rng(2)) for fold in (0, 1))
    if norm:  # the folded norm scales the fp32 sum; the norm kernel's output is bf16
        assert _off(folded.astype(BF16), plain) < 2**-6
    else:  # exact sums: the same bits
        assert _bits_equal(folded.astype(BF16), plain.astype(BF16))


@pytest.mark.parametrize("fold_wide", [False, True])
@pytest.mark.parametrize("norm", [False, True])
def test_folded_decode_wide_computes_the_same_on_the_cpu(monkeypatch, norm, fold_wide) -> None:
    """decode_wide's fold takes the SwiGLU, and the norm with FOLD_WIDE: at 9 rows (its
    16-row bucket) and 33 (two passes of 32), the same bits where the norm stays a kernel."""
    monkeypatch.setattr(norm_fusion, "FOLD_WIDE", fold_wide)
    for rows in (9, 33):
        x = (np.random.default_rng(rows).integers(-8, 9, (rows, K)) / 8).astype(BF16)
        plain, folded = (
            _cpu_decode(norm, fold, x, np.random.default_rng(2), "decode_wide") for fold in (0, 1)
        )
        if norm and fold_wide:
            assert _off(folded.astype(BF16), plain) < 2**-6, rows
        else:
            assert _bits_equal(folded.astype(BF16), plain.astype(BF16)), rows
