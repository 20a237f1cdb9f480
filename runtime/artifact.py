"""Loading an artifact folder with TVM's runtime only (the compiler is never imported)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Keeps the compiler library out of serving processes; it must precede the first `import tvm`
# (a process that already compiled, like the test suite, keeps the TVM it has).
if "tvm" not in sys.modules:
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")

import tvm  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from tvm.runtime import vm as tvm_vm  # noqa: E402

SCHEMA_VERSION = 3  # 3: our own paged KV cache (pools + page table); decode writes into buffers


class ArtifactError(RuntimeError):
    """An artifact folder that cannot be loaded; the message says what is missing."""


@dataclass(frozen=True)
class VocabWidths:
    rows: int
    decodable: int
    selection: int


def device_of(name: str) -> tvm.runtime.Device:
    if name == "cpu":
        return tvm.cpu()
    if name == "cuda":
        _load_cuda_runtime()
        return tvm.cuda()
    raise ArtifactError(f"unknown device {name!r} (expected 'cpu' or 'cuda')")


def _load_cuda_runtime() -> None:
    """A runtime-only TVM does not load its CUDA runtime library by itself."""
    import ctypes
    import site

    if getattr(_load_cuda_runtime, "done", False):
        return
    lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    try:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_LOCAL)
    except OSError as first:
        # libcudart.so.13 may live only in the nvidia-cuda-runtime wheel (as with torch).
        roots = [Path(p) for p in [*site.getsitepackages(), *sys.path] if p]
        found = [c for r in roots for c in sorted(r.glob("nvidia/**/libcudart.so.1*"))]
        if not found:
            raise ArtifactError(f"cannot load TVM's CUDA runtime: {first}") from None
        ctypes.CDLL(str(found[0]), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_LOCAL)
    _load_cuda_runtime.done = True


class Artifact:
    """artifact.json, the compiled library's VM, and the parameters on the device."""

    def __init__(self, path: str | Path, device: str | None = None):
        self.path = Path(path)
        meta_file = self.path / "artifact.json"
        if not meta_file.is_file():
            raise ArtifactError(f"{self.path}: no artifact.json (run `qwen35-tvm compile` first)")
        self.meta: dict[str, Any] = json.loads(meta_file.read_text())
        if self.meta.get("schema_version") != SCHEMA_VERSION:
            raise ArtifactError(
                f"{self.path}: artifact schema {self.meta.get('schema_version')}, "
                f"this runtime reads {SCHEMA_VERSION}"
            )
        self.config: dict[str, Any] = json.loads((self.path / "config.json").read_text())
        self.widths = VocabWidths(**self.meta["vocab"])
        self.dtype: str = self.meta["dtype"]
        default_device = "cuda" if self.meta["target"] == "cuda" else "cpu"
        self.device_name = device or default_device
        self.device = device_of(self.device_name)
        self.library = tvm.runtime.load_module(str(self.path / "model.so"))
        self.vm = self.new_vm()
        self.params = self._load_params()

    def new_vm(self) -> tvm_vm.VirtualMachine:
        return tvm_vm.VirtualMachine(self.library, self.device)

    @property
    def max_decode_batch(self) -> int:
        return int(self.meta["max_decode_batch"])  # every schema since 2 records it

    @property
    def page_size(self) -> int:
        """Tokens a KV page holds, fixed by the compiled attention kernels."""
        return int(self.meta["page_size"])

    @property
    def prefill_tile_rows(self) -> int:
        """Rows of prefill's GEMM tiles (1: untiled, or an artifact from before it was
        recorded)."""
        return int(self.meta.get("prefill_tile_rows", 1))

    @property
    def context_window(self) -> int:
        return int(self.meta["context_window"])

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.meta["eos_token_ids"])

    def _load_params(self) -> list[tvm.runtime.Tensor]:
        weights = self.meta.get("weights")
        if not weights:
            raise ArtifactError(
                f"{self.path}: the artifact has no weights; run `qwen35-tvm convert MODEL "
                f"{self.path}`"
            )
        by_name: dict[str, tvm.runtime.Tensor] = {}
        for fname in weights:
            for name, array in load_file(str(self.path / fname)).items():
                by_name[name] = tvm.runtime.tensor(array, self.device)
        missing = [p["name"] for p in self.meta["params"] if p["name"] not in by_name]
        if missing:
            raise ArtifactError(f"{self.path}: weights lack parameter '{missing[0]}'")
        return [by_name[p["name"]] for p in self.meta["params"]]
