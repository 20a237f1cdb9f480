"""Ahead-of-time CUDA codegen on a machine with nvcc but no GPU, and a fatbin inspector.

TVM compiles CUDA kernels to binary only when its CUDA runtime library
(`tvm/lib/libtvm_runtime_cuda.so`) is loaded, and that library links against the driver,
`libcuda.so.1`. `import tvm` tries to load it and silently gives up when the driver is missing;
codegen then embeds the CUDA *source* and the GPU host has to JIT it. `prepare_cuda_codegen`
loads the real driver, or else a stub built from `cuda_stub.c`, (re)loads TVM's CUDA runtime,
and overrides `tvm_callback_cuda_compile` so every kernel source goes through nvcc into one
fatbin holding SASS for each requested arch plus PTX for the lowest. It works before or after
`import tvm`.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from ..schedules import split_tickets
from ..schedules.sm90a import SM90A_PRELUDE

_STUB_SOURCE = Path(__file__).with_name("cuda_stub.c")
_FATBIN_MAGIC = 0xBA55ED50
_KIND_PTX, _KIND_ELF = 1, 2
_DEFAULT_NVCC = Path("/usr/local/cuda/bin/nvcc")

# Process-wide: the driver can be loaded only once, and the callback reads the current arches.
_state: dict[str, object] = {"driver": None, "arches": [], "registered": False}


def parse_arches(arches: list[str] | str) -> list[str]:
    """`["sm_80", "sm_90"]` or `"sm_80,sm_90"` -> de-duplicated, ascending `sm_XX` names."""
    items = arches.split(",") if isinstance(arches, str) else list(arches)
    names = {a.strip() for a in items if a.strip()}
    for name in names:
        if not (name.startswith("sm_") and name[3:].isdigit()):
            raise ValueError(f"CUDA arch {name!r} is not of the form sm_XX (e.g. sm_80)")
    if not names:
        raise ValueError("no CUDA arch given (e.g. ['sm_80', 'sm_90'])")
    return sorted(names, key=lambda n: int(n[3:]))


def find_nvcc() -> Path:
    """nvcc from $CUDA_HOME / $CUDA_PATH, else PATH, else /usr/local/cuda."""
    candidates = [
        Path(os.environ[v]) / "bin" / "nvcc"
        for v in ("CUDA_HOME", "CUDA_PATH")
        if os.environ.get(v)
    ]
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    candidates.append(_DEFAULT_NVCC)
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise RuntimeError(
        "nvcc (the CUDA toolkit compiler) was not found, so CUDA kernels cannot be compiled to "
        "SASS. Install the CUDA toolkit and set CUDA_HOME to it or put its bin/ on PATH. "
        f"Looked at: {', '.join(str(p) for p in candidates)}"
    )


def nvcc_command(nvcc: Path, arches: list[str], source: Path, output: Path) -> list[str]:
    """The nvcc command line: SASS for every arch, PTX for the lowest (forward compatibility)."""
    arches = parse_arches(arches)
    gencode: list[str] = []
    for name in arches:
        # sm_90's SASS is sm_90a's, so the kernels' wgmma paths (schedules/ptx.is_sm90a) run
        sm = name[3:] + ("a" if name == "sm_90" else "")
        gencode += ["-gencode", f"arch=compute_{sm},code=sm_{sm}"]
    lowest = arches[0][3:]
    gencode += ["-gencode", f"arch=compute_{lowest},code=compute_{lowest}"]
    # Same language flags as TVM's own nvcc path (tvm/support/nvcc.py), so the generated half /
    # bfloat16 operators compile and the numerics (fast math) match TVM's JIT route.
    fast_math = [] if os.environ.get("TVM_CUDA_NVCC_NO_FAST_MATH") else ["--use_fast_math"]
    return [
        str(nvcc), "--fatbin", "-O3", "--threads", "0", *gencode,
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
        "--expt-relaxed-constexpr", "--expt-extended-lambda", *fast_math,
        "-o", str(output), str(source),
    ]  # fmt: skip


# sm_90-only instructions TVM emits as bare inline asm (griddepcontrol: schedules/pdl.py)
_SM90_ASM = re.compile(r'^(\s*)(asm volatile\("griddepcontrol\.[^\n]*;)$', re.MULTILINE)


def guard_sm90_asm(code: str) -> str:
    """Compile the sm_90-only asm lines for sm_90+ only: older arches' SASS and PTX skip them
    (their launches are serialised anyway)."""
    return _SM90_ASM.sub(r"#if __CUDA_ARCH__ >= 900\n\1\2\n#endif", code)


def translation_unit(code: str) -> str:
    """TVM's CUDA source as nvcc compiles it: the sm_90a helpers, the split GEMM's tickets
    where a kernel calls them (schedules/split_tickets.py), sm_90's asm guarded."""
    split = split_tickets.PRELUDE if split_tickets.needed_by(code) else ""
    return SM90A_PRELUDE + split + guard_sm90_asm(code)


def compile_fatbin(code: str, arches: list[str]) -> bytes:
    """Compile one CUDA translation unit to a fatbin; on failure keep the source for a look."""
    nvcc = find_nvcc()
    with tempfile.TemporaryDirectory(prefix="qwen35-tvm-nvcc-") as tmp:
        source, output = Path(tmp) / "kernels.cu", Path(tmp) / "kernels.fatbin"
        source.write_text(translation_unit(code))
        proc = subprocess.run(
            nvcc_command(nvcc, arches, source, output),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if proc.returncode != 0:
            kept = Path(tempfile.mkdtemp(prefix="qwen35-tvm-nvcc-failed-")) / "kernels.cu"
            shutil.copy(source, kept)
            raise RuntimeError(f"nvcc failed (source kept at {kept}):\n{proc.stdout[-8000:]}")
        return output.read_bytes()


def _compile_callback(code: str, *_target: object) -> bytearray:
    # Some TVM versions also pass the target; the arches come from prepare_cuda_codegen.
    return bytearray(compile_fatbin(str(code), list(_state["arches"])))  # type: ignore[arg-type]


def _real_driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _load_stub_driver() -> None:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        raise RuntimeError("no C compiler (gcc/cc or $CC) to build the stub CUDA driver")
    # mkdtemp is private to this user; the folder goes when the process ends.
    folder = Path(tempfile.mkdtemp(prefix="qwen35-tvm-cuda-stub-"))
    atexit.register(shutil.rmtree, folder, True)
    library = folder / "libcuda.so.1"
    cmd = [compiler, "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1",
           "-o", str(library), str(_STUB_SOURCE)]  # fmt: skip
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building the stub CUDA driver failed:\n{proc.stdout}")
    # Its soname is libcuda.so.1, so the loader hands it to libtvm_runtime_cuda's DT_NEEDED.
    ctypes.CDLL(str(library), mode=ctypes.RTLD_LOCAL)


def _load_tvm_cuda_runtime() -> None:
    import tvm  # noqa: F401  (import tvm tries the load itself; cheap when already imported)
    import tvm_ffi
    from tvm.base import _LOADED_LIBS
    from tvm_ffi.libinfo import load_lib_ctypes

    if "tvm_runtime_cuda" not in _LOADED_LIBS:
        # `import tvm` ran before a driver was there: load it now, exactly as TVM would have.
        runtime_dir = Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent
        try:
            _LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(
                package="tvm",
                target_name="tvm_runtime_cuda",
                extra_lib_paths=[runtime_dir],
                mode="RTLD_LOCAL",
            )
        except (OSError, RuntimeError) as err:
            raise RuntimeError(f"TVM's CUDA runtime library did not load: {err}") from err
    if tvm_ffi.get_global_func("ffi.Module.create.cuda", allow_missing=True) is None:
        raise RuntimeError("TVM's CUDA runtime is loaded but registered no CUDA module creator")


def prepare_cuda_codegen(arches: list[str] | str) -> None:
    """Make `tvm.compile` for a CUDA target embed a fatbin with SASS for each of `arches`
    (e.g. `["sm_80", "sm_90"]`) plus PTX for the lowest. Idempotent; a later call replaces the
    arches. Callable before or after `import tvm`; raises if nvcc or the driver setup fails."""
    names = parse_arches(arches)
    find_nvcc()  # fail here, with the clear message, not deep inside tvm.compile
    if _state["driver"] is None:
        if _real_driver_loads():
            _state["driver"] = "real"
        else:
            _load_stub_driver()
            _state["driver"] = "stub"
    _load_tvm_cuda_runtime()
    _state["arches"] = names
    if not _state["registered"]:
        import tvm.support.nvcc  # noqa: F401  registers the stock callback first, so ours wins
        import tvm_ffi

        tvm_ffi.register_global_func("tvm_callback_cuda_compile", _compile_callback, override=True)
        _state["registered"] = True


def cuda_driver_kind() -> str | None:
    """Which driver is loaded: "real", "stub", or None before `prepare_cuda_codegen`."""
    return _state["driver"]  # type: ignore[return-value]


def _fatbin_entries(data: bytes, start: int) -> list[tuple[int, int]] | None:
    """(kind, sm) for each entry of the fatbin at `start`, or None if it is not one."""
    if start + 16 > len(data):
        return None
    _, version, header_size, fat_size = struct.unpack_from("<IHHQ", data, start)
    end = start + header_size + fat_size
    if version != 1 or header_size != 16 or end > len(data):
        return None
    entries, offset = [], start + header_size
    while offset < end:
        if offset + 32 > end:
            return None
        # Entry header: kind u16, version u16, header size u32, payload size u64, ...,
        # SM arch u32 at byte 28.
        kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, offset)
        (sm,) = struct.unpack_from("<I", data, offset + 28)
        if kind not in (_KIND_PTX, _KIND_ELF) or entry_header < 32:
            return None
        entries.append((kind, sm))
        offset += entry_header + payload
    return entries if offset == end else None


def fatbin_arches(library_path: Path | str) -> dict[str, list[str]]:
    """What the fatbins embedded in a library (or a bare .fatbin) hold, e.g.
    `{"sass": ["sm_80", "sm_90"], "ptx": ["compute_80"]}`."""
    data = Path(library_path).read_bytes()
    magic = struct.pack("<I", _FATBIN_MAGIC)
    sass, ptx = set(), set()
    start = data.find(magic)
    while start != -1:
        for kind, sm in _fatbin_entries(data, start) or []:
            (sass if kind == _KIND_ELF else ptx).add(sm)
        start = data.find(magic, start + 4)
    return {
        "sass": [f"sm_{sm}" for sm in sorted(sass)],
        "ptx": [f"compute_{sm}" for sm in sorted(ptx)],
    }


if __name__ == "__main__":  # `python -m qwen35_tvm.compile.cuda_toolchain lib.so`
    for arg in sys.argv[1:]:
        print(arg, fatbin_arches(arg))
