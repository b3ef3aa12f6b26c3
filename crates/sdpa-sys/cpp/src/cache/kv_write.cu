// Writes new K/V rows into a paged cache (sdpa.h, kv_write): one CTA per (new row, kv head)
// finds the row's page and offset (its slot, or its sequence's next position through the block
// table) and copies head_dim values in 16-byte chunks, at the cache's strides (NHD or HND
// pages alike), or into an e4m3 cache quantizes them on the way (8 values a step); a second
// launch advances each sequence's length once every copy has read it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/check.cuh"
#include "common/launch.cuh"
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

// 8 16-bit values (of `dtype`) as f32.
__device__ void widen8(uint4 x, bool bf16, float (&f)[8]) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint16_t b = uint16_t(w[j / 2] >> (16 * (j % 2)));
    f[j] = bf16 ? __bfloat162float(__ushort_as_bfloat16(b)) : __half2float(__ushort_as_half(b));
  }
}

// One (row, head) of new 16-bit values into an e4m3 cache: E4M3(x / scale), the host codec's
// rounding (sdpa::fp8: f32 division, nearest even, saturating, NaN kept as NaN).
__device__ void quantize_row(const KvWriteArgs& a, int64_t src, int64_t dst, int64_t hk) {
  const int64_t si = a.per_head_scales ? hk : 0;
  const float scale[2] = {device_ptr<const float>(a.k_scale)[si],
                          device_ptr<const float>(a.v_scale)[si]};
  const uint4* const from[2] = {device_ptr<const uint4>(a.k_new) + src / 8,
                                device_ptr<const uint4>(a.v_new) + src / 8};
  uint2* const to[2] = {reinterpret_cast<uint2*>(device_ptr<uint8_t>(a.k_cache) + dst),
                        reinterpret_cast<uint2*>(device_ptr<uint8_t>(a.v_cache) + dst)};
  const bool bf16 = a.dtype == Dtype::BF16;
  for (int64_t c = threadIdx.x; c < a.head_dim / 8; c += blockDim.x) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      float f[8];
      widen8(from[t][c], bf16, f);
      uint32_t out[2] = {0, 0};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t code =
            __nv_cvt_float_to_fp8(__fdiv_rn(f[j], scale[t]), __NV_SATFINITE, __NV_E4M3);
        out[j / 4] |= code << (8 * (j % 4));
      }
      to[t][c] = make_uint2(out[0], out[1]);
    }
  }
}

// The metadata is the caller's and unchecked (the Rust side's checked mode aside): a slot or
// position outside the cache or the sequence's pages drops the row, a block-table entry is
// clamped into the cache, so no value writes outside it.
__global__ void write_rows(const KvWriteArgs a) {
  pdl_launch_dependents();  // the lengths' launch may start; it waits for this grid
  pdl_wait();               // launched programmatically on sm_90: the grid before has completed
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
  if (a.cache_dtype == Dtype::E4M3) {
    quantize_row(a, src, dst, hk);
    return;
  }
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
  pdl_launch_dependents();
  pdl_wait();  // every copy has read the lengths
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

void kv_write(const KvWriteArgs& a, const DeviceInfo& dev, void* stream) {
  const bool append = a.slots == 0;
  if (a.cache_dtype != a.dtype &&
      (a.cache_dtype != Dtype::E4M3 || a.k_scale == 0 || a.v_scale == 0 ||
       (a.dtype != Dtype::F16 && a.dtype != Dtype::BF16)))
    throw Error("kv_write: a cache of another dtype than the new rows is e4m3, with scales");
  if (a.head_dim % 8 != 0 || a.kv_heads > 65535 || a.rows > INT32_MAX || a.pages < 1 ||
      (append && (a.batch < 1 || a.pages_per_seq * a.page_size > INT32_MAX)) ||
      (append && a.cu_new == 0 && a.n_new < 1))
    throw Error(
        "kv_write: head_dim a multiple of 8, kv_heads at most 65535, rows below 2^31, at least "
        "one page; an append needs sequences, n_new or cu_new, and a sequence's pages below "
        "2^31 keys");
  // Programmatically on sm_90: each launch overlaps the tail of the grid before it on the
  // stream (the previous step's attention, then the rows' copy), each kernel waiting for it.
  const auto s = static_cast<cudaStream_t>(stream);
  const bool pdl = dev.cc_major >= 9;
  if (a.rows > 0)
    launch_kernel(write_rows, dim3(unsigned(a.rows), unsigned(a.kv_heads)), dim3(32), 0, s, pdl, a);
  if (append)
    launch_kernel(advance_lengths, dim3(unsigned((a.batch + 127) / 128)), dim3(128), 0, s, pdl, a);
}

}  // namespace sdpa
