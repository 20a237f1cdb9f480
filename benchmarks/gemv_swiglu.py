"""The gate_up rows of benchmarks/gemv_kernel.py with decode's SwiGLU folded in
(gemv_kernel's `swiglu`, compile/swiglu_fusion.py), beside what decode ran before:

  ours_swiglu      the GEMV storing silu(gate) · up [batch, I] (default config)
  ours_rms_swiglu  ... with the RMSNorm before it folded in too (what decode runs)
  swiglu           schedules/activation.py's kernel alone, on the bf16 gate_up; before the
                   fold decode ran ours_rms (the GEMV to gate_up) and then this

Each is checked against torch: silu(gate) · up of the fp32 GEMM rounded to bf16 (as gate_up
is stored), in fp32. Bytes moved: the weight, x and out [batch, I];
the SwiGLU alone reads gate_up [batch, 2 I] and writes out.
"""

from __future__ import annotations

from collections.abc import Callable

GLU = "_swiglu"  # the suffix of a fused kernel's name
ALONE = "swiglu"


def is_gate_up(names: list[str]) -> bool:
    return any(name.endswith(".gate_up_proj") for name in names)


def makers(func, target, rms_eps: float, rows: str = "small") -> dict[str, Callable]:
    """{kernel name: () -> PrimFunc} for the decode gate_up GEMM `func` (its fused PrimFunc),
    decode's ("small") or decode_wide's ("wide"; the norm's fold there is norm_fusion.FOLD_WIDE)."""
    from qwen35_tvm.schedules.activation import swiglu
    from qwen35_tvm.schedules.gemm_match import match_gemm
    from qwen35_tvm.schedules.gemv_rule import gemv_for

    match = match_gemm(func)
    return {
        f"ours{GLU}": lambda: gemv_for(func, target, rows=rows, swiglu=True),
        f"ours_rms{GLU}": lambda: gemv_for(func, target, rows=rows, rms_eps=rms_eps, swiglu=True),
        ALONE: lambda: swiglu(match.n // 2, match.out_dtype, target),
    }


def is_rms(kernel: str) -> bool:
    """Whether `kernel` reads x as the input of an RMSNorm (without weight)."""
    return kernel.removesuffix(GLU).endswith("_rms")


def out_cols(kernel: str, n: int) -> int:
    return n // 2 if kernel.endswith(GLU) or kernel == ALONE else n


def bytes_moved(kernel: str, batch: int, n: int, k: int, itemsize: int, residual: bool) -> int:
    """Bytes `kernel` must read and write at least, at `batch` rows of an [n, k] weight."""
    out = batch * out_cols(kernel, n) * itemsize
    if kernel == ALONE:
        return batch * n * itemsize + out
    return n * k * 2 + batch * k * 2 + out + (batch * n * 2 if residual else 0)


def reference(torch, kernel: str, gemm: object) -> object:
    """What `kernel` should give, from the fp32 GEMM (the norm applied where it folds one)."""
    if not (kernel.endswith(GLU) or kernel == ALONE):
        return gemm
    gate, up = gemm.bfloat16().float().chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up
