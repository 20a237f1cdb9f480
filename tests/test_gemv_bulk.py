"""sm_90's bulk weight ring of the decode GEMV (schedules/gemv_bulk.py), checked without a GPU:
the order of its CUDA (barrier init, its fence, the first stages' copies, then the wait), its
persistent grid, when it releases the kernel behind it, that both arches compile without
spills, and which shapes the pipeline gives it. The sm_80 code of a bulk config is emulated in
tests/test_gemv_emulated.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import tvm
from test_gemv_kernel import SHAPES, _residual

from qwen35_tvm.compile.targets import make_target
from qwen35_tvm.schedules import gemv_config
from qwen35_tvm.schedules.gemv import GemvConfig, gemv_kernel
from qwen35_tvm.schedules.gemv_rule import plan

CUDA, _ = make_target("cuda", "sm_80,sm_90")


BULK_CFG = GemvConfig(m_tiles=1, warps_k=8, unroll=2, stages=6, x_stages=2, bulk=2)


def test_bulk_kernel_streams_its_first_stages_before_the_wait() -> None:
    """The bulk ring's CUDA (4B's in_proj with its norm): sm_90a's path inits the mbarriers,
    fences the init for the copy engine, issues its first stages' row copies, then waits for
    its producer; the grid is persistent (SMS x bulk blocks); a k that is not whole chunks is
    refused."""
    func = gemv_kernel(12352, 2560, CUDA, BULK_CFG, out_dtype="bfloat16", rms_eps=1e-6)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "g")}), target=CUDA)
    (cuda,) = [m for m in lib.mod.imports if m.kind == "cuda"]
    src = cuda.inspect_source()
    body = src[src.index("qwen35_sm90a()") :]
    first_copy, wait = body.index("cp_async_bulk"), body.index("griddepcontrol_wait()")
    # the copy engine must see the barriers' init (a fence) before it completes bytes on them
    last_init, fence = body.rindex("mbarrier_init_init_shared"), body.index("fence_mbarrier_init")
    assert last_init < fence < body.index("fence_proxy_proxy_async") < first_copy < wait
    assert body[:wait].count("complete_tx__bytes(") == BULK_CFG.stages * BULK_CFG.rows
    grid = gemv_config.bulk_grid(12352 // 16, BULK_CFG)
    assert grid == gemv_config.SMS * 2 and f"/ {grid})" in src
    with pytest.raises(ValueError, match="chunk"):
        gemv_kernel(256, 520, CUDA, BULK_CFG)


def test_bulk_kernel_releases_its_dependents_early_only_behind_a_gemv() -> None:
    """A bulk GEMV whose epilogue adds the residual or applies SwiGLU (its dependent is another
    GEMV) lets the next kernel start right after its wait; in_proj's and qkv's (GDN's decode
    kernel and the attention's input kernel behind them) only after their last store."""
    cases = {
        "in_proj": (12352, 2560, dict(rms_eps=1e-6), False),
        "gate_up": (18432, 2560, dict(rms_eps=1e-6, swiglu=True), True),
        "down": (2560, 9216, dict(extra_shapes=("mn",), extra_dtypes=("bfloat16",),
                                  epilogue=_residual), True),
    }  # fmt: skip
    for name, (n, k, kw, early) in cases.items():
        cfg = gemv_config.decode_bulk_config(n, k)
        func = gemv_kernel(n, k, CUDA, cfg, out_dtype="bfloat16", **kw)
        lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "g")}), CUDA)
        (cuda,) = [m for m in lib.mod.imports if m.kind == "cuda"]
        src = cuda.inspect_source()
        body = src[src.index("qwen35_sm90a()") :]
        wait, release = body.index("griddepcontrol_wait()"), body.index("launch_dependents()")
        assert body.count("launch_dependents()") == 1, name
        if early:  # nothing between the wait and the release
            assert body[wait:release].count(";") == 1, (name, body[wait:release])
        else:
            assert release > body.rindex("out_ptr["), name


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_bulk_kernel_compiles_for_both_arches_without_spills(tmp_path) -> None:
    """ptxas -v for sm_90a (the bulk ring) and sm_80 (its register-ring fallback): no spills."""
    from qwen35_tvm.compile.cuda_toolchain import guard_sm90_asm
    from qwen35_tvm.schedules.sm90a import SM90A_PRELUDE

    func = gemv_kernel(18432, 2560, CUDA, BULK_CFG, out_dtype="bfloat16", rms_eps=1e-6,
                       swiglu=True)  # fmt: skip
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "g")}), target=CUDA)
    (cuda,) = [m for m in lib.mod.imports if m.kind == "cuda"]
    (tmp_path / "g.cu").write_text(SM90A_PRELUDE + guard_sm90_asm(cuda.inspect_source()))
    for arch in ("sm_90a", "sm_80"):
        cmd = ["nvcc", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o",
               str(tmp_path / f"{arch}.cubin"), str(tmp_path / "g.cu")]  # fmt: skip
        info = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        assert re.findall(r"(\d+) bytes spill stores", info) == ["0"], (arch, info)


def test_decode_bulk_configs_fit_and_are_switched(monkeypatch) -> None:
    """decode_bulk_config: the 4B shapes it was measured on (and no 9B one) get a bulk config
    whose k is whole chunks, whose blocks an SM fit the shared memory and the registers; the
    pipeline's plan takes them only with gemv_rule.DECODE_BULK on."""
    from qwen35_tvm.schedules import gemv_rule

    bulk = {(n, k): gemv_config.decode_bulk_config(n, k) for n, k in SHAPES}
    assert {s for s, c in bulk.items() if c} == set(SHAPES[:5])  # 4B's five
    for (n, k), cfg in bulk.items():
        if cfg is None:
            continue
        cfg.check()
        assert k % cfg.chunk == 0 and cfg.dependent, (n, k, cfg)
        assert cfg.bulk * (cfg.shared_bytes + 1024) <= gemv_config.SHARED_PER_SM, (n, k, cfg)
        est = gemv_config.est_registers(cfg)
        assert est <= gemv_config.register_cap(cfg.threads, cfg.bulk), (n, k, cfg)
    for on in (False, True):
        monkeypatch.setattr(gemv_rule, "DECODE_BULK", on)
        for n, k in SHAPES:
            want = (on and bulk[n, k]) or gemv_config.default_config(n, k)
            assert plan(n, k, "small") == want, (on, n, k)
            assert plan(n, k, "wide") == gemv_config.wide_buckets(n, k)
