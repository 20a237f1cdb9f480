"""The kernel calls of a Relax function, for tests of how layers wire their kernels."""

from __future__ import annotations

from tvm import relax


def tir_calls(func: relax.Function) -> tuple[list[tuple[str, list[str], list[int]]], dict]:
    """Its call_tir / call_tir_inplace calls in order, (kernel, argument names, in-place indices),
    and each output's name -> (its call's kernel, output index)."""
    calls, outputs = [], {}
    for block in func.body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Call) and v.op.name.startswith("relax.call_tir"):
                inplace = list(v.attrs.inplace_indices) if "inplace" in v.op.name else []
                calls.append((v.args[0].name_hint, [str(a) for a in v.args[1].fields], inplace))
            elif isinstance(v, relax.TupleGetItem) and calls:
                outputs[str(b.var)] = (calls[-1][0], v.index)
    return calls, outputs
