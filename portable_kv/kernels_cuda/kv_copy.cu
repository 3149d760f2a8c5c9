// CUDA side of the copy kernels: only what differs from HIP (kernels_hip/kv_copy.hip).
// The algorithm is kernels_common/kv_copy.h.

typedef uint4 pkv_vec16;

// ld.global.cs / st.global.cs: evict-first, so streamed KV pages do not push
// the model's working set out of L1/L2.
template <typename T>
__device__ __forceinline__ T pkv_load_stream(const T* p) { return __ldcs(p); }

template <typename T>
__device__ __forceinline__ void pkv_store_stream(T* p, T v) { __stcs(p, v); }

#include "kv_copy.h"
