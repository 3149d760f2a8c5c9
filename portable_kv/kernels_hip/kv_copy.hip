// HIP side of the copy kernels: only what differs from CUDA (kernels_cuda/kv_copy.cu).
// The algorithms are kernels_common/kv_copy.h and kv_bulk.h; nothing in them assumes a warp of 32,
// so it runs unchanged on 64-lane CDNA wavefronts.

#ifndef __HIPCC_RTC__
#include <hip/hip_runtime.h>
#endif

typedef unsigned int pkv_vec16 __attribute__((ext_vector_type(4)));

// Addresses come from integers, so the compiler cannot tell they are global and
// would emit flat_* accesses; naming the global address space gives global_*.
#define PKV_GLOBAL __attribute__((address_space(1)))

// Non-temporal accesses (nt on CDNA): the streamed pages bypass the caches.
template <typename T>
__device__ __forceinline__ T pkv_load_stream(const T* p) { return __builtin_nontemporal_load((const PKV_GLOBAL T*)p); }
template <typename T>
__device__ __forceinline__ void pkv_store_stream(T* p, T v) { __builtin_nontemporal_store(v, (PKV_GLOBAL T*)p); }

#include "kv_copy.h"
#include "kv_bulk.h"

// The bulk kernel: CDNA has no bulk asynchronous copy, so a few workgroups walk the
// plan with 16-byte non-temporal vector copies (kv_bulk.h).  What this does on an
// MI300 has not been measured (docs/DESIGN.md).
extern "C" __global__ void __launch_bounds__(256) pkv_bulk(const PkvBulkArgs args) { pkv_bulk_vectors(args); }
