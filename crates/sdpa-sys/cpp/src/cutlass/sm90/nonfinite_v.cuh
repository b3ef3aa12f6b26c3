// The non-finite V check of the sm_90a kernels (common/nonfinite.cuh says what it computes): a V
// tile partly masked for a query tile may hold NaN or Inf at keys some rows do not see, which a
// plain P·V would spread to those rows as 0·Inf = NaN. The tile is scanned; in the rare case it
// has any, each column's first NaN, +Inf and -Inf are recorded and zeroed, and after P·V every
// row adds the terms of the values it does see. Also the e4m3 V helpers (exact conversion to
// f16, the NaN test) the converting warps and the pre-pass share.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "common/nonfinite.cuh"
#include "cutlass/sm90/primitives.cuh"
#include "cutlass/sm90/tile_config.cuh"

namespace sdpa::cutlass_sm90 {

// Whether this thread's share (thread i of n) of a V tile of BN keys x D columns (BN * D
// contiguous 16-bit values from shared address `tile`, in any order) holds a non-finite value.
// Everything in 32-bit shared addresses: the producer's spare warps run it in 24 registers.
template <typename T, int BN, int D, int kUnroll = 1>
__device__ __forceinline__ bool scan_nonfinite(uint32_t tile, int i, int n) {
  constexpr bool kBf16 = std::is_same_v<T, cute::bfloat16_t>;
  uint32_t acc[2] = {0u, 0u};  // nonfinite2_acc over every word, in two chains
  // kUnroll 1 for the producer's spare warps (unrolled, they spill at 24 registers: e4m3,
  // D = 128); the small kernel unrolls, its loads then overlap.
#pragma unroll kUnroll
  for (int o = i * 16; o < BN * D * 2; o += n * 16) {
    const uint4 x = ld_shared_128(tile + uint32_t(o));
    acc[0] = nonfinite2_acc<kBf16>(nonfinite2_acc<kBf16>(acc[0], x.x), x.y);
    acc[1] = nonfinite2_acc<kBf16>(nonfinite2_acc<kBf16>(acc[1], x.z), x.w);
  }
  return ((acc[0] | acc[1]) & 0x7fff7fffu) != 0;
}

// The rare path, once some thread's share had a non-finite value: one thread a column (thread i
// of n) records into nf (shared address of a NonFiniteCols<D>) the first NaN, +Inf and -Inf of
// its column, with kLast into nf_last the last ones too, and zeroes them. Keys from real_keys on
// (rows past the sequence: another sequence's keys in packed K/V) are zeroed unrecorded: no row
// sees them. addr(key, col): the shared address of one value. The zeros are generic-proxy
// writes: the caller fences them before any wgmma reads the tile.
template <typename T, int BN, int D, bool kLast = false, class Addr>
__device__ __forceinline__ void record_nonfinite_cols(uint32_t nf, uint32_t nf_last, Addr addr,
                                                      int i, int n, int real_keys = BN) {
  constexpr bool kBf16 = std::is_same_v<T, cute::bfloat16_t>;
  static_assert(sizeof(T) == 2 && BN < kNoKey && sizeof(NonFiniteCols<D>) == 3 * D);
  for (int col = i; col < D; col += n) {
    for (int j = 0; j < 3; ++j) {
      st_shared_8(nf + uint32_t(j * D + col), kNoKey);
      if constexpr (kLast) st_shared_8(nf_last + uint32_t(j * D + col), kNoKey);
    }
    for (int key = 0; key < BN; ++key) {
      const uint32_t a = addr(key, col);
      const int kind = nonfinite_kind<kBf16>(ld_shared_16(a));
      if (kind == 0) continue;
      st_shared_16(a, 0);
      if (key >= real_keys) continue;
      const uint32_t f = nf + uint32_t((kind - 1) * D + col);
      if (ld_shared_8(f) == kNoKey) st_shared_8(f, uint8_t(key));
      if constexpr (kLast) st_shared_8(nf_last + uint32_t((kind - 1) * D + col), uint8_t(key));
    }
  }
}

// After P·V of a checked tile (keys from n0): every O element adds the reference's term of the
// non-finite values its row sees there. cO: O's (row, col) coordinates in the row/col view, rows
// from m0.
template <int D, class Mask, class TO, class TC>
__device__ __forceinline__ void add_nonfinite_terms(TO& O, TC const& cO, const NonFiniteCols<D>& nf,
                                                    const Mask& mask, int m0, int n0) {
  CUTE_UNROLL
  for (int r = 0; r < decltype(size<0>(O))::value; ++r) {
    const int last = mask.last_key(m0 + int(get<0>(cO(r, 0)))) - n0;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(O); ++c) O(r, c) += nonfinite_term(nf, get<1>(cO(r, c)), last);
  }
}

// add_nonfinite_terms for a band (rows see [first_key, last_key] of the tile from n0).
template <int D, class Mask, class TO, class TC>
__device__ __forceinline__ void add_band_nonfinite_terms(TO& O, TC const& cO,
                                                         const NonFiniteCols<D>& nf,
                                                         const NonFiniteCols<D>& nf_last,
                                                         const Mask& mask, int m0, int n0) {
  CUTE_UNROLL
  for (int r = 0; r < decltype(size<0>(O))::value; ++r) {
    const int row = m0 + int(get<0>(cO(r, 0)));
    const int lo = mask.first_key(row) - n0, hi = mask.last_key(row) - n0;
    if (hi < lo || hi < 0 || lo >= int(kNoKey)) continue;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(O); ++c)
      O(r, c) += band_nonfinite_term(nf, nf_last, get<1>(cO(r, c)), lo, hi);
  }
}

// The check of the main kernel's stage s, by the producer's spare warps (thread ct of
// C::kConverters, named barrier `bar`) once each has scanned its share (hit: it had a non-finite
// value): whether any share had one, and if so the tile's records (into check slot `slot`: with
// kLast the last keys too; of its first real_keys keys) and zeros (the caller fences the zeros
// for the wgmmas). Publishes the answer in sm.nf_any[slot].
template <class C, bool kLast = false>
__device__ __forceinline__ bool settle_nonfinite(typename C::Smem& sm, int s, int slot, bool hit,
                                                 int ct, int bar, int real_keys = C::kBN) {
  using PV = typename C::PV;
  const bool any = named_or(bar, C::kConverters, hit);
  if (any) {
    constexpr auto kSwizzle = get_swizzle_portion(typename C::LayoutV{});
    constexpr auto kFlatV = get_nonswizzle_portion(typename C::LayoutV{});
    const uint32_t v16 = uint32_t(__cvta_generic_to_shared(sm.v));
    record_nonfinite_cols<PV, C::kBN, C::kDV, kLast>(
        uint32_t(__cvta_generic_to_shared(&sm.nf[slot])),
        uint32_t(__cvta_generic_to_shared(&sm.nf_last[slot])),
        [&](int key, int col) {
          return kSwizzle(v16 + uint32_t(kFlatV(key, col, s) * sizeof(PV)));
        },
        ct, C::kConverters, real_keys);
  }
  if (ct == 0) sm.nf_any[slot] = any;
  return any;
}

// Whether one of the 8 e4m3 codes in x is a NaN (S.1111.111): a zero byte of
// (x & 0x7f..) ^ 0x7f.., found by the borrow trick (exact for bytes below 0x80).
__device__ __forceinline__ bool e4m3_nan8(uint2 x) {
  const auto zero_byte = [](uint32_t w) {
    const uint32_t t = (w & 0x7f7f7f7fu) ^ 0x7f7f7f7fu;
    return (t - 0x01010101u) & ~t & 0x80808080u;
  };
  return (zero_byte(x.x) | zero_byte(x.y)) != 0;
}

// Two e4m3 codes (a in the low byte) -> two f16 in one register, exactly.
__device__ __forceinline__ uint32_t f16x2_of_e4m3x2(uint32_t codes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(codes), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// Eight e4m3 codes (8 bytes, the first in the low byte) -> eight f16 (16 bytes), exactly.
__device__ __forceinline__ uint4 f16x8_of_e4m3x8(uint2 codes) {
  return make_uint4(f16x2_of_e4m3x2(codes.x), f16x2_of_e4m3x2(codes.x >> 16),
                    f16x2_of_e4m3x2(codes.y), f16x2_of_e4m3x2(codes.y >> 16));
}

// E4m3 V's codes, one tile of BN keys x D (unswizzled rows of D bytes from shared address v8),
// into f16 at the shared address dst(key, d) of key's columns d.. d + 7 in the tile the wgmmas
// read (swizzled), exactly: thread i of kThreads keeps its 8 columns and steps over the keys (no
// index division in the loop; 8-byte reads along the rows, 16-byte writes: both free of bank
// conflicts). kNan: returns whether one of its codes was a NaN (e4m3 has no infinities), else
// false. kUnroll: the loop unrolled (the small kernel, whose loads then overlap, and which checks
// the f16 tile instead: a NaN test left to dead-code elimination changes how the loop unrolls;
// the main kernel's converting warps run in 24 registers and keep it rolled).
template <int BN, int D, int kThreads, bool kUnroll, bool kNan, class Dst>
__device__ __forceinline__ bool convert_e4m3_tile(uint32_t v8, int i, const Dst& dst) {
  constexpr int kPerRow = D / 8, kStep = kThreads / kPerRow;
  static_assert(kThreads % kPerRow == 0);
  const int d = i % kPerRow * 8;
  bool nan8 = false;
  const auto one = [&](int key) __attribute__((always_inline)) {
    const uint2 x = ld_shared_64(v8 + uint32_t(key * D + d));
    if constexpr (kNan) nan8 |= e4m3_nan8(x);
    st_shared_128(dst(key, d), f16x8_of_e4m3x8(x));
  };
  if constexpr (kUnroll) {
    CUTE_UNROLL
    for (int key = i / kPerRow; key < BN; key += kStep) one(key);
  } else {
    for (int key = i / kPerRow; key < BN; key += kStep) one(key);
  }
  return nan8;
}

}  // namespace sdpa::cutlass_sm90
