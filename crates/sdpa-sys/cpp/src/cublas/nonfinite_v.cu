// Non-finite V at causally masked keys on the unfused cuBLAS backend (the non-finite V check; the
// contract is NonFiniteVArgs in sdpa.h). The P·V GEMM spans every key with P = 0 at masked ones,
// and 0 · NaN = 0 · Inf = NaN, so causal calls run it on a finite copy of V and put the reference's
// non-finite terms into O afterwards:
//   sanitize_v: a memset of the records (12 bytes a kv head and column), then one pass over V,
//     copying it dense with non-finite values set to 0 and lowering (atomicMin) per kv head and
//     column the first key that holds a NaN, a +Inf, a -Inf. In the common all-finite case this is
//     a copy plus one OR of exponent bits per word.
//   add_nonfinite_v: each block loads its head's first non-finite key once; only blocks with a
//     row that sees it go on, and they rewrite only the elements whose term is not 0.
// Non-causal calls use neither: every key is visible, and the GEMM propagates NaN and Inf as
// the reference does.
// Assumes validated arguments (crates/sdpa/src/backend/cublas/mod.rs): dtype F16 or BF16, heads a
// multiple of kv_heads, seq_k and head_dim below 2^31 (keys are recorded as uint32 with 0xffffffff
// for none; a block's element count and head_dim / kVec are int), buffers as large as the strides
// and shapes address. Everything else is 64-bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "common/check.cuh"
#include "common/nonfinite.cuh"
#include "sdpa/sdpa.h"

namespace sdpa::cublas_backend {
namespace {

constexpr int kThreads = 256;
// V bytes one sanitize block copies: four 16-byte loads a thread, and a 4 MiB V (16k keys of
// d = 128) still spreads over 256 blocks.
constexpr int64_t kChunkBytes = 16384;
// O rows one add block covers. Blocks before their head's first non-finite key return after
// one load, so the common case costs seq_q / 128 near-empty blocks per head.
constexpr int kRows = 128;
// The grid's y limit; larger (batch, head) counts loop inside the blocks.
constexpr int64_t kMaxGridY = 65535;

// Elements as raw 16-bit words; sizes, strides and offsets in elements.
struct Params {
  const uint16_t* v;
  Strides vs;
  uint16_t* v_finite;
  uint32_t* first;  // [kv head][1 + 3 * d], see NonFiniteVArgs::first_keys
  uint16_t* o;
  Strides os;
  int64_t heads, kv_heads, seq_q, seq_k, d;
  int64_t chunk_keys;  // keys per sanitize block
};

// kVec 16-bit values of one row as 32-bit words; for kVec = 1 the high half is 0 (finite).
template <int kVec>
struct Access;
template <>
struct Access<8> {
  static constexpr int kWords = 4;
  static __device__ __forceinline__ void load(const uint16_t* p, uint32_t (&w)[kWords]) {
    const uint4 x = __ldg(reinterpret_cast<const uint4*>(p));
    w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
  }
  static __device__ __forceinline__ void store(uint16_t* p, const uint32_t (&w)[kWords]) {
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
};
template <>
struct Access<2> {
  static constexpr int kWords = 1;
  static __device__ __forceinline__ void load(const uint16_t* p, uint32_t (&w)[kWords]) {
    w[0] = __ldg(reinterpret_cast<const unsigned*>(p));
  }
  static __device__ __forceinline__ void store(uint16_t* p, const uint32_t (&w)[kWords]) {
    *reinterpret_cast<uint32_t*>(p) = w[0];
  }
};
template <>
struct Access<1> {
  static constexpr int kWords = 1;
  static __device__ __forceinline__ void load(const uint16_t* p, uint32_t (&w)[kWords]) {
    w[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
  }
  static __device__ __forceinline__ void store(uint16_t* p, const uint32_t (&w)[kWords]) {
    *p = uint16_t(w[0]);
  }
};

// Lowers *p to key. The L2 read first (values only decrease, so a stale one is never below
// the truth) keeps an all-NaN V from queueing every thread's atomic on the same few words.
__device__ __forceinline__ void lower(uint32_t* p, uint32_t key) {
  if (key < __ldcg(p)) atomicMin(p, key);
}

// The rare path: sets the non-finite halves of w (columns col, col + 1, ... of `key`) to 0 and
// records them in the head's `first`.
template <bool kBf16, int kWords>
__device__ void zero_and_record(uint32_t (&w)[kWords], uint32_t* first, int64_t d, int64_t col,
                                uint32_t key) {
  lower(first, key);
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int kind = nonfinite_kind<kBf16>((w[i] >> (16 * half)) & 0xffffu);
      if (kind == 0) continue;
      w[i] &= ~(0xffffu << (16 * half));
      lower(first + 1 + (kind - 1) * d + col + 2 * i + half, key);
    }
  }
}

// Grid: x = chunks of chunk_keys keys, y (looping) = (batch, kv head).
template <bool kBf16, int kVec>
__global__ void __launch_bounds__(kThreads) sanitize_kernel(Params p, int64_t kv_pairs) {
  using A = Access<kVec>;
  const int64_t key0 = int64_t(blockIdx.x) * p.chunk_keys;
  const int vecs_per_key = int(p.d / kVec);
  // At most max(kChunkBytes / 2, d) values: fits an int.
  const int n = int(min(p.chunk_keys, p.seq_k - key0)) * vecs_per_key;
  for (int64_t bk = blockIdx.y; bk < kv_pairs; bk += gridDim.y) {
    const int64_t b = bk / p.kv_heads, hk = bk - b * p.kv_heads;
    const uint16_t* src = p.v + b * p.vs.batch + hk * p.vs.head + key0 * p.vs.seq;
    uint16_t* dst = p.v_finite + (bk * p.seq_k + key0) * p.d;
    for (int e = threadIdx.x; e < n; e += kThreads) {
      const int k = e / vecs_per_key, col = (e - k * vecs_per_key) * kVec;
      uint32_t w[A::kWords];
      A::load(src + k * p.vs.seq + col, w);
      uint32_t bits = 0;
#pragma unroll
      for (int i = 0; i < A::kWords; ++i) bits |= nonfinite2_bits<kBf16>(w[i]);
      if (bits & kNonFinite2Bits)
        zero_and_record<kBf16>(w, p.first + bk * (1 + 3 * p.d), p.d, col, uint32_t(key0 + k));
      A::store(dst + int64_t(k) * p.d + col, w);
    }
  }
}

template <bool kBf16>
__device__ __forceinline__ float to_float(uint16_t x) {
  if constexpr (kBf16) return __bfloat162float(__ushort_as_bfloat16(x));
  return __half2float(__ushort_as_half(x));
}
template <bool kBf16>
__device__ __forceinline__ uint16_t from_float(float x) {
  if constexpr (kBf16) return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  return __half_as_ushort(__float2half_rn(x));
}

// Grid: x = blocks of kRows query rows, y (looping) = (batch, head).
template <bool kBf16>
__global__ void __launch_bounds__(kThreads) add_kernel(Params p, int64_t q_pairs) {
  const int64_t r0 = int64_t(blockIdx.x) * kRows;
  const int rows = int(min(int64_t(kRows), p.seq_q - r0));
  const int64_t shift = p.seq_k - p.seq_q;  // row r sees keys k <= r + shift (< seq_k)
  const int64_t last_max = r0 + rows - 1 + shift;
  if (last_max < 0) return;  // no row of the block sees a key: zeros stay
  const int64_t group = p.heads / p.kv_heads;
  for (int64_t bh = blockIdx.y; bh < q_pairs; bh += gridDim.y) {
    const int64_t b = bh / p.heads, h = bh - b * p.heads;
    const uint32_t* first = p.first + (b * p.kv_heads + h / group) * (1 + 3 * p.d);
    // The common case ends here: no row of the block sees a non-finite value of the head.
    if (first[0] > uint64_t(last_max)) continue;
    // A warp per row, its lanes along the columns: no division in the index math.
    uint16_t* o = p.o + b * p.os.batch + h * p.os.head + r0 * p.os.seq;
    for (int r = threadIdx.x / 32; r < rows; r += kThreads / 32) {
      const int64_t last = r0 + r + shift;
      for (int64_t col = threadIdx.x % 32; col < p.d; col += 32) {
        const float t =
            nonfinite_term(first[1 + col], first[1 + p.d + col], first[1 + 2 * p.d + col], last);
        if (t == 0.f) continue;
        uint16_t& x = o[r * p.os.seq + col];
        x = from_float<kBf16>(to_float<kBf16>(x) + t);
      }
    }
  }
}

Params make_params(const NonFiniteVArgs& a) {
  Params p;
  p.v = device_ptr<const uint16_t>(a.v);
  p.vs = a.v_stride;
  p.v_finite = device_ptr<uint16_t>(a.v_finite);
  p.first = device_ptr<uint32_t>(a.first_keys);
  p.o = device_ptr<uint16_t>(a.o);
  p.os = a.o_stride;
  p.heads = a.heads;
  p.kv_heads = a.kv_heads;
  p.seq_q = a.seq_q;
  p.seq_k = a.seq_k;
  p.d = a.head_dim;
  p.chunk_keys = std::max<int64_t>(1, kChunkBytes / (2 * a.head_dim));
  return p;
}

bool is_bf16(const NonFiniteVArgs& a, const char* name) {
  if (a.dtype != Dtype::F16 && a.dtype != Dtype::BF16)
    throw Error(std::string(name) + ": unsupported dtype code " + std::to_string(int(a.dtype)));
  return a.dtype == Dtype::BF16;
}

// The widest access (values a thread loads at once) that every row start of V and of its copy
// is aligned to: 16 bytes whenever head_dim is a multiple of 8.
int access_width(const NonFiniteVArgs& a) {
  for (int w : {8, 2}) {
    const int64_t bytes = 2 * w;
    const bool ok = a.head_dim % w == 0 && a.v_stride.batch % w == 0 && a.v_stride.head % w == 0 &&
                    a.v_stride.seq % w == 0 && a.v % bytes == 0 && a.v_finite % bytes == 0;
    if (ok) return w;
  }
  return 1;
}

template <bool kBf16>
void launch_sanitize(const Params& p, int width, int64_t kv_pairs, cudaStream_t st) {
  const dim3 grid(unsigned((p.seq_k + p.chunk_keys - 1) / p.chunk_keys),
                  unsigned(std::min(kv_pairs, kMaxGridY)));
  switch (width) {
    case 8:
      return sanitize_kernel<kBf16, 8><<<grid, kThreads, 0, st>>>(p, kv_pairs);
    case 2:
      return sanitize_kernel<kBf16, 2><<<grid, kThreads, 0, st>>>(p, kv_pairs);
    default:
      return sanitize_kernel<kBf16, 1><<<grid, kThreads, 0, st>>>(p, kv_pairs);
  }
}

}  // namespace
}  // namespace sdpa::cublas_backend

namespace sdpa {

void sanitize_v(const NonFiniteVArgs& a, void* stream) {
  using namespace cublas_backend;
  const auto st = static_cast<cudaStream_t>(stream);
  const bool bf16 = is_bf16(a, "sanitize_v");
  const Params p = make_params(a);
  const int64_t kv_pairs = a.batch * a.kv_heads;
  // Every record starts at "no such key", which the kernel lowers.
  static_assert(kNoKey32 == 0xffffffffu, "kNoKey32 is what a 0xff byte memset writes");
  SDPA_CUDA_CHECK(cudaMemsetAsync(device_ptr<void>(a.first_keys), 0xff,
                                  size_t(kv_pairs * (1 + 3 * a.head_dim)) * sizeof(uint32_t), st));
  const int width = access_width(a);
  if (bf16)
    launch_sanitize<true>(p, width, kv_pairs, st);
  else
    launch_sanitize<false>(p, width, kv_pairs, st);
  SDPA_LAUNCH_CHECK("sanitize_v launch");
}

void add_nonfinite_v(const NonFiniteVArgs& a, void* stream) {
  using namespace cublas_backend;
  const auto st = static_cast<cudaStream_t>(stream);
  const bool bf16 = is_bf16(a, "add_nonfinite_v");
  const Params p = make_params(a);
  const int64_t q_pairs = a.batch * a.heads;
  const dim3 grid(unsigned((a.seq_q + kRows - 1) / kRows), unsigned(std::min(q_pairs, kMaxGridY)));
  if (bf16)
    add_kernel<true><<<grid, kThreads, 0, st>>>(p, q_pairs);
  else
    add_kernel<false><<<grid, kThreads, 0, st>>>(p, q_pairs);
  SDPA_LAUNCH_CHECK("add_nonfinite_v launch");
}

}  // namespace sdpa
