// Writes new K/V rows into a paged cache (sdpa.h, kv_write): one CTA per (new row, kv head)
// finds the row's page and offset (its slot, or its sequence's next position through the block
// table) and copies head_dim values in 16-byte chunks, at the cache's strides (NHD or HND
// pages alike); a second launch advances each sequence's length once every copy has read it.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/check.cuh"
#include "sdpa/sdpa.h"

namespace sdpa {
namespace {

// The sequence whose rows [cu[b], cu[b + 1]) hold row i, or -1: a binary search over offsets
// that are the caller's and unchecked (any values give some b, which the caller bounds-checks).
__device__ int64_t sequence_of(const int32_t* cu, int64_t batch, int64_t i) {
  int64_t lo = 0, hi = batch;  // the answer lies in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (int64_t(cu[mid]) <= i)
      lo = mid;
    else
      hi = mid;
  }
  return int64_t(cu[lo]) <= i && i < int64_t(cu[lo + 1]) ? lo : -1;
}

// The metadata is the caller's and unchecked (the Rust side's checked mode aside): a slot or
// position outside the cache or the sequence's pages drops the row, a block-table entry is
// clamped into the cache, so no value writes outside it.
__global__ void write_rows(const KvWriteArgs a) {
  const int64_t i = blockIdx.x, hk = blockIdx.y;
  int64_t page, offset;
  if (a.slots != 0) {
    const int64_t slot = device_ptr<const int64_t>(a.slots)[i];
    if (slot < 0 || slot >= a.pages * a.page_size) return;  // padding, or outside the cache
    page = slot / a.page_size;
    offset = slot % a.page_size;
  } else {
    int64_t b, first;
    if (a.cu_new != 0) {
      const auto* cu = device_ptr<const int32_t>(a.cu_new);
      b = sequence_of(cu, a.batch, i);
      if (b < 0) return;  // in no sequence
      first = cu[b];
    } else {
      b = i / a.n_new;
      first = b * a.n_new;
    }
    const int64_t pos = int64_t(device_ptr<const int32_t>(a.seqused_k)[b]) + (i - first);
    if (pos < 0 || pos >= a.pages_per_seq * a.page_size) return;  // past the sequence's pages
    const int64_t entry =
        device_ptr<const int32_t>(a.block_table)[b * a.pages_per_seq + pos / a.page_size];
    page = min(max(entry, int64_t(0)), a.pages - 1);
    offset = pos % a.page_size;
  }
  const int64_t src = i * a.new_row_stride + hk * a.new_head_stride;
  const int64_t dst = page * a.page_stride + offset * a.row_stride + hk * a.head_stride;
  // 16-byte chunks of 16-bit values: every stride and base is a multiple of 8 elements (host).
  const auto* kn = device_ptr<const uint4>(a.k_new) + src / 8;
  const auto* vn = device_ptr<const uint4>(a.v_new) + src / 8;
  auto* kc = device_ptr<uint4>(a.k_cache) + dst / 8;
  auto* vc = device_ptr<uint4>(a.v_cache) + dst / 8;
  for (int64_t c = threadIdx.x; c < a.head_dim / 8; c += blockDim.x) {
    kc[c] = kn[c];
    vc[c] = vn[c];
  }
}

// Each length grows by its sequence's new rows, within [0, capacity]: a length never points
// past the sequence's pages (nor overflows), whatever it was.
__global__ void advance_lengths(const KvWriteArgs a) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= a.batch) return;
  int64_t n = a.n_new;
  if (a.cu_new != 0) {
    const auto* cu = device_ptr<const int32_t>(a.cu_new);
    n = max(int64_t(cu[b + 1]) - int64_t(cu[b]), int64_t(0));
  }
  auto* used = device_ptr<int32_t>(a.seqused_k);
  used[b] = int32_t(min(max(int64_t(used[b]) + n, int64_t(0)), a.pages_per_seq * a.page_size));
}

}  // namespace

void kv_write(const KvWriteArgs& a, void* stream) {
  const bool append = a.slots == 0;
  if (a.head_dim % 8 != 0 || a.kv_heads > 65535 || a.rows > INT32_MAX || a.pages < 1 ||
      (append && (a.batch < 1 || a.pages_per_seq * a.page_size > INT32_MAX)) ||
      (append && a.cu_new == 0 && a.n_new < 1))
    throw Error(
        "kv_write: head_dim a multiple of 8, kv_heads at most 65535, rows below 2^31, at least "
        "one page; an append needs sequences, n_new or cu_new, and a sequence's pages below "
        "2^31 keys");
  const auto s = static_cast<cudaStream_t>(stream);
  if (a.rows > 0) {
    write_rows<<<dim3(unsigned(a.rows), unsigned(a.kv_heads)), 32, 0, s>>>(a);
    SDPA_LAUNCH_CHECK("kv_write rows launch");
  }
  if (append) {
    advance_lengths<<<unsigned((a.batch + 127) / 128), 128, 0, s>>>(a);
    SDPA_LAUNCH_CHECK("kv_write lengths launch");
  }
}

}  // namespace sdpa
