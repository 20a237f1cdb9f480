"""What a k-split decode GEMM (schedules/gemv_wide_mma.py, WideMmaConfig.splits) reduces its
partials through: device globals that every CUDA translation unit calling them defines
(compile/cuda_toolchain.py prepends PRELUDE), so no kernel signature changes and no state
threads through the model.

A split of the first batch block (blockIdx.y 0; later ones run their tiles whole in split 0)
writes its fp32 accumulators into its slot of the workspace, then takes a ticket of its tile
(an acquire-release add after a block barrier, as GDN's decode kernel does); the block that
draws the last ticket sums every split's slot in split order, so the result does not depend on
which split finished last, stores the tile and sets the ticket back to zero. Tickets start at
zero when the module loads. Kernels of one stream never use them at once (each waits for its
producer's end, or starts after it: schedules/pdl.py), so they share the globals; two streams
running such kernels of one loaded library at once would not be safe, and the engine runs one.
No TVM import here, as in sm90a.py: the toolchain loads before TVM does.
"""

from .wgmma_config import THREADS  # no TVM there either

TICKETS = 1024  # row tiles a split kernel may have
SLOT_FLOATS = THREADS * 64 // 2  # a block's partial: each thread's accumulators, 64 columns
SLOTS = 264  # (tile, split) blocks: two an SM of 132
# the prelude's functions, for kernels' T.call_extern
TAKE, RESET = "qwen35_ticket_take", "qwen35_ticket_reset"
STORE, LOAD = "qwen35_ws_store", "qwen35_ws_load"


def needed_by(code: str) -> bool:
    """Whether a CUDA translation unit calls the prelude's functions: only such a unit gets
    it, since its globals (8.6 MB) are allocated wherever a module defines them."""
    return any(f"{name}(" in code for name in (TAKE, RESET, STORE, LOAD))
PRELUDE = f"""
static __device__ int qwen35_tickets[{TICKETS}];
static __device__ float qwen35_split_ws[{SLOTS * SLOT_FLOATS}];
__device__ __forceinline__ int {TAKE}(int i) {{
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;"
               : "=r"(old) : "l"(qwen35_tickets + i) : "memory");
  return old;
}}
__device__ __forceinline__ void {RESET}(int i) {{ qwen35_tickets[i] = 0; }}
__device__ __forceinline__ void {STORE}(int i, float v) {{ qwen35_split_ws[i] = v; }}
__device__ __forceinline__ float {LOAD}(int i) {{
  float v;  // other blocks wrote it: from L2, not a stale L1 line
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];"
               : "=f"(v) : "l"(qwen35_split_ws + i) : "memory");
  return v;
}}
"""

