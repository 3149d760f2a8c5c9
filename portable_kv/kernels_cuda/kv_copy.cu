// CUDA side of the copy kernels: only what differs from HIP (kernels_hip/kv_copy.hip).
// The algorithms are kernels_common/kv_copy.h (the `kernel` io path) and
// kernels_common/kv_bulk.h (the `bulk` io path's plan walk).

typedef uint4 pkv_vec16;

// ld.global.cs / st.global.cs: evict-first, so streamed KV pages do not push
// the model's working set out of L1/L2.
template <typename T>
__device__ __forceinline__ T pkv_load_stream(const T* p) { return __ldcs(p); }

template <typename T>
__device__ __forceinline__ void pkv_store_stream(T* p, T v) { __stcs(p, v); }

#include "kv_copy.h"
#include "kv_bulk.h"

// The bulk kernel, one warp a block.  On sm_90 and later a stage moves by bulk
// asynchronous copies (cp.async.bulk, the TMA unit): its pieces are fetched into
// one shared-memory buffer under one mbarrier, then stored out, one lane per piece.
// The TMA unit keeps a whole stage in flight for one thread, where SM loads need
// ~100 KB of registers over 16 blocks to fill PCIe: 4 blocks carry the link and
// the model keeps the other SMs.  Stage buffers rotate; a buffer is fetched into
// again once every lane's stores have read it (cp.async.bulk.wait_group.read).
#define PKV_BULK_MAX_BUFFERS 8

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned pkv_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void pkv_barrier_init(unsigned long long* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(pkv_smem(bar)));
}
__device__ __forceinline__ void pkv_barrier_expect(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(pkv_smem(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void pkv_barrier_wait(unsigned long long* bar, unsigned parity) {
  unsigned done = 0;
  while (!done) {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n }"
                 : "=r"(done) : "r"(pkv_smem(bar)), "r"(parity) : "memory");
  }
}
__device__ __forceinline__ void pkv_bulk_fetch(void* smem, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(pkv_smem(smem)), "l"(src), "r"(bytes), "r"(pkv_smem(bar)) : "memory");
}
__device__ __forceinline__ void pkv_bulk_store(void* dst, const void* smem, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(pkv_smem(smem)), "r"(bytes) : "memory");
}

// Every lane fetches its pieces of `unit` into `buffer`; lane 0 first arms the barrier
// with the stage's bytes (a piece's bytes may land before the arming, and count then).
__device__ __forceinline__ void pkv_bulk_fetch_unit(const PkvBulkArgs& a, long long unit, char* buffer, unsigned long long* bar) {
  const PkvBulkPiece* pieces = (const PkvBulkPiece*)a.pieces;
  const long long stage = pkv_bulk_stage(a, unit), layer = pkv_bulk_layer(a, unit);
  if (threadIdx.x == 0) pkv_barrier_expect(bar, (unsigned)((const long long*)a.stage_bytes)[stage]);
  __syncwarp();
  const long long* first = (const long long*)a.stage_first;
  for (long long i = first[stage] + threadIdx.x; i < first[stage + 1]; i += 32) {
    const char* src;
    char* dst;
    pkv_bulk_addresses(a, pieces[i], layer, &src, &dst);
    pkv_bulk_fetch(buffer + pieces[i].smem, src, (unsigned)pieces[i].bytes, bar);
  }
}

__device__ __forceinline__ void pkv_bulk_store_unit(const PkvBulkArgs& a, long long unit, const char* buffer) {
  const PkvBulkPiece* pieces = (const PkvBulkPiece*)a.pieces;
  const long long stage = pkv_bulk_stage(a, unit), layer = pkv_bulk_layer(a, unit);
  const long long* first = (const long long*)a.stage_first;
  for (long long i = first[stage] + threadIdx.x; i < first[stage + 1]; i += 32) {
    const char* src;
    char* dst;
    pkv_bulk_addresses(a, pieces[i], layer, &src, &dst);
    pkv_bulk_store(dst, buffer + pieces[i].smem, (unsigned)pieces[i].bytes);
  }
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

__device__ __forceinline__ void pkv_bulk_tma(const PkvBulkArgs& a) {
  extern __shared__ __align__(128) char stage_memory[];
  __shared__ __align__(8) unsigned long long full[PKV_BULK_MAX_BUFFERS];
  const long long buffers = a.buffers;
  if (threadIdx.x == 0) {
    for (int b = 0; b < buffers; ++b) pkv_barrier_init(&full[b]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  const long long units = pkv_bulk_units(a);
  const long long mine = units > blockIdx.x ? (units - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  for (long long k = 0; k < buffers && k < mine; ++k)
    pkv_bulk_fetch_unit(a, blockIdx.x + k * gridDim.x, stage_memory + k * a.buffer_bytes, &full[k]);
  for (long long k = 0; k < mine; ++k) {
    const long long b = k % buffers;
    char* buffer = stage_memory + b * a.buffer_bytes;
    pkv_barrier_wait(&full[b], (unsigned)((k / buffers) & 1));
    pkv_bulk_store_unit(a, blockIdx.x + k * gridDim.x, buffer);
    if (k + buffers < mine) {
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      __syncwarp();
      pkv_bulk_fetch_unit(a, blockIdx.x + (k + buffers) * gridDim.x, buffer, &full[b]);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
#endif

extern "C" __global__ void __launch_bounds__(32) pkv_bulk(const PkvBulkArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  pkv_bulk_tma(args);
#else
  pkv_bulk_vectors(args);
#endif
}
