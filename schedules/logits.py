"""The logits projection: hidden × W[:selection]ᵀ with columns [decodable, selection) forced
to -inf in the same kernel.

Projecting onto `selection` (a multiple of 128) instead of the odd `decodable` width keeps
the weight rows aligned for vectorised loads; the pad rows are real trained embeddings, so
their columns are masked here, where nothing downstream can forget to.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.tirx import PrimFunc


def logits_projection(
    hidden: int, rows: int, decodable: int, selection: int, dtype: str, mask_pad: bool = True
) -> PrimFunc:
    """CPU kernel. `mask_pad=False` exists only so the test suite can prove its mask test
    fails on an unmasked build; the compiler never sets it otherwise."""
    if not 0 < decodable <= selection <= rows:
        raise ValueError(f"need 0 < decodable {decodable} <= selection {selection} <= rows {rows}")
    live = decodable if mask_pad else selection
    neg_inf = T.float32("-inf")

    @T.prim_func(s_tir=True)
    def logits(x_h: T.handle, w_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch = T.int32()
        x = T.match_buffer(x_h, (batch, hidden), dtype)
        w = T.match_buffer(w_h, (rows, hidden), dtype)
        out = T.match_buffer(out_h, (batch, selection), "float32")
        for j in T.parallel(selection):
            for b in T.serial(batch):
                with T.sblock("logits"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((1,), "float32")
                    if j < live:
                        acc[0] = T.float32(0)
                        for d in T.serial(hidden):
                            acc[0] = acc[0] + T.Cast("float32", x[b, d]) * T.Cast(
                                "float32", w[j, d]
                            )
                        out[b, j] = acc[0]
                    else:
                        out[b, j] = neg_inf

    return logits
