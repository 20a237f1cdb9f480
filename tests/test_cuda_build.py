"""CUDA builds on this GPU-less machine carry real SASS for every requested arch, plus PTX.

Needs nvcc (CUDA toolkit) and gcc, no GPU: if nvcc is missing these tests fail, they do not
skip, because a CUDA library without SASS would silently make the GPU host JIT.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qwen35_tvm.compile import cuda_toolchain
from qwen35_tvm.compile.cuda_toolchain import fatbin_arches, prepare_cuda_codegen

ARCHES = ["sm_80", "sm_90"]
EXPECTED = {"sass": ["sm_80", "sm_90"], "ptx": ["compute_80"]}

# A TIR elementwise add with explicit thread binding: no scheduling pass needed.
KERNEL = """
from tvm.script import tirx as T


@T.prim_func(s_tir=True)
def add(a: T.handle, b: T.handle, c: T.handle):
    T.func_attr({"global_symbol": "add", "tir.noalias": True})
    A = T.match_buffer(a, (1024,), "float32")
    B = T.match_buffer(b, (1024,), "float32")
    C = T.match_buffer(c, (1024,), "float32")
    for i in T.thread_binding(8, thread="blockIdx.x"):
        for j in T.thread_binding(128, thread="threadIdx.x"):
            with T.sblock("c"):
                vi = T.axis.spatial(1024, i * 128 + j)
                C[vi] = A[vi] + B[vi]
"""


def _build(tmp_path: Path):
    """Compile the add kernel for CUDA and export it; returns (executable, library path)."""
    import tvm

    kernel_file = tmp_path / "add_kernel.py"  # TVMScript parses from a real source file
    kernel_file.write_text(KERNEL)
    scope: dict = {}
    exec(compile(KERNEL, str(kernel_file), "exec"), scope)
    target = tvm.target.Target({"kind": "cuda", "arch": ARCHES[0]}, host="llvm")
    executable = tvm.compile(tvm.IRModule({"add": scope["add"]}), target)
    library = tmp_path / "add.so"
    executable.export_library(str(library))
    return executable, library


def test_cuda_library_has_sass_for_each_arch_and_ptx(tmp_path: Path) -> None:
    # conftest has imported tvm already: this is the "prepare after import tvm" route.
    prepare_cuda_codegen(ARCHES)
    prepare_cuda_codegen(ARCHES)  # idempotent
    assert cuda_toolchain.cuda_driver_kind() in ("real", "stub")
    executable, library = _build(tmp_path)

    cuda_modules = [m for m in executable.mod.imports if m.kind == "cuda"]
    assert len(cuda_modules) == 1
    # TVM's source-only fallback module is not runnable; the binary (fatbin) module is.
    assert cuda_modules[0].is_runnable(), "CUDA module is the source fallback, not a binary"
    assert fatbin_arches(library) == EXPECTED
    assert b"__global__" not in library.read_bytes(), "CUDA source embedded in the library"


def test_prepare_before_import_tvm(tmp_path: Path) -> None:
    # A fresh process where the driver is set up before TVM's import-time load of its runtime.
    script = tmp_path / "build.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, sys
            from pathlib import Path
            from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen, fatbin_arches
            assert "tvm" not in sys.modules
            prepare_cuda_codegen({",".join(ARCHES)!r})
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            from test_cuda_build import _build
            _, library = _build(Path({str(tmp_path)!r}))
            print(json.dumps(fatbin_arches(library)))
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == EXPECTED


def test_missing_nvcc_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(cuda_toolchain, "_DEFAULT_NVCC", tmp_path / "nvcc")
    with pytest.raises(RuntimeError, match="nvcc .* was not found"):
        prepare_cuda_codegen(ARCHES)


def test_nvcc_command_flags() -> None:
    cmd = cuda_toolchain.nvcc_command(Path("nvcc"), ["sm_90", "sm_80"], Path("k.cu"), Path("o"))
    gencode = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-gencode"]
    assert gencode == [
        "arch=compute_80,code=sm_80",
        "arch=compute_90a,code=sm_90a",  # wgmma: schedules/matmul_wgmma.py
        "arch=compute_80,code=compute_80",
    ]
    assert "--fatbin" in cmd
    with pytest.raises(ValueError):
        cuda_toolchain.parse_arches(["compute_80"])
