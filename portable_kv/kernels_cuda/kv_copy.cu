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

#include "kv_copy.h"
