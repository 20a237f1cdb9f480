"""The mma.sync GEMM's tilings (schedules/matmul.py) and the marks the pipeline puts on fused
GEMM PrimFuncs: which rows (prefill, decode, wide decode) a GEMM serves, and whether a target
has the tensor cores our kernels use."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tvm.target import Target

# Set on fused GEMM PrimFuncs by the pipeline: "large" (prefill: this kernel) or "small" (decode:
# dlight's GEMV rules). Prefill and decode share PrimFuncs until the pipeline splits them.
ROWS_ATTR = "qwen35.gemm_rows"
# Flat element offsets stay int32: m * max(n, k) must stay below 2**31 (m <= 116k at n = 18432).
MIN_SM = 80  # cp.async, ldmatrix and bf16 mma.sync


def has_tensor_cores(target: Target) -> bool:
    """Whether `target` is CUDA at sm_80 or later (MIN_SM), where our mma kernels run."""
    arch = str(target.attrs.get("arch", ""))
    return (
        target.kind.name == "cuda"
        and arch.startswith("sm_")
        and arch[3:].isdigit()
        and int(arch[3:]) >= MIN_SM
    )


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 32
    warps_m: int = 2
    warps_n: int = 2
    stages: int = 3
    # epilogue: each lane stores its two adjacent columns as one 4-byte (bf16x2) / 8-byte
    # (fp32x2) access instead of two scalar ones (needs n even, else scalar stores)
    pair_store: bool = False
    # main loop: the barrier moves to the last k16 step of a tile, so the next tile's first
    # fragments load while that step's mma run (two fragment sets, alternating)
    frag_pipeline: bool = False

    @property
    def threads(self) -> int:
        return self.warps_m * self.warps_n * 32

    @property
    def shared_bytes(self) -> int:
        return self.stages * (self.block_m + self.block_n) * self.block_k * 2

    def check(self) -> None:
        """Raise ValueError if the tiling cannot be built."""
        warp_m, warp_n = self.block_m // self.warps_m, self.block_n // self.warps_n
        if self.block_k not in (32, 64):
            raise ValueError(f"block_k {self.block_k}: 32 or 64")
        if warp_m % 16 or warp_n % 16 or warp_m * self.warps_m != self.block_m:
            raise ValueError(f"warp tile {warp_m}x{warp_n}: multiples of 16 that tile the block")
        if warp_n * self.warps_n != self.block_n or self.stages < 2:
            raise ValueError(f"{self}: warps must tile block_n; stages >= 2")
        chunks = (self.block_m + self.block_n) * self.block_k // 8
        if chunks % self.threads or self.block_m * self.block_k // 8 % self.threads:
            raise ValueError(f"{self}: tile copies must split evenly over the threads")


# H200 sweep (docs/results/gemm_kernel.json, 18 tilings x 10 4B/9B shapes at M 1,024 and
# 4,096): block_k 64 with the fragment pipeline and paired stores took 0.83x the time of the
# 32-deep default (geomean), 0.51x cuBLAS; no tiling was wrong.
DEFAULT_CONFIG = GemmConfig(block_k=64, pair_store=True, frag_pipeline=True)
# Narrow outputs (o_proj, down: n = 2,560) tile n by 64: 128 x 128 tiles make 160 blocks at
# m = 1,024, 1.2 waves on 132 SMs; in the sweep 128 x 64 ran those shapes 1.1-1.2x faster.
NARROW_N = 4096


def default_config(n: int) -> GemmConfig:
    """The prefill tiling for an output `n` wide."""
    return replace(DEFAULT_CONFIG, block_n=64) if n <= NARROW_N else DEFAULT_CONFIG


# Decode batches of 8-64 rows: a 64-row tile, deeper k steps (0.9x cuBLAS at m = 16 on an H200,
# where the GEMV rules reach 0.33x).
WIDE_DECODE_CONFIG = GemmConfig(block_m=64, block_k=64, stages=4)
