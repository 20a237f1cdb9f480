"""Greedy picks read back while the GPU runs ahead of the host.

A decode step launched by `ModelRunner.launch_decode` returns at once. Its picks (a token id and
a logprob a row) are copied after it, on the same stream, into page-locked host memory, and the
host polls that memory. Synchronising the stream instead would also wait for the step launched
after it, which is the one the GPU should be running while the host reads these picks.

Token ids are never negative, so -1 marks a row not yet arrived. The logprobs are copied before
the ids, on the same stream, so they are in place once every id is.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import tvm

CUDA_HOST = 3  # DLPack's page-locked host memory (cudaMallocHost)
# Polling this long means something is wrong: synchronise, which raises the device's error.
POLL_SECONDS = 0.5


def _numpy_view(tensor: tvm.runtime.Tensor, ctype: type, n: int) -> np.ndarray:
    """A numpy array over the tensor's host memory, without a copy (and without a CUDA call:
    page-locked memory is ordinary host memory to the CPU)."""
    return np.ctypeslib.as_array((ctype * n).from_address(tensor.data_ptr()))


class PendingPicks:
    """The picks of one launched decode step; `wait` returns them once the GPU wrote them."""

    def __init__(self, ids: np.ndarray, logprobs: np.ndarray, device: tvm.runtime.Device):
        self._ids, self._logprobs, self._device = ids, logprobs, device

    def ready(self) -> bool:
        return bool(self._ids.min() >= 0)

    def wait(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids [batch] int32, logprobs [batch] float32), copied out of the buffer."""
        deadline = time.perf_counter() + POLL_SECONDS
        while not self.ready():
            if time.perf_counter() > deadline:
                self._device.sync()  # raises a failed step's error; else every copy is done
                if not self.ready():
                    raise RuntimeError("a decode step's picks never reached the host")
                break
            time.sleep(0)  # lets other threads (the server's event loop) run meanwhile
        return self._ids.copy(), self._logprobs.copy()


class PickBuffer:
    """Host memory for one step's picks: page-locked beside a GPU, plain on the CPU (where the
    step has already run when its picks are fetched)."""

    def __init__(self, rows: int, device: tvm.runtime.Device):
        on_gpu = device.dlpack_device_type() != tvm.cpu().dlpack_device_type()
        host = tvm.runtime.device(CUDA_HOST, 0) if on_gpu else tvm.cpu()
        self._device = device
        self._id_buf = tvm.runtime.empty((rows,), "int32", host)
        self._logprob_buf = tvm.runtime.empty((rows,), "float32", host)
        self._ids = _numpy_view(self._id_buf, ctypes.c_int32, rows)
        self._logprobs = _numpy_view(self._logprob_buf, ctypes.c_float, rows)

    def fetch(self, best: tvm.runtime.Tensor, logprob: tvm.runtime.Tensor) -> PendingPicks:
        """Queue the copies of a step's picks (device tensors [batch]) behind it; the buffer
        must not be fetched into again before the returned picks were waited for."""
        n = best.shape[0]
        self._ids[:n] = -1
        logprob.copyto(self._logprob_buf._create_view((n,)))
        best.copyto(self._id_buf._create_view((n,)))
        return PendingPicks(self._ids[:n], self._logprobs[:n], self._device)
