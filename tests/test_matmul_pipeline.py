"""The CUDA pipeline's choice of GEMM kernels, checked without a GPU: prefill's GEMMs get the
bf16 tensor-core GEMM (schedules/matmul.py: mma in the source, SASS for sm_80 and sm_90, the
wgmma path beside it for sm_90a) and decode's and decode_wide's our GEMV (schedules/gemv.py).
The kernel's own index math is checked in tests/test_matmul_schedule.py.
"""

from __future__ import annotations

import pytest
import tvm
from tvm import relax
from tvm.relax.frontend import nn

from qwen35_tvm.compile.build import build_module
from qwen35_tvm.compile.config import ModelConfig
from qwen35_tvm.compile.layers import Linear
from qwen35_tvm.compile.pipeline import fusion_passes, relax_pipeline
from qwen35_tvm.compile.random_model import SHAPES
from qwen35_tvm.compile.targets import make_target
from qwen35_tvm.compile.vocab import VocabWidths
from qwen35_tvm.schedules import gemv_config
from qwen35_tvm.schedules import matmul_config as mc
from qwen35_tvm.schedules import matmul_rule as rule
from qwen35_tvm.schedules.gemm_match import match_gemm
from qwen35_tvm.schedules.gemv import KERNEL_ATTR
from qwen35_tvm.schedules.sm90a import SM90A_FN

MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"

TARGET, ARCHES = make_target("cuda", "sm_80,sm_90")


def _callees(mod: tvm.IRModule, name: str) -> list[str]:
    """PrimFuncs a lowered Relax function calls (call_tir becomes a direct call)."""
    found: set[str] = set()

    def visit(expr) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.GlobalVar):
            if isinstance(mod[expr.op], tvm.tirx.PrimFunc):
                found.add(expr.op.name_hint)

    relax.analysis.post_order_visit(mod[name].body, visit)
    return sorted(found)


@pytest.fixture(scope="module")
def lowered_tiny() -> tvm.IRModule:
    """The tiny bf16 model through the CUDA pipeline (scheduled and lowered, no codegen)."""
    cfg = ModelConfig.from_hf(SHAPES["tiny"])
    widths = VocabWidths.resolve(cfg.vocab_size, cfg.vocab_size)
    mod, _ = build_module(cfg, widths, "bfloat16", TARGET)
    return relax_pipeline(TARGET)(mod)


def test_prefill_gemms_run_on_tensor_cores(lowered_tiny) -> None:
    gemms = [f for f in _callees(lowered_tiny, "prefill") if "matmul" in f]
    # in_proj, out_proj, qkv_proj, gate_up_proj, down_proj (o_proj shares down_proj's shapes)
    assert len(gemms) == 5, gemms
    for name in gemms:
        func = lowered_tiny[name]
        assert func.attrs.get(mc.ROWS_ATTR) == "large", name
        assert "ptx_legacy.mma" in func.script(), f"{name} is not on tensor cores"
        assert func.attrs.get(KERNEL_ATTR) is None, name


@pytest.mark.parametrize("fn, rows", [("decode", "small"), ("decode_wide", "wide")])
def test_decode_gemms_are_our_gemv(lowered_tiny, fn, rows) -> None:
    gemms = [f for f in _callees(lowered_tiny, fn) if "matmul" in f]
    # the five projections (a sixth where the last down_proj fuses the residual's cast)
    assert len(gemms) >= 5, gemms
    prefill = set(_callees(lowered_tiny, "prefill"))
    for name in gemms:
        func = lowered_tiny[name]
        script = func.script()
        assert name not in prefill and func.attrs.get(mc.ROWS_ATTR) == rows, name
        # schedules/gemv.py, not dlight's GEMV (an rfactor schedule) nor the tiled GEMM
        assert func.attrs.get(KERNEL_ATTR) == "gemv", name
        assert "ptx_legacy.mma" in script and "_rf_local" not in script, name
        assert "ldmatrix" not in script, name
        # decode_wide: buckets of 16-64 rows a pass stream the weight through shared memory
        assert ("cp_async" in script) == (rows == "wide"), name


def test_weights_are_not_transposed_per_call(lowered_tiny) -> None:
    # x · Wᵀ reads W as stored (FuseTransposeMatmul); before, every call transposed every weight
    for name in ("prefill", "decode", "decode_wide"):
        assert not [f for f in _callees(lowered_tiny, name) if f.startswith("transpose")], name


class _Proj(nn.Module):
    """One `Linear` (optionally + a residual input), exported as prefill (n_tok rows), decode
    and decode_wide (batch rows) like the model's projections."""

    def __init__(self, k: int, n: int, residual: bool = False):
        self.proj = Linear(k, n, "bfloat16")
        self.residual = residual

    def prefill(self, x: nn.Tensor, res: nn.Tensor) -> nn.Tensor:
        return res + self.proj(x) if self.residual else self.proj(x)

    decode = decode_wide = prefill

    def export(self) -> tvm.IRModule:
        k, n = self.proj.in_features, self.proj.out_features
        spec = {
            name: {
                "x": nn.spec.Tensor([rows, k], "bfloat16"),
                "res": nn.spec.Tensor([rows, n], "bfloat16"),
                "$": {"param_mode": "plain"},
            }
            for name, rows in (("prefill", "n_tok"), ("decode", "batch"), ("decode_wide", "batch"))
        }
        with TARGET:
            return self.export_tvm(spec=spec)[0]


def _fused(module: _Proj) -> tvm.IRModule:
    with TARGET:
        return tvm.transform.Sequential(fusion_passes(TARGET))(module.export())


def test_epilogue_and_parameter_order_survive() -> None:
    mod = _fused(_Proj(256, 256, residual=True))
    large = [gv for gv, f in mod.functions_items() if f.attrs.get(mc.ROWS_ATTR) == "large"]
    assert len(large) == 1
    func = mod[large[0]]
    match = match_gemm(func)
    assert match is not None and match.extra_shapes == ("mn",)
    kernel = rule.gemm_for(func)
    assert [str(p.dtype) for p in kernel.params] == [str(p.dtype) for p in func.params]
    text = kernel.script()
    assert "ptx_legacy.mma" in text
    # the residual is added to the bf16-rounded product, as in the fused function
    assert 'T.Cast("bfloat16", acc[' in text and " + T.Cast(" in text


def test_unsupported_shapes_fall_back() -> None:
    # k not a multiple of 32: dlight keeps it
    mod = _fused(_Proj(40, 64))
    large = [f for _, f in mod.functions_items() if f.attrs.get(mc.ROWS_ATTR) == "large"]
    assert large and rule.gemm_for(large[0]) is None
    assert rule.MatmulMMA().apply(large[0], TARGET, False) is None


@pytest.mark.parametrize("n, k, residual", [(12352, 2560, False), (2560, 9216, True)])
def test_4b_gemm_builds_mma_sass_for_sm80_and_sm90(tmp_path, n, k, residual) -> None:
    """4B-shaped projections (in_proj; down_proj with its residual add) through the whole
    pipeline and nvcc: the prefill kernel is mma.sync + ldmatrix + cp.async, with a wgmma + TMA
    path for sm_90a, SASS for both."""
    from qwen35_tvm.compile.cuda_toolchain import fatbin_arches, prepare_cuda_codegen

    prepare_cuda_codegen(ARCHES)
    mod = _Proj(k, n, residual).export()
    executable = tvm.compile(mod, TARGET, relax_pipeline=relax_pipeline(TARGET))
    library = tmp_path / "gemm.so"
    executable.export_library(str(library))
    assert fatbin_arches(library)["sass"] == ["sm_80", "sm_90"]

    def modules(m):
        yield m
        for sub in m.imports:
            yield from modules(sub)

    source = "".join(m.inspect_source() for m in modules(executable.mod) if m.kind == "cuda")
    kernels = source.split('extern "C" __global__')
    # A GEMM of several row classes keeps its name for the first ("large") and is copied as
    # NAME_small and NAME_wide for the others; each kernel is declared, then defined.
    heads = [s.split("\n", 1)[0] for s in kernels]
    # TVM's CUDA runtime passes no 64-bit unsigned argument (what a hoisted wgmma descriptor
    # constant became once the split-K launch shared it: schedules/ptx.wgmma_desc_sw128)
    assert not any("uint64_t" in h.split(")", 1)[0] for h in heads)
    decode = [s for s, h in zip(kernels, heads, strict=True) if "_small_kernel(" in h]
    wide = [s for s, h in zip(kernels, heads, strict=True) if "_wide_kernel" in h]
    prefill = [s for s in kernels if "matmul" in s.split("\n", 1)[0]]
    prefill = [s for s in prefill if s not in decode and s not in wide]
    # down_proj (16 tiles of 160 columns) also has a split-K launch (schedules/split_k.py):
    # the GEMM over a z axis of splits, then the kernel summing their partials
    # (definitions only: a declaration names ws_ptr too)
    reduce = [s for s in prefill if "ws_ptr[" in s and "wgmma" not in s]
    split = [s for s in prefill if "ws_ptr[" in s and s not in reduce]
    prefill = [s for s in prefill if "ws_ptr" not in s]
    # in_proj's one-m-tile launch (matmul_rule.small_m_config) is a kernel of its own
    one_tiling = residual or not rule.SMALL_M_TILING
    assert len(prefill) == (2 if one_tiling else 4) and len(decode) == 2 and len(wide) == 8
    assert len(split) == len(reduce) == (1 if residual else 0)
    defined = [s for s in prefill if s.split("\n", 1)[0].rstrip().endswith("{")]
    assert len(defined) == len(prefill) // 2
    for gemm in defined + split:
        assert MMA in gemm and "ldmatrix" in gemm and "cp_async" in gemm
        # ... and beside it the sm_90a path (schedules/matmul_wgmma.py): wgmma fed by TMA
        assert f"{SM90A_FN}()" in gemm and "wgmma" in gemm and "bulk_tensor" in gemm
    # the plain launch stores only the output; the splits store into the workspace, and the
    # reduce reads it only once the GEMM before it is done
    for body in [s.split("{", 1)[1] for s in reduce]:
        assert body.index("griddepcontrol_wait") < body.index("ws_ptr[") and MMA not in body
    host = "".join(m.inspect_source() for m in modules(executable.mod) if m.kind == "llvm")
    assert ("TVMBackendAllocWorkspace" in host) == residual
    # decode: our GEMV (schedules/gemv.py), mma from registers, no shared-memory tiles; at
    # 4B's shapes its weight streams through sm_90's bulk ring (gemv_rule.DECODE_BULK), the
    # copy engine's cp.async.bulk and no other cp.async;
    # decode_wide: a kernel a batch bucket (8, 16, 32, 64 rows a pass), the 8-row one decode's;
    # with gemv_config.WIDE_MMA in_proj's 32- and 64-row ones are the swapped tensor-core GEMM
    # (sm_90a's wgmma ring fed by TMA, mma.sync elsewhere); its 16-row one, down's (20 blocks
    # of 128 rows: too few), or every one without it, the GEMV: the 16-row one's weight ring in
    # registers
    # (gemv_config.ring_in_registers), the 32- and 64-row ones streaming it through shared
    # memory by cp.async
    assert all(MMA in s and "ldmatrix" not in s for s in decode[1:])
    assert all(0 < s.count("cp_async_bulk") == s.count("cp_async") for s in decode[1:])
    wide = [s for s in wide if s.split("\n", 1)[0].rstrip().endswith("{")]  # definitions
    assert len(wide) == 4 and all(MMA in s and "ldmatrix" not in s for s in wide)
    ring = [s for s in wide if f"{SM90A_FN}()" in s]
    assert all("wgmma" in s and "bulk_tensor" in s for s in ring)
    mma = gemv_config.WIDE_MMA and not residual
    assert len(ring) == (2 if mma else 0)
    assert sum("cp_async" in s and "bulk_tensor" not in s for s in wide) == (0 if mma else 2)
