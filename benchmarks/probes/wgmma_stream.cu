// Probe: decode_wide's GEMV as a swapped tensor-core GEMM on sm_90a. out[b, n] = X[b, :] . W[n, :]
// computed as (W . X^T)^T: the weight is wgmma's A (m64 a warpgroup, straight from shared
// memory), the batch its N (BN columns), so nothing of the weight passes through registers.
// One producer warp streams (weight tile, X tile) pairs by TMA (128-byte swizzle) through a
// STAGES-deep ring of mbarriers; the grid is persistent over (row tile, k split) work items.
// With KSPLIT > 1 the partial sums are added by fp32 atomics (fp32 out, zeroed first), or, with
// CLUSTER, by the cluster of the KSPLIT blocks of a row tile: each leaves its sums in its shared
// memory and rank 0 adds the others' in rank order (distributed shared memory), or, with
// TICKET, through a workspace: each split stores its fp32 sums, takes a ticket of its row
// tile, and the last to arrive adds the KSPLIT partials in split order. Either way the bf16 out
// does not depend on timing.
// Not part of any library: benchmarks/wgmma_stream_probe.py builds and times it.
#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "mbarrier.cuh"

__device__ __forceinline__ void tma_2d(void* dst, const CUtensorMap* map, int c0, int c1,
                                       uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(smem_addr(dst)), "l"(map), "r"(c0), "r"(c1),
      "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
  return (uint64_t(1) << 62) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 16) |
         uint64_t((addr >> 4) & 0x3FFF);
}

template <int BN> struct Wgmma;
template <> struct Wgmma<16> {
  __device__ static void mma(float* d, uint64_t a, uint64_t b) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, 0, 0;\n}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "l"(a), "l"(b));
  }
};
template <> struct Wgmma<32> {
  __device__ static void mma(float* d, uint64_t a, uint64_t b) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
          "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b));
  }
};

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\n barrier.cluster.wait.acquire;" ::: "memory");
}
// the address of `local` (this block's shared memory) in cluster block `rank`'s
__device__ __forceinline__ float cluster_load(const float* local, int rank) {
  uint32_t remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// accumulator j * 4 + e of a lane (wgmma's m64nN layout, mma.sync's m16n8 per warp): its row
// among its warpgroup's 64 and its batch column
__device__ __forceinline__ int acc_row(int warp, int lane, int e) {
  return warp * 16 + lane / 4 + e / 2 * 8;
}
__device__ __forceinline__ int acc_col(int lane, int j, int e) {
  return j * 8 + lane % 4 * 2 + e % 2;
}
// a thread's fragment v (fp32, its BN / 2 accumulators' order) of row tile `tile` stored as bf16
// into out [batch][n]
template <int BN, int ROWS>
__device__ __forceinline__ void store_fragment(void* out, const float* v, int tile, int wg,
                                               int warp, int lane, int n, int batch) {
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = tile * ROWS + wg * 64 + acc_row(warp, lane, e), col = acc_col(lane, j, e);
      if (row < n && col < batch)
        reinterpret_cast<__nv_bfloat16*>(out)[(size_t)col * n + row] =
            __float2bfloat16(v[j * 4 + e]);
    }
}
// WG consumer warpgroups (64 weight rows each) and one producer warp a block
// EPI 1: X's rows scaled by their 1/rms (an RMSNorm without weight, as decode's projections
// fold it), the squares summed from the X tiles in shared memory; EPI 2: that, then SwiGLU of
// W = [gate; up]: warpgroup 0 takes 64 gate rows, warpgroup 1 their up rows (WG 2, no k split)
// TICKET: ws [row tiles][KSPLIT][WG * 128 threads][BN / 2] fp32 (each thread's fragment) and
// tickets [row tiles] int32 (zero between launches)
template <int WG, int BN, int STAGES, int KSPLIT, bool CLUSTER = false, int EPI = 0,
          bool TICKET = false>
__device__ void wgmma_stream(const CUtensorMap* wmap, const CUtensorMap* xmap, void* out, int n,
                             int k, int batch, float* ws, int* tickets) {
  static_assert(EPI == 0 || (KSPLIT == 1 && !CLUSTER && (EPI == 1 || WG == 2)), "epilogue");
  static_assert(!TICKET || (!CLUSTER && EPI == 0 && KSPLIT > 1), "ticket");
  __shared__ int last;  // TICKET: whether this block's split of the tile arrived last
  constexpr int ROWS = 64 * WG, A_BYTES = ROWS * 128, B_BYTES = BN * 128;
  constexpr int X_PER = BN * 64 / (WG * 128);  // X elements of a stage a consumer thread squares
  constexpr int STAGE = A_BYTES + B_BYTES;
  extern __shared__ __align__(1024) uint8_t raw[];
  uint8_t* ring = raw + ((1024 - smem_addr(raw) % 1024) % 1024);
  uint64_t* bars = reinterpret_cast<uint64_t*>(ring + STAGES * STAGE);
  const int tid = threadIdx.x;
  const int nout = EPI == 2 ? n / 2 : n;  // output columns
  const int tiles = EPI == 2 ? nout / 64 : (n + ROWS - 1) / ROWS, ksteps = k / 64;
  const int per = ksteps / KSPLIT;
  const int items = tiles * KSPLIT;
  const int mine = items > (int)blockIdx.x ? (items - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const int iters = mine * per;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&bars[s], 1);
      mbar_init(&bars[STAGES + s], WG * 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n fence.proxy.async.shared::cta;");
  }
  __syncthreads();
  if (tid == WG * 128) {  // the producer
    for (int g = 0; g < iters; ++g) {
      const int s = g % STAGES, item = blockIdx.x + g / per * gridDim.x;
      const int tile = item / KSPLIT, kt = item % KSPLIT * per + g % per;
      if (g >= STAGES) mbar_wait(&bars[STAGES + s], (g / STAGES - 1) & 1);
      mbar_expect_tx(&bars[s], STAGE);
      if (EPI == 2) {  // the tile's 64 gate rows, then their 64 up rows
        tma_2d(ring + s * STAGE, wmap, kt * 64, tile * 64, &bars[s]);
        tma_2d(ring + s * STAGE + 64 * 128, wmap, kt * 64, nout + tile * 64, &bars[s]);
      } else {
        tma_2d(ring + s * STAGE, wmap, kt * 64, tile * ROWS, &bars[s]);
      }
      tma_2d(ring + s * STAGE + A_BYTES, xmap, kt * 64, 0, &bars[s]);
    }
  }
  // with CLUSTER, every thread stays for the cluster's barriers (its shared memory is read)
  if (tid >= WG * 128 && !CLUSTER) return;
  float* part = reinterpret_cast<float*>(bars + 2 * STAGES);  // [ROWS][BN], CLUSTER only
  float* rs = part + (CLUSTER ? ROWS * BN : 0);  // EPI: the X rows' sums of squares [BN]
  float* xch = rs + BN;  // EPI 2: warpgroup 1's values for warpgroup 0 [128][BN / 2]
  const int wg = tid / 128, warp = tid % 128 / 32, lane = tid % 32;
  float acc[BN / 2], ss = 0.f;
  for (int g = 0; g < (tid < WG * 128 ? iters : 0); ++g) {
    const int s = g % STAGES;
    if (g % per == 0) {
      for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
      ss = 0.f;
    }
    mbar_wait(&bars[s], (g / STAGES) & 1);
    if (EPI) {  // this thread's X_PER elements of the stage's X tile (128-byte swizzled rows)
      const int e0 = tid * X_PER, r = e0 / 64, c = e0 % 64 / 8, in = e0 % 8;
      const __nv_bfloat16* xs = reinterpret_cast<const __nv_bfloat16*>(
          ring + s * STAGE + A_BYTES + r * 128 + ((c ^ (r % 8)) * 16) + in * 2);
#pragma unroll
      for (int i = 0; i < X_PER; ++i) {
        const float v = __bfloat162float(xs[i]);
        ss += v * v;
      }
    }
    const uint32_t b0 = smem_addr(ring + s * STAGE) + A_BYTES, a0 = b0 - A_BYTES + wg * 64 * 128;
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) Wgmma<BN>::mma(acc, desc_sw128(a0 + kk * 32), desc_sw128(b0 + kk * 32));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    __syncwarp();
    if (lane == 0) mbar_arrive(&bars[STAGES + s]);
    if (EPI && g % per == per - 1) {
      const int tile = blockIdx.x + g / per * gridDim.x;
      for (int o = 64 / X_PER / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (tid % (64 / X_PER) == 0) rs[tid * X_PER / 64] = ss;
      asm volatile("bar.sync 1, %0;" ::"r"(WG * 128) : "memory");
      float scale[BN / 4];  // a thread's columns: lane % 4 * 2 + {0, 1} of each n8 tile
#pragma unroll
      for (int i = 0; i < BN / 4; ++i)
        scale[i] = rsqrtf(rs[i / 2 * 8 + lane % 4 * 2 + i % 2] / k + 1e-6f);
      if (EPI == 2 && wg == 1)
        for (int i = 0; i < BN / 2; ++i) xch[(tid - 128) * (BN / 2) + i] = acc[i] * scale[i / 4 * 2 + i % 2];
      asm volatile("bar.sync 1, %0;" ::"r"(WG * 128) : "memory");
      if (EPI == 1 || wg == 0) {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = j * 4 + e, col = acc_col(lane, j, e);
            const int r = (EPI == 2 ? 0 : wg * 64) + acc_row(warp, lane, e);
            const int row = tile * (EPI == 2 ? 64 : ROWS) + r;
            float v = acc[i] * scale[j * 2 + e % 2];
            if (EPI == 2) v = v / (1.f + __expf(-v)) * xch[tid * (BN / 2) + i];
            if (row < nout && col < batch)
              reinterpret_cast<__nv_bfloat16*>(out)[(size_t)col * nout + row] = __float2bfloat16(v);
          }
      }
    } else if (TICKET && g % per == per - 1) {
      // this split's sums, each thread's fragment as float4s at its own place in the (tile,
      // split) slot, so the stores and the last block's loads are whole lines; then one
      // acquire-release add after a barrier publishes them (no thread fences)
      const int item = blockIdx.x + g / per * gridDim.x, tile = item / KSPLIT, z = item % KSPLIT;
      constexpr int V = BN / 8;  // a thread's float4s
      float4* mine4 = reinterpret_cast<float4*>(ws) + ((size_t)tile * KSPLIT + z) * WG * 128 * V;
#pragma unroll
      for (int j = 0; j < V; ++j)
        mine4[tid * V + j] = make_float4(acc[j * 4], acc[j * 4 + 1], acc[j * 4 + 2], acc[j * 4 + 3]);
      asm volatile("bar.sync 1, %0;" ::"r"(WG * 128) : "memory");
      if (tid == 0) {
        int before;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;"
                     : "=r"(before) : "l"(&tickets[tile]) : "memory");
        last = before == KSPLIT - 1;
      }
      asm volatile("bar.sync 1, %0;" ::"r"(WG * 128) : "memory");
      if (last) {  // every split has stored: add them in split order, from L2
        const float4* all4 = reinterpret_cast<const float4*>(ws) + (size_t)tile * KSPLIT * WG * 128 * V;
        float sum[V * 4];
#pragma unroll
        for (int i = 0; i < V * 4; ++i) sum[i] = 0.f;
#pragma unroll
        for (int q = 0; q < KSPLIT; ++q)
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const float4 v = __ldcg(&all4[(size_t)q * WG * 128 * V + tid * V + j]);
            sum[j * 4] += v.x, sum[j * 4 + 1] += v.y, sum[j * 4 + 2] += v.z, sum[j * 4 + 3] += v.w;
          }
        store_fragment<BN, ROWS>(out, sum, tile, wg, warp, lane, n, batch);
        if (tid == 0) tickets[tile] = 0;
      }
    } else if (g % per == per - 1) {
      const int item = blockIdx.x + g / per * gridDim.x, tile = item / KSPLIT;
      if (KSPLIT == 1 && !CLUSTER) {
        store_fragment<BN, ROWS>(out, acc, tile, wg, warp, lane, n, batch);
      } else {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = tile * ROWS + wg * 64 + acc_row(warp, lane, e);
            const int col = acc_col(lane, j, e);
            if (CLUSTER)
              part[(row - tile * ROWS) * BN + col] = acc[j * 4 + e];
            else if (row < n && col < batch)
              atomicAdd(reinterpret_cast<float*>(out) + (size_t)col * n + row, acc[j * 4 + e]);
          }
      }
    }
  }
  if (CLUSTER) {
    cluster_sync();  // every block's sums in its shared memory
    if (blockIdx.x % KSPLIT == 0 && tid < WG * 128) {
      const int tile = blockIdx.x / KSPLIT;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = wg * 64 + acc_row(warp, lane, e), row = tile * ROWS + r;
          const int col = acc_col(lane, j, e);
          float sum = acc[j * 4 + e];
          for (int q = 1; q < KSPLIT; ++q) sum += cluster_load(&part[r * BN + col], q);
          if (row < n && col < batch)
            reinterpret_cast<__nv_bfloat16*>(out)[(size_t)col * n + row] = __float2bfloat16(sum);
        }
    }
    cluster_sync();  // rank 0 done reading before any block exits
  }
}

// one entry point: its name, then wgmma_stream's template arguments (WG first)
#define ENTRY(NAME, WG, ...)                                                                  \
  extern "C" __global__ void __launch_bounds__(WG * 128 + 32)                                \
      NAME(const __grid_constant__ CUtensorMap wmap, const __grid_constant__ CUtensorMap xmap, \
           void* out, int n, int k, int batch, float* ws, int* tickets) {                     \
    wgmma_stream<WG, __VA_ARGS__>(&wmap, &xmap, out, n, k, batch, ws, tickets);               \
  }
#define PROBE(WG, BN, STAGES, KSPLIT) \
  ENTRY(wg##WG##_n##BN##_s##STAGES##_k##KSPLIT, WG, BN, STAGES, KSPLIT)
#define CLUSTER(WG, BN, STAGES, KSPLIT) \
  ENTRY(wc##WG##_n##BN##_s##STAGES##_k##KSPLIT, WG, BN, STAGES, KSPLIT, true)
#define TICKET(WG, BN, STAGES, KSPLIT) \
  ENTRY(wt##WG##_n##BN##_s##STAGES##_k##KSPLIT, WG, BN, STAGES, KSPLIT, false, 0, true)
#define EPILOGUE(WG, BN, STAGES, EPI) \
  ENTRY(we##EPI##_##WG##_n##BN##_s##STAGES, WG, BN, STAGES, 1, false, EPI)

PROBE(1, 16, 8, 1)
PROBE(1, 16, 12, 1)
PROBE(2, 16, 6, 1)
PROBE(1, 32, 8, 1)
PROBE(1, 16, 8, 2)
PROBE(1, 16, 8, 4)
PROBE(2, 16, 6, 4)
CLUSTER(2, 16, 6, 2)
CLUSTER(2, 16, 6, 4)
CLUSTER(1, 16, 8, 4)
EPILOGUE(2, 16, 6, 1)
EPILOGUE(2, 16, 6, 2)
TICKET(2, 16, 6, 2)
TICKET(2, 16, 6, 4)
TICKET(1, 16, 8, 4)
