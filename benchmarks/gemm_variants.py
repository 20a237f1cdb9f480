"""The kernels benchmarks/gemm_kernel.py builds: the models' projection shapes, the PrimFuncs
the CUDA pipeline fuses of each, and each scheduled by the pipeline's rule and at the other
tilings (VARIANTS, WGMMA_VARIANTS). benchmarks/gemv_kernel.py takes its shapes and decode
PrimFuncs from here too."""

from __future__ import annotations

from fnmatch import fnmatch
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tvm.target import Target
    from tvm.tirx import PrimFunc

# name -> GemmConfig fields; "mma" is the default the pipeline uses. Per variant on sm_90
# (ptxas -v, down_proj shape): registers, CTAs an SM (by registers and shared memory), warps.
_PAIR = {"pair_store": True}
VARIANTS = {
    "mma": {},  # 128x128x32 s3, 4 warps of 64x64: 254 regs, 2 CTAs, 8 warps an SM
    "mma_pair": _PAIR,  # the same, bf16x2 epilogue stores: 230 regs
    "mma_s4": {**_PAIR, "stages": 4},  # 64 KB
    "mma_bk64": {**_PAIR, "block_k": 64},  # 96 KB, 2 CTAs
    "mma_bk64_s4": {**_PAIR, "block_k": 64, "stages": 4},  # 128 KB, 1 CTA
    # 8 warps of 64x32: 128 regs, 2 CTAs = 16 warps an SM
    "mma_8w": {**_PAIR, "warps_n": 4},
    "mma_8w_s4": {**_PAIR, "warps_n": 4, "stages": 4},
    "mma_8w_bk64": {**_PAIR, "warps_n": 4, "block_k": 64},
    # 8 warps of 64x64 on a larger tile: less L2 traffic a flop, 1 CTA an SM
    "mma_128x256": {**_PAIR, "block_n": 256, "warps_n": 4, "stages": 4},
    "mma_256x128": {**_PAIR, "block_m": 256, "warps_m": 4, "stages": 4},
    # small N (2,560 x M 1,024 = 160 tiles of 128x128 on 132 SMs): twice the tiles, 4 CTAs an SM
    "mma_128x64": {**_PAIR, "block_n": 64, "stages": 4},
    "mma_128x64_bk64": {**_PAIR, "block_n": 64, "block_k": 64},
    "mma_64x128": {**_PAIR, "block_m": 64, "stages": 4},
    # frag_pipeline: the next tile's first fragments load under the last k16 step's mma
    "mma_fp": {**_PAIR, "frag_pipeline": True},  # 232 regs
    "mma_fp_bk64": {**_PAIR, "frag_pipeline": True, "block_k": 64},  # 246 regs, 96 KB
    "mma_8w_fp": {**_PAIR, "frag_pipeline": True, "warps_n": 4},
    "mma_128x64_fp": {**_PAIR, "frag_pipeline": True, "block_n": 64, "stages": 4},
}
# name -> WgmmaConfig fields: sm_90a runs wgmma, other arches the 8-warp mma.sync tiling that
# shares the launch (matmul.shared_launch_config); "mma" above is now the pipeline's choice
# among these (matmul_wgmma.default_wgmma_config), "mma_only" the mma.sync default before it.
WGMMA_VARIANTS = {
    "wg_256s3": {"block_n": 256, "stages": 3},
    "wg_192s4": {"block_n": 192, "stages": 4},
    "wg_160s4": {"block_n": 160, "stages": 4},
    "wg_128s5": {"block_n": 128, "stages": 5},
    "wg_128s4": {"block_n": 128, "stages": 4},
    # TMA loads and mbarriers instead of every thread's cp.async and a block barrier a k tile
    "tma_256s3": {"block_n": 256, "stages": 3, "tma": True},
    "tma_192s4": {"block_n": 192, "stages": 4, "tma": True},
    "tma_160s4": {"block_n": 160, "stages": 4, "tma": True},
    "tma_128s5": {"block_n": 128, "stages": 5, "tma": True},
    "tma_128s4": {"block_n": 128, "stages": 4, "tma": True},
    # 97 KB: two CTAs an SM, where the registers allow, so one's epilogue overlaps the other's
    # math
    "tma_128s3": {"block_n": 128, "stages": 3, "tma": True},
    "tma_96s3": {"block_n": 96, "stages": 3, "tma": True},
    "tma_160s3": {"block_n": 160, "stages": 3, "tma": True},
    "tma_64s4": {"block_n": 64, "stages": 4, "tma": True},
    # one m tile (mixed steps: m <= 128): as many column tiles as SMs, so none idles
    "tma_144s4": {"block_n": 144, "stages": 4, "tma": True},
    "tma_96s4": {"block_n": 96, "stages": 4, "tma": True},
    "tma_80s4": {"block_n": 80, "stages": 4, "tma": True},
    "tma_48s4": {"block_n": 48, "stages": 4, "tma": True},
    "tma_32s6": {"block_n": 32, "stages": 6, "tma": True},
    # deeper rings than sm_80's 163 KB allows: for libraries built with --arch sm_90 only
    "tma_256s4_90": {"block_n": 256, "stages": 4, "tma": True, "sm90_only": True},
    "tma_192s5_90": {"block_n": 192, "stages": 5, "tma": True, "sm90_only": True},
    "tma_160s6_90": {"block_n": 160, "stages": 6, "tma": True, "sm90_only": True},
    "tma_128s7_90": {"block_n": 128, "stages": 7, "tma": True, "sm90_only": True},
    # persistent: 132 CTAs (the H200's SMs) loop over the tiles, the ring running across them
    "tma_192s4_p": {"block_n": 192, "stages": 4, "tma": True, "ctas": 132},
    "tma_160s4_p": {"block_n": 160, "stages": 4, "tma": True, "ctas": 132},
    "tma_256s3_p": {"block_n": 256, "stages": 3, "tma": True, "ctas": 132},
    "tma_256s4_90p": {"block_n": 256, "stages": 4, "tma": True, "sm90_only": True, "ctas": 132},
}

# the pipeline's kernel with the SwiGLU epilogue (off in the pipeline until checked here:
# compile/swiglu_fusion.PREFILL_GEMM_SWIGLU); built for every projection without a residual
SWIGLU = "prefill_swiglu"


def projections(shapes: tuple[str, ...] = ("4b",)) -> list[dict]:
    """The models' distinct (N, K, residual) projections, with the names that have them."""
    from qwen35_tvm.compile.config import ModelConfig
    from qwen35_tvm.compile.random_model import SHAPES

    out: dict[tuple, dict] = {}
    for shape in shapes:
        c = ModelConfig.from_hf(SHAPES[shape])
        nh, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        hv = c.linear_num_value_heads
        named = [
            ("in_proj", c.conv_dim + c.value_dim + 2 * hv, c.hidden_size, False),
            ("out_proj", c.hidden_size, c.value_dim, True),
            ("qkv_proj", (2 * nh + 2 * nkv) * d, c.hidden_size, False),
            ("o_proj", c.hidden_size, nh * d, True),
            ("gate_up_proj", 2 * c.intermediate_size, c.hidden_size, False),
            ("down_proj", c.hidden_size, c.intermediate_size, True),
        ]
        for name, n, k, res in named:
            out.setdefault((n, k, res), {"n": n, "k": k, "residual": res, "names": []})
            out[(n, k, res)]["names"].append(f"{shape}.{name}")
    return list(out.values())


def fused_pair(n: int, k: int, residual: bool, target: Target) -> tuple[PrimFunc, PrimFunc]:
    """The prefill ("large") and decode ("small") PrimFuncs the pipeline makes of the Linear."""
    import tvm
    from tvm.relax.frontend import nn

    from qwen35_tvm.compile.layers import Linear
    from qwen35_tvm.compile.pipeline import fusion_passes
    from qwen35_tvm.schedules.matmul_config import ROWS_ATTR

    class Proj(nn.Module):
        def __init__(self):
            self.proj = Linear(k, n, "bfloat16")

        def prefill(self, x: nn.Tensor, res: nn.Tensor) -> nn.Tensor:
            return res + self.proj(x) if residual else self.proj(x)

        decode = prefill

    spec = {
        name: {
            "x": nn.spec.Tensor([rows, k], "bfloat16"),
            "res": nn.spec.Tensor([rows, n], "bfloat16"),
            "$": {"param_mode": "plain"},
        }
        for name, rows in (("prefill", "n_tok"), ("decode", "batch"))
    }
    with target:
        mod, _ = Proj().export_tvm(spec=spec)
        mod = tvm.transform.Sequential(fusion_passes(target))(mod)
    found = {}
    for _, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc) and func.attrs.get(ROWS_ATTR):
            found[str(func.attrs[ROWS_ATTR])] = func
    return found["large"], found["small"]


def param_roles(func: PrimFunc) -> dict[str, int]:
    from qwen35_tvm.schedules.gemm_match import match_gemm

    m = match_gemm(func)
    roles = {"x": m.a_param, "w": m.b_param, "out": m.out_param}
    if m.extra_params:
        roles["res"] = m.extra_params[0]
    return roles


def variant_kernels(
    n: int, k: int, residual: bool, target: Target, baselines: bool, only: str | None
) -> tuple[dict, dict, dict]:
    """{kernel name: scheduled PrimFunc}, {kernel name: why it failed}, parameter roles."""
    from tvm.s_tir import dlight as dl

    from qwen35_tvm.schedules.matmul_config import GemmConfig, default_config
    from qwen35_tvm.schedules.matmul_rule import MatmulMMA, gemm_for
    from qwen35_tvm.schedules.matmul_wgmma import WgmmaConfig

    large, small = fused_pair(n, k, residual, target)

    def rule(r, func):
        sch = r.apply(func.with_attr("dlight.do_not_tensorize", True), target, False)
        return None if sch is None else sch.mod["main"]

    makers = {
        "prefill_mma": lambda: rule(MatmulMMA(), large),
        "prefill_mma_only": lambda: gemm_for(large, default_config(n)),
    }
    for name, fields in VARIANTS.items():
        if name != "mma":
            makers[f"prefill_{name}"] = lambda f=fields: gemm_for(large, GemmConfig(**f))
    for name, fields in WGMMA_VARIANTS.items():
        makers[f"prefill_{name}"] = lambda f=fields: gemm_for(large, None, WgmmaConfig(**f))
    # the pipeline's kernel without split-K (schedules/split_k.py), as before it
    makers["prefill_nosplit"] = lambda: gemm_for(large, None, "default", split_k=False)
    # with and without the one-m-tile launch (matmul_rule.small_m_config, SMALL_M_TILING)
    makers["prefill_small"] = lambda: gemm_for(large, None, "default", small_m=True)
    makers["prefill_nosmall"] = lambda: gemm_for(large, None, "default", small_m=False)
    # two splits where they fill the SMs (one m tile of 64-65 column tiles: qkv, in_proj)
    makers["prefill_split2"] = lambda: gemm_for(large, None, "default", min_splits=2)
    if not residual:  # the pipeline's kernel storing the SwiGLU of its two halves, [m, n / 2]
        makers[SWIGLU] = lambda: gemm_for(large, None, "default", swiglu=True)
        makers[f"{SWIGLU}_nosplit"] = lambda: gemm_for(
            large, None, "default", swiglu=True, split_k=False
        )
        makers[f"{SWIGLU}_small"] = lambda: gemm_for(
            large, None, "default", swiglu=True, small_m=True
        )
        makers[f"{SWIGLU}_nosmall"] = lambda: gemm_for(
            large, None, "default", swiglu=True, small_m=False
        )
        makers[f"{SWIGLU}_split2"] = lambda: gemm_for(
            large, None, "default", swiglu=True, min_splits=2
        )
        for name, fields in WGMMA_VARIANTS.items():  # the SwiGLU at the other TMA tilings
            if fields.get("tma") and fields["block_n"] % 16 == 0:
                makers[f"{SWIGLU}_{name}"] = lambda f=fields: gemm_for(
                    large, None, WgmmaConfig(**f), swiglu=True
                )
    if only:
        wanted = [name for name in makers if any(fnmatch(name, g) for g in only.split(","))]
        makers = {name: makers[name] for name in wanted}
    if baselines:
        makers["prefill_simt"] = lambda: rule(dl.gpu.Matmul(), large)
        makers["decode_gemv"] = lambda: rule(dl.gpu.LowBatchGEMV(4), small)
        makers["decode_simt"] = lambda: rule(dl.gpu.Matmul(), small)
    kernels, errors = {}, {}
    for name, make in makers.items():
        try:
            with target:
                func = make()
            if func is None:
                raise RuntimeError("the rule did not apply")
            kernels[name] = func.with_attr("tirx.is_scheduled", True)
        except Exception as err:  # noqa: BLE001  keep building the others
            errors[name] = f"{type(err).__name__}: {err}"
    return kernels, errors, param_roles(large)
