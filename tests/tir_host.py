"""What a kernel's host side does, read from the TIR TVM lowers it to (no GPU needed)."""

from __future__ import annotations

import tvm
from tvm.target import Target


def host_code(func: tvm.tirx.PrimFunc, target: Target) -> str:
    """The printed TIR of a PrimFunc's host side: its kernel launches and their conditions."""
    mod = tvm.IRModule({"main": func.with_attr("target", target)})
    with target:
        return tvm.tirx.get_default_tir_pipeline(target)[0](mod)["main"].script()
