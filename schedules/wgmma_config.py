"""The sm_90a GEMM's tilings (schedules/matmul_wgmma.py, which re-exports them): a tile of
BLOCK_M rows x block_n columns, k BLOCK_K at a time through a ring of `stages` shared-memory
stages, and the shared memory a launch may take."""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_M = 128  # two warpgroups of m64
BLOCK_K = 64  # one 128-byte swizzle row of bf16
THREADS = 256
ROW_BYTES = BLOCK_K * 2
ALIGN = 1024  # the 128-byte swizzle repeats every 8 rows: tiles start on 1,024 bytes
# the launch is shared with the sm_80 path, so its shared memory must fit sm_80's opt-in limit
SM80_SHARED_BYTES = 163 * 1024
SM90_SHARED_BYTES = 227 * 1024


@dataclass(frozen=True)
class WgmmaConfig:
    block_n: int = 192
    stages: int = 4
    # TMA loads (one thread issues a stage, mbarriers in place of block barriers); else every
    # thread copies its chunks by cp.async
    tma: bool = False
    # for a library without sm_80 code (`--arch sm_90`): the launch may take sm_90's 227 KB,
    # room for deeper rings (benchmarks/gemm_variants.py's *_90 rows; the defaults keep 163 KB)
    sm90_only: bool = False
    # persistent (TMA only): this many CTAs loop over the tiles, the ring running on across
    # them, so a tile's epilogue overlaps the next tile's first loads; 0: a CTA a tile
    ctas: int = 0

    @property
    def stage_bytes(self) -> int:
        return (BLOCK_M + self.block_n) * ROW_BYTES

    @property
    def shared_bytes(self) -> int:
        # slack to move the ring onto a 1,024-byte boundary, wherever the buffer starts; after
        # the ring, a full and an empty mbarrier a stage (8 bytes each)
        return self.stages * self.stage_bytes + ALIGN + 16 * self.stages

    def check(self) -> None:
        if self.block_n % 8 or not 8 <= self.block_n <= 256:
            raise ValueError(f"block_n {self.block_n}: wgmma takes n in 8..256, a multiple of 8")
        if self.stages < 3 or not self.tma and self.block_n * BLOCK_K // 8 % THREADS:
            raise ValueError(f"{self}: 3+ stages; the B tile's chunks must split over {THREADS}"
                             " threads (cp.async)")  # fmt: skip
        if self.ctas and not self.tma:
            raise ValueError(f"{self}: a persistent tiling needs TMA")
        limit = SM90_SHARED_BYTES if self.sm90_only else SM80_SHARED_BYTES
        if self.shared_bytes > limit:
            raise ValueError(f"{self}: {self.shared_bytes} bytes: over {limit // 1024} KB")


def default_wgmma_config(n: int) -> WgmmaConfig:
    """The tiling by output width, from the H200 sweeps (docs/results/gemm_kernel_tma.json and
    gemm_kernel_2cta_experiment.json, 10 4B/9B shapes at m = 1,024 and 4,096; TMA beat
    cp.async by 4-8% geomean). n = 2,560 in 16 tiles of 160 makes 128 blocks at m = 1,024 for
    132 SMs. Other multiples of 160 (qkv, 10,240) take 160-column tiles three deep, 109 KB, so
    two CTAs share an SM: 512 tiles in two rounds, where 192 columns left a partial last tile
    and 432 tiles in 3.3 rounds (0.73 -> 0.82x cuBLAS at m = 1,024, the same at 4,096). 4,096
    runs best in 256-column tiles three deep, wider outputs in 192-column tiles four deep."""
    if n % 160 == 0:
        return WgmmaConfig(block_n=160, stages=4 if n <= 2560 else 3, tma=True)
    if n <= 4096:
        return WgmmaConfig(block_n=256, stages=3, tma=True)
    return WgmmaConfig(block_n=192, stages=4, tma=True)
