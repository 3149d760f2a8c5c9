// The one copy algorithm behind the `kernel` io backend, shared by CUDA and HIP.
//
// A transfer is a flat space of vectors: (tensor K|V or MLA's one latent
// tensor, layer, token, head group, vector within the chunk).  Every thread
// of a persistent grid walks that space with a stride of the whole grid and
// computes both addresses from the token indices and the layout strides
// (layout.py), so the host does no per-chunk work.  UNROLL independent loads are issued before their stores because a
// PCIe round trip is ~1-2 us: a 16-block grid needs ~100 KB in flight to fill
// the link, far more than one 16-byte load per thread gives.
//
// The vendor file that includes this header defines beforehand:
//   pkv_vec16                    a 16-byte vector type
//   pkv_load_stream(const T*)    a load that does not keep the line in cache
//   pkv_store_stream(T*, T)      a store that does not keep the line in cache
// Both structs below are mirrored field for field by backends/kernel_args.py.
// Every offset is 64-bit (long long): a host pool passes 2^31 bytes, and a
// product such as layer * host_layer passes it long before the pool ends.

#define PKV_BLOCK 512
#ifndef PKV_UNROLL
#define PKV_UNROLL 4
#endif

struct PkvTensorJob {                 // one of K or V, or the latent (job[1] then starts at total_vecs)
  unsigned long long host_base;       // the host pool buffer (page-locked, mapped)
  unsigned long long device_layers;   // device array: base address of each layer's buffer
  long long host_page, host_token, host_layer, host_group;  // host byte strides
  long long device_token, device_group;                     // device byte strides
  long long host_tokens, device_tokens;                     // bounds for every index
  long long chunk_bytes, groups;      // contiguous bytes per (token, layer, group); groups per token
  long long vec_begin;                // first vector of this job in the flat space
  // Divisors as multiply-high and shift (pkv_div): vectors per chunk, at the launch's width; groups.
  unsigned long long chunk_vecs_magic, groups_magic;
  long long chunk_vecs_shift, groups_shift;
};

struct PkvCopyArgs {
  PkvTensorJob job[2];
  unsigned long long host_indices, device_indices;  // device-visible int64 arrays
  unsigned long long error_flag;                     // mapped host int: set on a bad index
  long long tokens, page_size, layer_begin, layers;
  long long total_vecs, to_device;
  // 1: device-side writes are streamed too.  The staged path's kernel sets it: its
  // cached writes slowed the copy engine's next writes into staging by a fifth at
  // 16-token pages on the H200 (docs/PERFORMANCE.md), and a layer's KV outgrows L2.
  long long stream_device;
  // Divisors as multiply-high and shift (pkv_div): tokens, page_size.
  unsigned long long tokens_magic, page_magic;
  long long tokens_shift, page_shift;
};

// n / d for 0 <= n < 2^63 as one multiply-high, an add and a shift (Granlund and
// Montgomery's round-up method; kernel_args.py's `divisor` computes magic and shift for d).
// A vector's address took four 64-bit divisions, ~100 instructions each: in HBM, where
// the staged path runs this kernel, that arithmetic bound it per SM (60-71 GB/s at 8
// blocks on the H200, linear in blocks), not the memory.
__device__ __forceinline__ long long pkv_div(long long n, unsigned long long magic, long long shift) {
  return (long long)((__umul64hi((unsigned long long)n, magic) + (unsigned long long)n) >> shift);
}

// Where vector `v` sits, before any memory is read: the token's position in
// the index arrays, its layer, and its byte offsets from the token's row on
// each side.
struct PkvSpot {
  const PkvTensorJob* job;
  long long i, layer, host_offset, device_offset;
};

template <typename Vec>
__device__ __forceinline__ PkvSpot pkv_spot(const PkvCopyArgs& a, long long v) {
  PkvSpot s;
  s.job = &a.job[v >= a.job[1].vec_begin ? 1 : 0];
  const PkvTensorJob& t = *s.job;
  const long long vecs_per_chunk = t.chunk_bytes / (long long)sizeof(Vec);
  const long long local = v - t.vec_begin;
  const long long item = pkv_div(local, t.chunk_vecs_magic, t.chunk_vecs_shift);
  const long long byte = (local - item * vecs_per_chunk) * (long long)sizeof(Vec);
  const long long token_item = pkv_div(item, t.groups_magic, t.groups_shift);
  const long long group = item - token_item * t.groups;
  const long long layer = pkv_div(token_item, a.tokens_magic, a.tokens_shift);
  s.i = token_item - layer * a.tokens;
  s.layer = a.layer_begin + layer;
  s.host_offset = s.layer * t.host_layer + group * t.host_group + byte;
  s.device_offset = group * t.device_group + byte;
  return s;
}

// Both addresses of a spot once its token indices and layer base are read;
// false for an index outside its pool, which is then not copied.
__device__ __forceinline__ bool pkv_address(const PkvCopyArgs& a, const PkvSpot& s, long long ht, long long dt,
                                            unsigned long long layer_base, const char** src, char** dst) {
  const PkvTensorJob& t = *s.job;
  if (ht < 0 || ht >= t.host_tokens || dt < 0 || dt >= t.device_tokens) return false;
  const long long page = pkv_div(ht, a.page_magic, a.page_shift);
  char* host = (char*)t.host_base + page * t.host_page + (ht - page * a.page_size) * t.host_token + s.host_offset;
  char* dev = (char*)layer_base + dt * t.device_token + s.device_offset;
  *src = a.to_device ? host : dev;
  *dst = a.to_device ? dev : host;
  return true;
}

__device__ __forceinline__ long long pkv_host_index(const PkvCopyArgs& a, const PkvSpot& s) { return ((const long long*)a.host_indices)[s.i]; }
__device__ __forceinline__ long long pkv_device_index(const PkvCopyArgs& a, const PkvSpot& s) { return ((const long long*)a.device_indices)[s.i]; }
__device__ __forceinline__ unsigned long long pkv_layer_base(const PkvSpot& s) {
  return ((const unsigned long long*)s.job->device_layers)[s.layer];
}
__device__ __forceinline__ void pkv_flag_bad_index(const PkvCopyArgs& a) { *(volatile int*)a.error_flag = 1; }

// The addresses of the UNROLL vectors of one iteration, in three phases so that
// nothing orders memory accesses that need not be ordered: all offsets
// (arithmetic), then all index and layer-base loads (device memory, one round
// trip for the UNROLL vectors together), then the bounds checks.  Written
// vector by vector, the compiler kept each vector's address loads behind the
// previous vector's bounds branch: UNROLL dependent round trips per iteration.
// Returns whether an index was outside its pool; dst is null where nothing moves.
template <typename Vec>
__device__ __forceinline__ bool pkv_prepare(const PkvCopyArgs& a, long long base, long long threads, const char** src, char** dst) {
  PkvSpot spot[PKV_UNROLL];
  bool live[PKV_UNROLL];
#pragma unroll
  for (int u = 0; u < PKV_UNROLL; ++u) {
    const long long v = base + u * threads;
    live[u] = v < a.total_vecs;
    spot[u] = pkv_spot<Vec>(a, live[u] ? v : 0);  // a dead vector reads vector 0's (valid) entries
  }
  long long ht[PKV_UNROLL], dt[PKV_UNROLL];
  unsigned long long layer_base[PKV_UNROLL];
#pragma unroll
  for (int u = 0; u < PKV_UNROLL; ++u) {
    ht[u] = pkv_host_index(a, spot[u]);
    dt[u] = pkv_device_index(a, spot[u]);
    layer_base[u] = pkv_layer_base(spot[u]);
  }
  bool bad = false;
#pragma unroll
  for (int u = 0; u < PKV_UNROLL; ++u) {
    dst[u] = nullptr;
    if (live[u] && !pkv_address(a, spot[u], ht[u], dt[u], layer_base[u], &src[u], &dst[u])) bad = true;
  }
  return bad;
}

// Software-pipelined: while one iteration's loads cross PCIe (~1-2 us), the
// next iteration's addresses are computed and its indices read (a device
// round trip).  Computed after the loads, as a plain loop does, that work left
// the link idle between iterations: 16 blocks then fell short of the ceiling
// at 64-token pages (measured when the divisions were still 64-bit ones).
template <typename Vec>
__device__ __forceinline__ void pkv_copy(const PkvCopyArgs& a) {
  const long long threads = (long long)gridDim.x * blockDim.x;
  const long long step = threads * PKV_UNROLL;
  long long base = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const char* src[PKV_UNROLL];
  char* dst[PKV_UNROLL];
  bool bad = pkv_prepare<Vec>(a, base, threads, src, dst);
  for (; base < a.total_vecs; base += step) {
    Vec value[PKV_UNROLL];
#pragma unroll
    for (int u = 0; u < PKV_UNROLL; ++u)
      if (dst[u] != nullptr) value[u] = pkv_load_stream((const Vec*)src[u]);
    const char* next_src[PKV_UNROLL];
    char* next_dst[PKV_UNROLL];
    bad |= pkv_prepare<Vec>(a, base + step, threads, next_src, next_dst);
#pragma unroll
    for (int u = 0; u < PKV_UNROLL; ++u) {
      if (dst[u] != nullptr) {
        // Device-side writes stay cacheable (attention reads them next) unless
        // stream_device; host-side writes are streamed out.
        if (a.to_device && !a.stream_device) *(Vec*)dst[u] = value[u];
        else pkv_store_stream((Vec*)dst[u], value[u]);
      }
      src[u] = next_src[u];
      dst[u] = next_dst[u];
    }
  }
  if (bad) pkv_flag_bad_index(a);
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
