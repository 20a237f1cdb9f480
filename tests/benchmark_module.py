"""Helpers for the tests of benchmarks/ scripts: import one as a module, and find cuda.h."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """benchmarks/NAME.py as a module (the benchmarks import their `common` module)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cuda_include() -> Path:
    """The folder holding the cuda.h of the nvcc the build uses."""
    from qwen35_tvm.compile import cuda_toolchain

    nvcc = Path(cuda_toolchain.find_nvcc()).resolve()
    for include in (nvcc.parents[1] / "include", *Path("/usr/local").glob("cuda*/include")):
        if (include / "cuda.h").exists():
            return include
    raise FileNotFoundError(f"no cuda.h beside {nvcc}")
