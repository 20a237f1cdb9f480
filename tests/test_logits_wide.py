"""The logits kernel's wide launch (batches past 16; schedules/logits_mma.py), checked without a
GPU: its sm_90a ring moves the weight and the batch as the prefill GEMM's emulation says it
must, its kernel branches to that ring on sm_90a and to mma.sync elsewhere, and both arches'
code builds without spills. The values themselves are checked on the GPU by
benchmarks/logits_kernel.py (logits against an fp32 F.linear, pads -inf, pick = argmax)."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import tvm
from test_matmul_wgmma import _emulate

from qwen35_tvm.compile.targets import make_target
from qwen35_tvm.schedules import logits_mma
from qwen35_tvm.schedules.logits import logits_projection
from qwen35_tvm.schedules.matmul_wgmma import SM80_SHARED_BYTES, SM90_SHARED_BYTES


@pytest.mark.parametrize("selection, batch", [(300, 17), (256, 64), (129, 70), (128, 65)])
def test_emulated_wide_ring_projects_the_weight_onto_the_batch(selection, batch) -> None:
    """The weight is wgmma's A (a block's 128 rows), the batch its B (64 rows a block): rows
    past the selection and past the batch read as zeros, edge tiles and a second batch tile
    included."""
    rng = np.random.default_rng(selection + batch)
    w = rng.integers(-3, 4, (selection, 128)).astype(np.float64)
    x = rng.integers(-3, 4, (batch, 128)).astype(np.float64)
    got = _emulate(w, x, logits_mma.WIDE, base=16 * 37)
    np.testing.assert_array_equal(got, w @ x.T)


def test_wide_config_fits_two_blocks_an_sm90_and_one_an_sm80() -> None:
    cfg = logits_mma.WIDE
    cfg.check()
    assert cfg.block_n == 8 * logits_mma.WIDE_N_TILES and cfg.tma
    block = cfg.shared_bytes + logits_mma.WIDE_WARPS * cfg.block_n * 12 + 1024  # + triples
    assert 2 * block <= SM90_SHARED_BYTES and block <= SM80_SHARED_BYTES


def _wide_source() -> str:
    target, _ = make_target("cuda", "sm_80,sm_90")
    func = logits_projection(2560, 248320, 248077, 248192, "bfloat16", target)
    lib = tvm.compile(tvm.IRModule({"logits": func}), target=target)
    (cuda,) = [m for m in lib.mod.imports if m.kind == "cuda"]
    return cuda.inspect_source()


def test_wide_launch_carries_the_wgmma_ring_beside_sm80s_mma() -> None:
    """The small launch (up to 16 rows) is mma.sync alone; the wide one branches on sm_90a to
    the wgmma ring (m64n64k16 from TMA-filled stages), and else runs mma.sync."""
    src = _wide_source()
    chunks = re.split(r'extern "C" __global__ ', src)[1:]
    bodies = [k for k in chunks if k.split("\n", 1)[0].endswith("{")]  # not declarations
    small = [k for k in bodies if k.startswith("void __launch_bounds__(128) logits_kernel(")]
    wide = [k for k in bodies if k.startswith("void __launch_bounds__(256) logits_kernel_1(")]
    assert len(small) == 1 and len(wide) == 1
    assert "wgmma" not in small[0] and "qwen35_sm90a()" not in small[0]
    assert "mma_sync" in small[0] or "mma.sync" in small[0]
    sm90_at = wide[0].index("qwen35_sm90a()")
    assert "m64n64k16" in wide[0][sm90_at:] and "cp_async_bulk_tensor" in wide[0][sm90_at:]
    assert "mma.sync" in wide[0][sm90_at:]  # the sm_80 branch


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_logits_kernels_compile_for_both_arches_without_spills(tmp_path) -> None:
    from qwen35_tvm.compile.cuda_toolchain import guard_sm90_asm
    from qwen35_tvm.schedules.sm90a import SM90A_PRELUDE

    (tmp_path / "l.cu").write_text(SM90A_PRELUDE + guard_sm90_asm(_wide_source()))
    for arch in ("sm_90a", "sm_80"):
        cmd = ["nvcc", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o",
               str(tmp_path / f"{arch}.cubin"), str(tmp_path / "l.cu")]  # fmt: skip
        info = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        assert re.findall(r"(\d+) bytes spill stores", info) == ["0", "0"], (arch, info)
