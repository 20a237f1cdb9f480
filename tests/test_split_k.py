"""Split-K of prefill's GEMM (schedules/split_k.py), checked without a GPU: how many splits an
m gets at the 4B and 9B shapes, and the k ranges the splits take. The emulations of
test_matmul_wgmma.py run the kernel's tiles over those ranges; benchmarks/gemm_kernel.py checks
the built kernels on the GPU at m = 16 to 4,096 against an fp32 reference."""

from __future__ import annotations

import pytest
from tvm import tirx

from qwen35_tvm.schedules import split_k
from qwen35_tvm.schedules.matmul_wgmma import BLOCK_K, BLOCK_M, default_wgmma_config


def splits_at(m: int, n: int, k: int) -> int:
    """The splits of the launch an m-row GEMM takes: 1 where the GEMM has no split launch,
    else the kernel's expression folded at m."""
    n_tiles, k_tiles = -(-n // default_wgmma_config(n).block_n), k // BLOCK_K
    if not split_k.can_split(n_tiles, k_tiles):
        return 1
    return int(split_k.split_count(tirx.IntImm("int32", m), BLOCK_M, n_tiles, k_tiles))


@pytest.mark.parametrize(
    "n, k, expected",
    [
        # 4B down_proj: 16 tiles of 160 columns a 128-row block; two splits do not pay
        (2560, 9216, {1: 8, 64: 8, 128: 8, 129: 4, 256: 4, 257: 1, 512: 1, 1024: 1}),
        (2560, 4096, {1: 8, 128: 8, 256: 4, 1024: 1}),  # o_proj / out_proj
        (4096, 12288, {1: 8, 128: 8, 256: 4, 384: 1, 1024: 1}),  # 9B down: 16 tiles of 256
        (1024, 3584, {1: 8, 512: 8, 1024: 4, 2048: 1}),  # 0.8B down: 4 tiles of 256
        (10240, 2560, {1: 1, 128: 1}),  # qkv: 64 tiles of 160, never split
        (12352, 2560, {1: 1}),  # in_proj: 65 tiles of 192
        (18432, 2560, {1: 1, 64: 1}),  # gate_up: 96 tiles
        (2560, 512, {1: 1, 64: 1}),  # 8 k tiles: 2 splits of MIN_K_TILES at most
        (2560, 1024, {1: 4, 512: 1}),
    ],
)
def test_splits_fill_the_sms_only_where_tiles_leave_them_idle(n, k, expected) -> None:
    n_tiles = -(-n // default_wgmma_config(n).block_n)
    for m, want in expected.items():
        got = splits_at(m, n, k)
        assert got == want, (n, k, m, got)
        m_tiles = -(-m // BLOCK_M)
        assert got == 1 or got * m_tiles * n_tiles <= split_k.SMS  # one wave
        assert got == 1 or split_k.MIN_SPLITS <= got <= (k // BLOCK_K) // split_k.MIN_K_TILES


@pytest.mark.parametrize("k_tiles", [4, 7, 64, 144, 192])
def test_k_ranges_cover_k_in_order_and_evenly(k_tiles) -> None:
    for splits in range(1, min(split_k.MAX_SPLITS, k_tiles) + 1):
        runs = [split_k.k_range(z, splits, k_tiles) for z in range(splits)]
        tiles = [first + i for first, count in runs for i in range(count)]
        assert tiles == list(range(k_tiles))
        counts = [count for _, count in runs]
        assert max(counts) - min(counts) <= 1


def test_workspace_only_when_split() -> None:
    assert split_k.workspace_elems(1, 64, 2560) == 1
    assert int(split_k.workspace_elems(tirx.IntImm("int32", 8), 64, 2560)) == 8 * 64 * 2560
