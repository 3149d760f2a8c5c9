// The one copy algorithm behind the `kernel` io backend, shared by CUDA and HIP.
//
// A transfer is a flat space of vectors: (tensor K|V, layer, token, head group,
// vector within the chunk).  Every thread of a persistent grid walks that space
// with a stride of the whole grid and computes both addresses from the token
// indices and the layout strides (layout.py), so the host does no per-chunk
// work.  UNROLL independent loads are issued before their stores because a
// PCIe round trip is ~1-2 us: a 16-block grid needs ~100 KB in flight to fill
// the link, far more than one 16-byte load per thread gives.
//
// The vendor file that includes this header defines beforehand:
//   pkv_vec16                    a 16-byte vector type
//   pkv_load_stream(const T*)    a load that does not keep the line in cache
//   pkv_store_stream(T*, T)      a store that does not keep the line in cache
// Both structs below are mirrored field for field by backends/gpu.py.

#define PKV_BLOCK 512
#ifndef PKV_UNROLL
#define PKV_UNROLL 4
#endif

struct PkvTensorJob {                 // one of K or V
  unsigned long long host_base;       // the host pool buffer (page-locked, mapped)
  unsigned long long device_layers;   // device array: base address of each layer's buffer
  long long host_page, host_token, host_layer, host_group;  // host byte strides
  long long device_token, device_group;                     // device byte strides
  long long host_tokens, device_tokens;                     // bounds for every index
  long long chunk_bytes, groups;      // contiguous bytes per (token, layer, group); groups per token
  long long vec_begin;                // first vector of this job in the flat space
};

struct PkvCopyArgs {
  PkvTensorJob job[2];
  unsigned long long host_indices, device_indices;  // device-visible int64 arrays
  unsigned long long error_flag;                     // mapped host int: set on a bad index
  long long tokens, page_size, layer_begin, layers;
  long long total_vecs, to_device;
};

#ifdef PKV_INDEX32
typedef unsigned int pkv_index_t;  // variant under measurement: 32-bit division (sizes < 2^32 only)
#else
typedef long long pkv_index_t;
#endif

// Where vector `v` comes from and goes to; false (and the error flag set) for
// an index outside its pool, which is then not copied.
template <typename Vec>
__device__ __forceinline__ bool pkv_locate(const PkvCopyArgs& a, long long v, const char** src, char** dst) {
  const PkvTensorJob& t = a.job[v >= a.job[1].vec_begin ? 1 : 0];
  const pkv_index_t vecs_per_chunk = (pkv_index_t)(t.chunk_bytes / (long long)sizeof(Vec));
  const pkv_index_t local = (pkv_index_t)(v - t.vec_begin);
  pkv_index_t item = local / vecs_per_chunk;
  const long long byte = (long long)(local - item * vecs_per_chunk) * (long long)sizeof(Vec);
  const long long group = item % (pkv_index_t)t.groups;
  item /= (pkv_index_t)t.groups;
  const long long i = item % (pkv_index_t)a.tokens;
  const long long layer = a.layer_begin + item / (pkv_index_t)a.tokens;
  const long long ht = ((const long long*)a.host_indices)[i];
  const long long dt = ((const long long*)a.device_indices)[i];
  if (ht < 0 || ht >= t.host_tokens || dt < 0 || dt >= t.device_tokens) {
    *(volatile int*)a.error_flag = 1;
    return false;
  }
  const pkv_index_t page = (pkv_index_t)ht / (pkv_index_t)a.page_size;
  const long long offset = (pkv_index_t)ht - page * (pkv_index_t)a.page_size;
  char* host = (char*)t.host_base + (long long)page * t.host_page + offset * t.host_token +
               layer * t.host_layer + group * t.host_group + byte;
  char* dev = (char*)((const unsigned long long*)t.device_layers)[layer] + dt * t.device_token +
              group * t.device_group + byte;
  *src = a.to_device ? host : dev;
  *dst = a.to_device ? dev : host;
  return true;
}

template <typename Vec>
__device__ __forceinline__ void pkv_copy(const PkvCopyArgs& a) {
  const long long threads = (long long)gridDim.x * blockDim.x;
  for (long long base = (long long)blockIdx.x * blockDim.x + threadIdx.x; base < a.total_vecs;
       base += threads * PKV_UNROLL) {
    Vec value[PKV_UNROLL];
    char* dst[PKV_UNROLL];
#pragma unroll
    for (int u = 0; u < PKV_UNROLL; ++u) {
      const char* src = nullptr;
      dst[u] = nullptr;
      const long long v = base + u * threads;
      if (v < a.total_vecs && pkv_locate<Vec>(a, v, &src, &dst[u])) value[u] = pkv_load_stream((const Vec*)src);
    }
#pragma unroll
    for (int u = 0; u < PKV_UNROLL; ++u) {
      if (dst[u] == nullptr) continue;
      // Device-side writes stay cacheable: attention reads them next.  Host-side
      // writes are streamed out.
      if (a.to_device) *(Vec*)dst[u] = value[u];
      else pkv_store_stream((Vec*)dst[u], value[u]);
    }
  }
}

// One entry point per access width; the host picks the widest that every
// address and chunk size is aligned to.
#define PKV_ENTRY(bytes, type) \
  extern "C" __global__ void __launch_bounds__(PKV_BLOCK) pkv_copy_##bytes(const PkvCopyArgs args) { pkv_copy<type>(args); }

PKV_ENTRY(16, pkv_vec16)
PKV_ENTRY(8, unsigned long long)
PKV_ENTRY(4, unsigned int)
PKV_ENTRY(2, unsigned short)
PKV_ENTRY(1, unsigned char)
