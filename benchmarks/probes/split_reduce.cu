// Probe: the k-split GEMM's partial sums (schedules/split_k.py) reduced through a global
// workspace and a second kernel, as prefill's split GEMM does at M <= 128, or through the
// distributed shared memory of a cluster of the tile's splits. Only the reduction: each
// block's "accumulators" are made from their indices (split_reduce_probe.py's reference makes
// the same), so the two ways differ only in where the partials go. Not part of any library.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

namespace cg = cooperative_groups;

constexpr int M = 128;           // one m tile: a mixed step's rows
constexpr int TILE_N = 160;      // prefill's column tile for n = 2,560
constexpr int SPLITS = 8;        // split_count at one m tile and 16 column tiles
constexpr int THREADS = 256;
constexpr int PER_THREAD = M * TILE_N / THREADS;  // 80 accumulators, as a consumer holds

__device__ __forceinline__ float partial(int split, int row, int col) {
  // exact in fp32, so any order of the eight sums rounds the same way the reference does
  return static_cast<float>((split * 131 + row * 7 + col * 3) % 97) * 0.015625f - 0.75f;
}

__device__ __forceinline__ void wait_producer(int pdl) {
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
}

__device__ __forceinline__ void release_dependents(int pdl) {
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// blockIdx.x = tile * SPLITS + split; ws [SPLITS, M, n] fp32, as split_k's workspace
extern "C" __global__ void __launch_bounds__(THREADS) ws_store(float* ws, int n, int pdl) {
  const int tile = blockIdx.x / SPLITS, split = blockIdx.x % SPLITS;
  wait_producer(pdl);
  release_dependents(pdl);
  float acc[PER_THREAD];
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const int e = threadIdx.x + j * THREADS;
    acc[j] = partial(split, e / TILE_N, e % TILE_N);
  }
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const int e = threadIdx.x + j * THREADS;
    ws[(static_cast<size_t>(split) * M + e / TILE_N) * n + tile * TILE_N + e % TILE_N] = acc[j];
  }
}

// the reduce kernel: each thread two adjacent columns, the splits summed in order, plus the
// residual, stored as bf16 pairs (split_k.reduce_partials' shape of work)
extern "C" __global__ void __launch_bounds__(THREADS)
ws_reduce(const float* ws, const __nv_bfloat16* res, __nv_bfloat16* out, int n, int pdl) {
  const int pair = blockIdx.x * THREADS + threadIdx.x;
  wait_producer(pdl);
  release_dependents(pdl);
  if (pair >= M * n / 2) return;
  const int row = pair / (n / 2), col = pair % (n / 2) * 2;
  float a = 0.f, b = 0.f;
#pragma unroll
  for (int s = 0; s < SPLITS; ++s) {
    const float2 v = *reinterpret_cast<const float2*>(ws + (static_cast<size_t>(s) * M + row) * n + col);
    a += v.x;
    b += v.y;
  }
  const __nv_bfloat162 r = *reinterpret_cast<const __nv_bfloat162*>(res + row * n + col);
  *reinterpret_cast<__nv_bfloat162*>(out + row * n + col) =
      __floats2bfloat162_rn(a + __bfloat162float(r.x), b + __bfloat162float(r.y));
}

// one cluster = a tile's SPLITS blocks (cluster dims from the launch): each stores its
// partial in its own shared memory; after the cluster barrier, rank r sums rows
// [r M / SPLITS, (r + 1) M / SPLITS) of every rank's partial in split order, adds the residual
// and stores; a second barrier keeps every block's shared memory alive until all have read it
extern "C" __global__ void __launch_bounds__(THREADS)
dsmem_reduce(const __nv_bfloat16* res, __nv_bfloat16* out, int n, int pdl) {
  extern __shared__ float part[];  // [M, TILE_N]; the launch may ask for more (the GEMM's ring)
  cg::cluster_group cluster = cg::this_cluster();
  const int split = static_cast<int>(cluster.block_rank());
  const int tile = blockIdx.x / SPLITS;
  wait_producer(pdl);
  release_dependents(pdl);
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const int e = threadIdx.x + j * THREADS;
    part[e] = partial(split, e / TILE_N, e % TILE_N);
  }
  cluster.sync();
  constexpr int ROWS = M / SPLITS;
  for (int e = threadIdx.x; e < ROWS * TILE_N / 2; e += THREADS) {
    const int row = split * ROWS + e / (TILE_N / 2), col = e % (TILE_N / 2) * 2;
    float a = 0.f, b = 0.f;
#pragma unroll
    for (int s = 0; s < SPLITS; ++s) {
      const float2 v =
          *reinterpret_cast<const float2*>(cluster.map_shared_rank(part + row * TILE_N + col, s));
      a += v.x;
      b += v.y;
    }
    const int at = row * n + tile * TILE_N + col;
    const __nv_bfloat162 r = *reinterpret_cast<const __nv_bfloat162*>(res + at);
    *reinterpret_cast<__nv_bfloat162*>(out + at) =
        __floats2bfloat162_rn(a + __bfloat162float(r.x), b + __bfloat162float(r.y));
  }
  cluster.sync();
}
