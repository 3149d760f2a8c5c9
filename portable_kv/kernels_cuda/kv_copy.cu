// CUDA side of the copy kernels: only what differs from HIP (kernels_hip/kv_copy.hip).
// The algorithm is kernels_common/kv_copy.h.

typedef uint4 pkv_vec16;

// ld.global.cs / st.global.cs: evict-first, so streamed KV pages do not push
// the model's working set out of L1/L2.
template <typename T>
__device__ __forceinline__ T pkv_load_stream(const T* p) { return __ldcs(p); }

#ifdef PKV_L2_256B
// Variant under measurement: ask L2 to fetch 256-byte sectors, which may make
// zero-copy reads leave as larger PCIe read requests.
template <>
__device__ __forceinline__ uint4 pkv_load_stream<uint4>(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
#endif
template <typename T>
__device__ __forceinline__ void pkv_store_stream(T* p, T v) { __stcs(p, v); }

#ifdef PKV_BULK
// Variant under measurement (sm_90+): the 16-byte entry moves each chunk with the
// bulk-copy unit (cp.async.bulk host->shared->device or back) instead of SM
// loads, to see whether it crosses PCIe in larger requests than 128-byte lines.
// The header's per-thread entry is renamed away by the macro below.
#define pkv_copy_16 pkv_copy_16_per_thread
#endif

#ifdef PKV_COMMON_HEADER  // A/B runs (scripts/kernel_variants.py --baseline) build an earlier algorithm
#include PKV_COMMON_HEADER
#else
#include "kv_copy.h"
#endif

#ifdef PKV_BULK
#undef pkv_copy_16
#ifndef PKV_BULK_SLOT
#define PKV_BULK_SLOT 1536  // bytes per shared-memory slot (a MiMo K row: 4 heads x 192 x bf16)
#endif
#ifndef PKV_BULK_WARPS
#define PKV_BULK_WARPS 10   // warps that copy: 10 x 3 slots x 1536 B fit the 48 KB of static shared memory
#endif
#define PKV_BULK_SLOTS 3     // per warp: one load in flight while the previous one is stored

__device__ __forceinline__ unsigned pkv_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// Each warp's lane 0 runs a pipeline over bulk items (a chunk piece of <= SLOT
// bytes): load item k while item k-1 is written out from its slot.
extern "C" __global__ void __launch_bounds__(PKV_BLOCK) pkv_copy_16(const PkvCopyArgs a) {
  __shared__ __align__(128) unsigned char slots[PKV_BULK_WARPS][PKV_BULK_SLOTS][PKV_BULK_SLOT];
  __shared__ __align__(8) unsigned long long bars[PKV_BULK_WARPS][PKV_BULK_SLOTS];
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 || warp >= PKV_BULK_WARPS) return;
  for (int s = 0; s < PKV_BULK_SLOTS; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(pkv_smem(&bars[warp][s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  // Items: job 0's chunks split into pieces, then job 1's.
  long long pieces[2], items[2];
  for (int j = 0; j < 2; ++j) {
    pieces[j] = (a.job[j].chunk_bytes + PKV_BULK_SLOT - 1) / PKV_BULK_SLOT;
    items[j] = a.layers * a.tokens * a.job[j].groups * pieces[j];
  }
  const long long total = items[0] + items[1];
  const long long stride = (long long)gridDim.x * PKV_BULK_WARPS;
  unsigned phase[PKV_BULK_SLOTS] = {};
  char* dst_of[PKV_BULK_SLOTS];
  unsigned bytes_of[PKV_BULK_SLOTS];
  long long k = 0;
  for (long long item = blockIdx.x * PKV_BULK_WARPS + warp;; item += stride, ++k) {
    const int s = k % PKV_BULK_SLOTS;
    const bool have = item < total;
    dst_of[s] = nullptr;
    if (have) {
      const int j = item >= items[0];
      const PkvTensorJob& t = a.job[j];
      const long long local = item - (j ? items[0] : 0);
      const long long chunk = local / pieces[j], piece = local % pieces[j];
      const long long offset = piece * PKV_BULK_SLOT;
      const long long v = t.vec_begin + chunk * (t.chunk_bytes / 16) + offset / 16;
      const char* src;
      char* dst;
      const PkvSpot spot = pkv_spot<uint4>(a, v);
      if (!pkv_address(a, spot, pkv_host_index(a, spot), pkv_device_index(a, spot), pkv_layer_base(spot), &src, &dst)) pkv_flag_bad_index(a);
      else {
        const unsigned n = (unsigned)min((long long)PKV_BULK_SLOT, t.chunk_bytes - offset);
        // The slot's previous store must have finished reading it.
        asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
        const unsigned bar = pkv_smem(&bars[warp][s]);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(n) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(pkv_smem(slots[warp][s])), "l"(src), "r"(n), "r"(bar) : "memory");
        dst_of[s] = dst;
        bytes_of[s] = n;
      }
    }
    // Write out the previous item once its bytes have landed.
    const int p = (k + PKV_BULK_SLOTS - 1) % PKV_BULK_SLOTS;
    if (k > 0 && dst_of[p] != nullptr) {
      const unsigned bar = pkv_smem(&bars[warp][p]);
      unsigned done = 0;
      while (!done) {
        asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }"
                     : "=r"(done) : "r"(bar), "r"(phase[p]) : "memory");
      }
      phase[p] ^= 1;
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   ::"l"(dst_of[p]), "r"(pkv_smem(slots[warp][p])), "r"(bytes_of[p]) : "memory");
      dst_of[p] = nullptr;
    }
    // One group per iteration, empty when nothing was stored, so that
    // "wait_group.read 1" above always means "the store of item k-3".
    if (k > 0) asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (!have) break;
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
#endif
