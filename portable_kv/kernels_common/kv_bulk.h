// The `bulk` io path's kernel, shared by CUDA and HIP: a few blocks walk a plan made
// on the host (io/bulk_plan.py).  A plan is pieces (a contiguous copy of at most one
// stage limit, both addresses before the layer's terms) grouped into stages; a unit of
// work is one stage of one layer, and block b takes units b, b + grid, ...  The vendor
// file decides how a unit's bytes move: on sm_90, bulk asynchronous copies through a
// shared-memory buffer per stage (kernels_cuda/kv_bulk.cu); elsewhere the vector walker
// below, 16-byte non-temporal loads and stores with PKV_BULK_UNROLL of them in flight
// per thread.
//
// The vendor file defines beforehand:
//   pkv_vec16, pkv_load_stream(const T*), pkv_store_stream(T*, T)   as for kv_copy.h
// The structs are mirrored field for field by io/bulk.py.

#ifndef PKV_BULK_UNROLL
#define PKV_BULK_UNROLL 4
#endif

struct PkvBulkPiece {            // one contiguous copy, in a stage's order
  long long host, device;        // byte offsets from the host buffer's layer and the device layer's base
  long long bytes, smem, job;    // size (a multiple of 16), place in the stage's buffer, K|V|latent
};

struct PkvBulkJob {
  unsigned long long host_base, device_layers;  // the host buffer; device array of each layer's base
  long long host_layer;                         // host byte stride between layers
};

struct PkvBulkArgs {
  PkvBulkJob job[2];
  unsigned long long pieces, stage_first, stage_bytes;  // device arrays: PkvBulkPiece[], long long[stages + 1], long long[stages]
  long long stages, layer_begin, layers, to_device;
  long long buffer_bytes, buffers;                       // one stage buffer's bytes; buffers per block (shared memory)
};

// Where piece `p` of layer `layer` is read and written.  The job's fields are selected, not
// indexed: a.job[p.job] would copy the whole parameter struct to local memory.
__device__ __forceinline__ void pkv_bulk_addresses(const PkvBulkArgs& a, const PkvBulkPiece& p, long long layer,
                                                   const char** src, char** dst) {
  const bool second = p.job != 0;
  const unsigned long long host_base = second ? a.job[1].host_base : a.job[0].host_base;
  const unsigned long long device_layers = second ? a.job[1].device_layers : a.job[0].device_layers;
  const long long host_layer = second ? a.job[1].host_layer : a.job[0].host_layer;
  char* host = (char*)host_base + p.host + layer * host_layer;
  char* dev = (char*)((const unsigned long long*)device_layers)[layer] + p.device;
  *src = a.to_device ? host : dev;
  *dst = a.to_device ? dev : host;
}

__device__ __forceinline__ long long pkv_bulk_units(const PkvBulkArgs& a) { return a.layers * a.stages; }
__device__ __forceinline__ long long pkv_bulk_layer(const PkvBulkArgs& a, long long unit) { return a.layer_begin + unit / a.stages; }
__device__ __forceinline__ long long pkv_bulk_stage(const PkvBulkArgs& a, long long unit) { return unit % a.stages; }

// The vector walker: the block's threads stride over each piece's 16-byte vectors.  A
// unit's pieces are walked one after another; the loads of PKV_BULK_UNROLL vectors are
// issued before their stores, since a PCIe round trip is 1-2 us.
__device__ __forceinline__ void pkv_bulk_vectors(const PkvBulkArgs& a) {
  const PkvBulkPiece* pieces = (const PkvBulkPiece*)a.pieces;
  const long long* stage_first = (const long long*)a.stage_first;
  const bool stream_out = !a.to_device;  // device-side writes stay cacheable: attention reads them next
  for (long long unit = blockIdx.x; unit < pkv_bulk_units(a); unit += gridDim.x) {
    const long long layer = pkv_bulk_layer(a, unit), stage = pkv_bulk_stage(a, unit);
    for (long long i = stage_first[stage]; i < stage_first[stage + 1]; ++i) {
      const char* src;
      char* dst;
      pkv_bulk_addresses(a, pieces[i], layer, &src, &dst);
      const long long vecs = pieces[i].bytes / 16;
      for (long long v = threadIdx.x; v < vecs; v += (long long)blockDim.x * PKV_BULK_UNROLL) {
        pkv_vec16 value[PKV_BULK_UNROLL];
#pragma unroll
        for (int u = 0; u < PKV_BULK_UNROLL; ++u) {
          const long long w = v + (long long)u * blockDim.x;
          if (w < vecs) value[u] = pkv_load_stream((const pkv_vec16*)src + w);
        }
#pragma unroll
        for (int u = 0; u < PKV_BULK_UNROLL; ++u) {
          const long long w = v + (long long)u * blockDim.x;
          if (w < vecs) {
            if (stream_out) pkv_store_stream((pkv_vec16*)dst + w, value[u]);
            else ((pkv_vec16*)dst)[w] = value[u];
          }
        }
      }
    }
  }
}
