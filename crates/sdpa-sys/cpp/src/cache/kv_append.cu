// The paged cache's append (sdpa.h, kv_append): one CTA per (new row, kv head, sequence) copies
// the row's head_dim values in 16-byte chunks to the cache row its position maps to; a second
// launch advances each sequence's length once every copy has read it.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/check.cuh"
#include "sdpa/sdpa.h"

namespace sdpa {
namespace {

// The metadata is the caller's and unchecked (the Rust side's checked mode aside): a position
// outside the sequence's pages is dropped, a block-table entry clamped into the cache, so no
// value writes outside the cache.
__global__ void append_rows(const KvAppendArgs a) {
  const int64_t i = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int64_t pos = int64_t(device_ptr<const int32_t>(a.seqused_k)[b]) + i;
  if (pos < 0 || pos >= a.pages_per_seq * a.page_size) return;  // past the sequence's pages
  const int64_t entry =
      device_ptr<const int32_t>(a.block_table)[b * a.pages_per_seq + pos / a.page_size];
  const int64_t page = min(max(entry, int64_t(0)), a.pages - 1);
  const int64_t row = page * a.page_size + pos % a.page_size;
  const int64_t chunks = a.head_dim / 8;  // 16 bytes of 16-bit values
  const int64_t src = ((b * a.n_new + i) * a.kv_heads + hk) * chunks;
  const int64_t dst = (row * a.kv_heads + hk) * chunks;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    device_ptr<uint4>(a.k_cache)[dst + c] = device_ptr<const uint4>(a.k_new)[src + c];
    device_ptr<uint4>(a.v_cache)[dst + c] = device_ptr<const uint4>(a.v_new)[src + c];
  }
}

// Each length grows by n_new, within [0, capacity]: a length never points past the sequence's
// pages (nor overflows), whatever it was.
__global__ void advance_lengths(int32_t* seqused_k, int64_t batch, int64_t n_new,
                                int64_t capacity) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < batch)
    seqused_k[b] = int32_t(min(max(int64_t(seqused_k[b]) + n_new, int64_t(0)), capacity));
}

}  // namespace

void kv_append(const KvAppendArgs& a, void* stream) {
  if (a.head_dim % 8 != 0 || a.batch > 65535 || a.kv_heads > 65535 || a.n_new > INT32_MAX ||
      a.pages < 1 || a.pages_per_seq * a.page_size > INT32_MAX)
    throw Error(
        "kv_append: head_dim a multiple of 8, batch and kv_heads at most 65535, at least one "
        "page, a sequence's pages below 2^31 keys");
  if (a.batch == 0 || a.n_new == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  append_rows<<<dim3(unsigned(a.n_new), unsigned(a.kv_heads), unsigned(a.batch)), 32, 0, s>>>(a);
  SDPA_LAUNCH_CHECK("kv_append rows launch");
  advance_lengths<<<unsigned((a.batch + 127) / 128), 128, 0, s>>>(
      device_ptr<int32_t>(a.seqused_k), a.batch, a.n_new, a.pages_per_seq * a.page_size);
  SDPA_LAUNCH_CHECK("kv_append lengths launch");
}

}  // namespace sdpa
