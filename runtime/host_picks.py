"""What a step gives the host and how: its logits rows and greedy picks (`StepLogits`), host
memory the GPU reads and writes while it runs ahead of the host: greedy picks read back
(`PickBuffer`), and steps' inputs sent (`UploadStaging`, `DeviceInputs`).

A step launched by `ModelRunner.launch_decode` or `launch_prefill` returns at once. Its picks (a
token id and a logprob a row) are copied after it, on the same stream, into page-locked host
memory, and the host polls that memory. Synchronising the stream instead would also wait for
the step launched after it, which is the one the GPU should be running while the host reads
these picks.

Token ids are never negative, so -1 marks a row not yet arrived. The logprobs are copied before
the ids, on the same stream, so they are in place once every id is.
"""

from __future__ import annotations

import ctypes
import functools
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


class UploadStaging:
    """Page-locked host memory that a step's int32 inputs cross to the device from. A copy from
    ordinary (pageable) memory makes the host wait for the stream, i.e. for the step in flight,
    which is what a step launched ahead must not do; from here the copy is queued like a kernel.
    The host must not rewrite values before the GPU has copied them, so there are two turns, as
    for the picks: a launch ahead starts the next turn, and a turn's memory is written again only
    two launches later, once the engine has waited for the step launched from it. A synchronising
    read (`settled`) frees both."""

    def __init__(self, device: tvm.runtime.Device, capacity: int = 1 << 14):
        on_gpu = device.dlpack_device_type() != tvm.cpu().dlpack_device_type()
        self._host = tvm.runtime.device(CUDA_HOST, 0) if on_gpu else tvm.cpu()
        self._bufs = [self._alloc(capacity) for _ in range(2)]
        self._used = [0, 0]
        self._retired: list[list[tvm.runtime.Tensor]] = [[], []]  # grown out of, maybe still read
        self._turn = 0

    def _alloc(self, n: int) -> tuple[tvm.runtime.Tensor, np.ndarray]:
        buf = tvm.runtime.empty((n,), "int32", self._host)
        return buf, _numpy_view(buf, ctypes.c_int32, n)

    def put(self, values: np.ndarray, shape: tuple[int, ...]) -> tvm.runtime.Tensor:
        """`values` (int32, flat) in host memory that stays put until the turn after next, as a
        tensor of `shape` to copy from."""
        n, t = values.size, self._turn
        buf, view = self._bufs[t]
        at = self._used[t]
        if at + n > view.size:
            self._retired[t].append(buf)
            buf, view = self._bufs[t] = self._alloc(max(2 * view.size, at + n))
        view[at : at + n] = values
        self._used[t] = at + n
        return buf._create_view(tvm.runtime.ShapeTuple(shape), "int32", 4 * at)

    def next_turn(self) -> None:
        """A step was launched ahead: what follows goes to the other turn's memory, whose last
        step the engine has waited for."""
        self._turn ^= 1
        self._used[self._turn] = 0
        self._retired[self._turn].clear()

    def settled(self) -> None:
        """The stream was synchronised: every queued copy is done."""
        self._used = [0, 0]
        self._retired = [[], []]


class StepLogits:
    """Logits rows of one forward. They stay on the device until `rows()` is called and come
    with each row's greedy pick (token id, logprob over the decodable columns), where the
    artifact makes one (prefill in artifacts built before its pick does not)."""

    def __init__(
        self,
        rows: tvm.runtime.Tensor | np.ndarray,
        best: np.ndarray | None = None,
        best_logprob: np.ndarray | None = None,
    ):
        self._rows = rows
        self.best = best
        self.best_logprob = best_logprob

    def rows(self) -> np.ndarray:
        if not isinstance(self._rows, np.ndarray):
            self._rows = self._rows.numpy()
        return self._rows

    def row(self, i: int) -> np.ndarray:
        """Row i on the host, a copy of its own: one sampled row among greedy ones moves its
        ~1 MB, not the step's every row (16 MB at 16 rows)."""
        if isinstance(self._rows, np.ndarray):
            return self._rows[i].copy()
        width, dtype = self._rows.shape[1], self._rows.dtype
        return self._rows._create_view((width,), dtype, i * width * dtype.itemsize).numpy()

    def device_rows(self) -> tvm.runtime.Tensor:
        """The rows where the model wrote them; refused once copied (a later in-place change
        would not reach the copy)."""
        if isinstance(self._rows, np.ndarray):
            raise RuntimeError("these logits were already copied to the host")
        return self._rows

    @property
    def on_device(self) -> bool:
        return not isinstance(self._rows, np.ndarray)


@functools.lru_cache(maxsize=1024)
def shape_of(n: int) -> tvm.runtime.ShapeTuple:
    """A one-dimensional shape, made once a length (building one costs ~11 µs)."""
    return tvm.runtime.ShapeTuple([n])


def copy_rows(src: tvm.runtime.Tensor, rows: list[int], dst: tvm.runtime.Tensor) -> None:
    """dst[j] = src[rows[j]] for int32 vectors on the device: a copy a run of consecutive rows
    (usually one run, or two around a row that left)."""
    j = 0
    while j < len(rows):
        n = 1
        while j + n < len(rows) and rows[j + n] == rows[j] + n:
            n += 1
        piece = src._create_view(shape_of(n), "int32", 4 * rows[j])
        dst._create_view(shape_of(n), "int32", 4 * j).copyfrom(piece)
        j += n


class DeviceInputs:
    """A step's int32 inputs on the device, each in a buffer of its own kept from call to call
    under its name, crossing from `UploadStaging`'s page-locked memory."""

    def __init__(self, device: tvm.runtime.Device, staging: UploadStaging):
        self._device, self._staging = device, staging
        self._bufs: dict[str, tvm.runtime.Tensor] = {}

    def upload(self, **arrays) -> list[tvm.runtime.Tensor]:
        """int32 arrays on the device, each in a buffer of its own kept from call to call
        (viewed at its start: the kernels take no offset). A fresh tensor each would cost a
        cudaMalloc and, freed, a cudaFree that waits for the GPU. The arrays cross to the
        device together, in one host-to-device copy (each such copy from pageable memory
        waits for the stream: prefill's five took ~0.3 ms), then move to their buffers by
        device-to-device copies, which the host does not wait for. Every copy is ordered after
        the kernels that read the buffers' last values. Views take shapes made once a length:
        building one is most of a view's ~11 µs. The one host-to-device copy is from page-locked
        memory (`UploadStaging`): from pageable memory it would wait for the step in flight."""
        hosts = {n: np.ascontiguousarray(v, dtype=np.int32).ravel() for n, v in arrays.items()}
        packed = np.concatenate(list(hosts.values()))
        n = len(packed)
        staging = self._buffer("_staging", n)._create_view(shape_of(n), "int32")
        staging.copyfrom(self._staging.put(packed, (n,)))
        views, at = [], 0
        for name, host in hosts.items():
            shape = shape_of(len(host))
            view = self._buffer(name, len(host))._create_view(shape, "int32")
            if len(host):
                view.copyfrom(staging._create_view(shape, "int32", 4 * at))
            views.append(view)
            at += len(host)
        return views

    def _buffer(self, name: str, length: int) -> tvm.runtime.Tensor:
        """The int32 buffer kept under `name`, grown (doubling) to hold `length` values."""
        buf = self._bufs.get(name)
        if buf is None or buf.shape[0] < length:
            grown = max(length, 2 * (0 if buf is None else buf.shape[0]), 64)
            buf = self._bufs[name] = tvm.runtime.empty((grown,), "int32", self._device)
        return buf
