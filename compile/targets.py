"""Compilation targets: the CPU (llvm) and NVIDIA GPUs by SM architecture."""

from __future__ import annotations

import tvm

TARGETS = ("llvm", "cuda")


def make_target(target: str, arch: str = "sm_80") -> tuple[tvm.target.Target, list[str]]:
    """The TVM target and the list of SM architectures the library will carry."""
    if target == "llvm":
        return tvm.target.Target("llvm"), []
    if target == "cuda":
        arches = [a.strip() for a in arch.split(",") if a.strip()]
        if not arches:
            raise ValueError("--arch: give at least one SM architecture, e.g. sm_80")
        for a in arches:
            if not (a.startswith("sm_") and a[3:].isdigit() and int(a[3:]) >= 80):
                raise ValueError(f"--arch: {a!r} is not an SM architecture >= sm_80")
        # Code features follow the lowest arch, so its SASS and PTX run on every later one.
        arches = sorted(set(arches), key=lambda a: int(a[3:]))
        return tvm.target.Target({"kind": "cuda", "arch": arches[0]}, host="llvm"), arches
    raise ValueError(f"--target must be one of {TARGETS}, got {target!r}")
