"""Programmatic dependent launch (sm_90): a kernel may start while the one before it in the
stream is still running, so its launch and its first weight reads overlap its producer's tail
instead of following it. A decode step is ~300 short kernels in a row, and each GEMV loses
2-4 µs to that ramp.

The contract, one statement each, at the top of every block's threads:
- `wait_for_producers()` before the kernel reads anything the kernel before it wrote and
  before it writes anything at all (an earlier kernel may still read a buffer the memory
  planner hands this one). Constant data (weights) may be read, or prefetched, before it, and
  so may what was written two or more kernels back: the kernel before released this one only
  after its own wait, which returned once its producer had finished.
- `release_dependents()` after that wait: the next kernel may then be scheduled. Released
  after the wait, not before, so at most one kernel waits on SMs behind a running one. A
  producer of several waves whose dependent is one wave of long blocks releases at its end
  instead (gdn_chunk_prep): released early, those blocks pile onto the first SMs to free up.
  So does a decode GEMV's persistent grid whose dependent is not a GEMV (gemv_bulk.bulk_nest).
  A kernel that does not wait (launched after its producer's end) may release at its start:
  what its dependent reads before waiting was written two or more kernels back
  (gemv_config.WideMmaConfig.dependent).

Two kernels of a mixed step may run beside their producer on purpose (switched:
gdn_chunked.MIXED_ROWS_BESIDE_SCAN, attention_decode_mma.MIXED_ROWS_SPLIT): the ragged forms
of decode's GDN kernel (beside the chunked scan) and of decode's tensor-core attention (beside
the prefill attention). Each reads only what was written two or more kernels back and writes
only what its producer leaves alone (a mixed step's one-token rows), so it starts without
waiting; one of its threads waits at the end, so its grid ends after its producer's and their
dependents see both.

compile/pipeline.py gives the launch attribute only to kernels that call `wait_for_producers`:
a kernel without the wait (TVM's own) starts after its producer ends, as before. On the CPU
both are nothing; sm_80 SASS drops them (compile/cuda_toolchain.py), since the instructions
are sm_90's and the driver serialises such launches there anyway.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.tirx import Expr

WAIT_CALL = 'T.ptx.griddepcontrol("wait"'  # how the wait prints: the pipeline looks for it


def wait_for_producers(gpu: bool) -> Expr:
    """For T.evaluate: block until every earlier kernel has finished and its writes are
    visible."""
    return T.ptx.griddepcontrol.wait() if gpu else T.int32(0)


def release_dependents(gpu: bool) -> Expr:
    """For T.evaluate: let the next kernel in the stream be scheduled now."""
    return T.ptx.griddepcontrol.launch_dependents() if gpu else T.int32(0)


@T.macro
def wait_at_end(first_thread):
    """The end of a kernel that ran beside its producer without waiting (above): one thread of
    the grid (`first_thread`, thread 0 of block 0) waits, so the grid ends after the producer's,
    then every thread releases its dependents. GPU only."""
    if first_thread:
        T.evaluate(T.ptx.griddepcontrol.wait())
    T.evaluate(T.ptx.griddepcontrol.launch_dependents())


def prefetch_l2(gpu: bool, address: Expr) -> Expr:
    """For T.evaluate: start moving the line at `address` (constant data) from HBM into L2."""
    return T.ptx.prefetch.global_.L2(address) if gpu else T.int32(0)
