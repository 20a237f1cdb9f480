// Probe: a decode GEMV (one batch row) whose weight streams through shared memory by the
// copy engine (cp.async.bulk, sm_90), a producer warp a block keeping S stages in flight
// across the block's row tiles, against the register rings of schedules/gemv.py. Not part
// of any library: benchmarks/bulk_stream_probe.py loads the cubin through the driver API.
#include <cuda_bf16.h>
#include <cstdint>

#include "mbarrier.cuh"

namespace {

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_release() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ float dot8(uint4 w, uint4 x, float acc) {
  const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&w);
  const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 a = __bfloat1622float2(wp[i]);
    float2 b = __bfloat1622float2(xp[i]);
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
  return acc;
}

// a warp's RW row sums, each spread over its 32 lanes, to out[0, RW)
template <int RW>
__device__ __forceinline__ void store_rows(const float (&acc)[RW], float* out, int lane) {
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    float a = acc[r];
#pragma unroll
    for (int o = 16; o; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
    if (lane == 0) out[r] = a;
  }
}

constexpr int PAD = 8;  // bf16 between rows of a stage: ldmatrix-friendly later, harmless here

// out[n] = sum_k W[n, k] X[k] (fp32). A block: CW consumer warps + 1 producer warp; R rows a
// tile, tiles blockIdx.x, +gridDim.x, ...; each tile's k in chunks of KC, a stage = R rows x
// KC. The producer issues a stage's R row copies (KC * 2 bytes each) on one mbarrier. With
// `pdl`, consumers wait for the kernel before (X is its output) but the producer does not:
// the weight streams in while the previous kernel ends.
template <int R, int KC, int S, int CW>
__device__ void bulk_gemv(const __nv_bfloat16* __restrict__ W, const __nv_bfloat16* __restrict__ X,
                          float* __restrict__ out, int N, int K, int pdl) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int ROW = KC + PAD;
  constexpr int STAGE = R * ROW;
  constexpr int RW = R / CW;
  constexpr int V = KC / 256;  // 16-byte vectors a lane a row a chunk
  static_assert(R % CW == 0 && KC % 256 == 0, "shape");
  __nv_bfloat16* ring = reinterpret_cast<__nv_bfloat16*>(smem);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S * STAGE * 2);
  uint64_t* empty = full + S;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tiles = N / R, chunks = K / KC;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], CW);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (pdl) pdl_release();
  if (warp == CW) {
    if (lane == 0) {
      int it = 0;
      for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        for (int c = 0; c < chunks; ++c, ++it) {
          const int s = it % S;
          if (it >= S) mbar_wait(&empty[s], ((it / S) - 1) & 1);
          mbar_expect_tx(&full[s], R * KC * 2);
          const __nv_bfloat16* src = W + (size_t)t * R * K + (size_t)c * KC;
#pragma unroll 4
          for (int r = 0; r < R; ++r)
            bulk_copy(ring + s * STAGE + r * ROW, src + (size_t)r * K, KC * 2, &full[s]);
        }
      }
    }
    return;
  }
  if (pdl) pdl_wait();
  int it = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    float acc[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) acc[r] = 0.f;
    for (int c = 0; c < chunks; ++c, ++it) {
      const int s = it % S;
      uint4 xv[V];
#pragma unroll
      for (int v = 0; v < V; ++v)
        xv[v] = __ldg(reinterpret_cast<const uint4*>(X + (size_t)c * KC + (v * 32 + lane) * 8));
      mbar_wait(&full[s], (it / S) & 1);
      const __nv_bfloat16* st = ring + s * STAGE + warp * RW * ROW;
#pragma unroll
      for (int r = 0; r < RW; ++r)
#pragma unroll
        for (int v = 0; v < V; ++v)
          acc[r] = dot8(*reinterpret_cast<const uint4*>(st + r * ROW + (v * 32 + lane) * 8),
                        xv[v], acc[r]);
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[s]);
    }
    store_rows<RW>(acc, out + t * R + warp * RW, lane);
  }
}

// The same loop with the weight loaded straight into registers (ld.global.nc, U chunks in
// flight a warp, no producer): what the copy engine is weighed against, persistent too.
template <int R, int KC, int U, int CW>
__device__ void ldg_gemv(const __nv_bfloat16* __restrict__ W, const __nv_bfloat16* __restrict__ X,
                         float* __restrict__ out, int N, int K, int pdl) {
  constexpr int RW = R / CW;
  constexpr int V = KC / 256;
  static_assert(R % CW == 0 && KC % 256 == 0, "shape");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tiles = N / R, chunks = K / KC;
  if (pdl) pdl_release();
  if (pdl) pdl_wait();
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const __nv_bfloat16* base = W + ((size_t)t * R + warp * RW) * K;
    float acc[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) acc[r] = 0.f;
    for (int c0 = 0; c0 < chunks; c0 += U) {
      uint4 wv[U][RW][V];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < RW; ++r)
#pragma unroll
          for (int v = 0; v < V; ++v)
            if (c0 + u < chunks)
              wv[u][r][v] = __ldg(reinterpret_cast<const uint4*>(
                  base + (size_t)r * K + (size_t)(c0 + u) * KC + (v * 32 + lane) * 8));
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (c0 + u < chunks)
#pragma unroll
          for (int v = 0; v < V; ++v) {
            uint4 xv = __ldg(reinterpret_cast<const uint4*>(X + (size_t)(c0 + u) * KC +
                                                            (v * 32 + lane) * 8));
#pragma unroll
            for (int r = 0; r < RW; ++r) acc[r] = dot8(wv[u][r][v], xv, acc[r]);
          }
    }
    store_rows<RW>(acc, out + t * R + warp * RW, lane);
  }
}

}  // namespace

// name: {bulk,ldg}_R{R}_K{KC}_{S or U}{n}_W{CW}; block (CW + 1) x 32 threads for bulk, CW x 32
// for ldg; bulk's dynamic shared memory S * R * (KC + 8) * 2 + 16 * S bytes
#define BULK(R, KC, S, CW)                                                                  \
  extern "C" __global__ void __launch_bounds__((CW + 1) * 32)                              \
      bulk_R##R##_K##KC##_S##S##_W##CW(const __nv_bfloat16* W, const __nv_bfloat16* X,      \
                                       float* out, int N, int K, int pdl) {                 \
    bulk_gemv<R, KC, S, CW>(W, X, out, N, K, pdl);                                          \
  }
#define LDG(R, KC, U, CW)                                                                   \
  extern "C" __global__ void __launch_bounds__(CW * 32)                                    \
      ldg_R##R##_K##KC##_U##U##_W##CW(const __nv_bfloat16* W, const __nv_bfloat16* X,       \
                                      float* out, int N, int K, int pdl) {                  \
    ldg_gemv<R, KC, U, CW>(W, X, out, N, K, pdl);                                           \
  }

BULK(16, 256, 8, 8)
BULK(16, 512, 6, 8)
BULK(16, 512, 8, 8)
BULK(8, 512, 8, 4)
BULK(8, 512, 8, 8)
BULK(8, 512, 12, 4)
BULK(8, 1024, 6, 4)
BULK(4, 1024, 8, 4)
BULK(4, 512, 12, 4)
LDG(16, 256, 4, 8)
LDG(8, 256, 4, 8)
