"""The plain greedy pick on the CPU as a decode step makes it: the logits kernel writes a
given table of logits exactly (and its pick's triples), the pick kernel merges them."""

from __future__ import annotations

import numpy as np
import tvm

from qwen35_tvm.schedules.greedy import greedy_pick
from qwen35_tvm.schedules.logits import logits_projection
from qwen35_tvm.schedules.pick_triples import pick_chunks

CPU = tvm.target.Target("llvm")


def _empty(shape, dtype):
    return tvm.runtime.empty(shape, dtype, tvm.cpu())


def pick(ws_val: np.ndarray, ws_idx: np.ndarray, decodable: int, selection: int,
         gpu_lanes: bool = False) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The pick kernel over given triples [n, chunks, 2] (max, sum) and [n, chunks]."""
    lib = tvm.compile(tvm.IRModule({"main": greedy_pick(decodable, selection, CPU,
                                                        gpu_lanes=gpu_lanes)}))  # fmt: skip
    n = ws_val.shape[0]
    best, logprob = _empty((n,), "int32"), _empty((n,), "float32")
    dev = tvm.cpu()
    lib["greedy_pick"](tvm.runtime.tensor(ws_val, dev), tvm.runtime.tensor(ws_idx, dev), best,
                       logprob)  # fmt: skip
    return best.numpy(), logprob.numpy()


def project(table: np.ndarray, decodable: int, mask_pad: bool = True):
    """The logits kernel (CPU, fp32) made to write `table` [n, selection] exactly: one-hot
    hidden rows against a weight whose column i is table row i. Its logits and triples."""
    n, selection = table.shape
    func = logits_projection(n, selection, decodable, selection, "float32", CPU, mask_pad)
    lib = tvm.compile(tvm.IRModule({"main": func}))
    dev = tvm.cpu()
    out = _empty((n, selection), "float32")
    chunks = pick_chunks(selection)
    ws_val, ws_idx = _empty((n, chunks, 2), "float32"), _empty((n, chunks), "int32")
    x = tvm.runtime.tensor(np.eye(n, dtype=np.float32), dev)
    w = tvm.runtime.tensor(np.ascontiguousarray(table.T), dev)
    lib["logits"](x, w, out, ws_val, ws_idx)
    return out.numpy(), ws_val.numpy(), ws_idx.numpy()


def pick_of(table: np.ndarray, decodable: int, mask_pad: bool = True):
    """Each table row's pick and logprob, as a step's logits kernel and pick make them."""
    _, ws_val, ws_idx = project(table, decodable, mask_pad)
    return pick(ws_val, ws_idx, decodable, table.shape[1])
