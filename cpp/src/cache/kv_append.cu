// The paged cache's append (sdpa.h, kv_append): one CTA per (new row, kv head, sequence) copies
// the row's head_dim values in 16-byte chunks to the cache row its position maps to; a second
// launch advances each sequence's length once every copy has read it.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/check.cuh"
#include "sdpa/sdpa.h"

namespace sdpa {
namespace {

__global__ void append_rows(const KvAppendArgs a) {
  const int64_t i = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int64_t pos = a.seqused_k[b] + i;
  if (pos < 0 || pos >= a.pages_per_seq * a.page_size) return;  // past the sequence's pages
  const int64_t page = a.block_table[b * a.pages_per_seq + pos / a.page_size];
  const int64_t row = page * a.page_size + pos % a.page_size;
  const int64_t chunks = a.head_dim / 8;  // 16 bytes of 16-bit values
  const int64_t src = ((b * a.n_new + i) * a.kv_heads + hk) * chunks;
  const int64_t dst = (row * a.kv_heads + hk) * chunks;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    static_cast<uint4*>(a.k_cache)[dst + c] = static_cast<const uint4*>(a.k_new)[src + c];
    static_cast<uint4*>(a.v_cache)[dst + c] = static_cast<const uint4*>(a.v_new)[src + c];
  }
}

__global__ void advance_lengths(int32_t* seqused_k, int64_t batch, int32_t n_new) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < batch) seqused_k[b] += n_new;
}

}  // namespace

void kv_append(const KvAppendArgs& a, void* stream) {
  if (a.head_dim % 8 != 0 || a.batch > 65535 || a.kv_heads > 65535 || a.n_new > INT32_MAX)
    throw Error("kv_append: head_dim a multiple of 8, batch and kv_heads at most 65535");
  if (a.batch == 0 || a.n_new == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  append_rows<<<dim3(unsigned(a.n_new), unsigned(a.kv_heads), unsigned(a.batch)), 32, 0, s>>>(a);
  SDPA_LAUNCH_CHECK("kv_append rows launch");
  advance_lengths<<<unsigned((a.batch + 127) / 128), 128, 0, s>>>(a.seqused_k, a.batch,
                                                                  int32_t(a.n_new));
  SDPA_LAUNCH_CHECK("kv_append lengths launch");
}

}  // namespace sdpa
