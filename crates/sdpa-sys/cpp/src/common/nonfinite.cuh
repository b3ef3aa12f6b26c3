// Non-finite values of V at keys a causal row does not see: the non-finite V check.
//
// The reference skips masked keys. A tensor-core P·V multiplies them by P = 0 instead, and
// 0 · NaN = 0 · Inf = NaN, so a NaN or an infinity in V at a key past a row's diagonal, inside
// a key tile the row shares with keys it does see, would turn that row's output into NaN. The
// fused kernels therefore treat each V tile that crosses the causal diagonal like this:
//   1. scan the tile's 16-bit values for non-finite ones (cheap: a few loads a thread, once per
//      diagonal tile; the common case stops here);
//   2. if there are any: per column, record the first key (tile-relative) holding a NaN, a
//      +Inf and a -Inf, and set those values to 0 in shared memory, so that P·V is finite;
//   3. after that tile's P·V, every O element adds what its row's visible keys of the tile
//      contribute in the reference: NaN if one of them is NaN or both infinities are there,
//      ±Inf if one infinity is, nothing otherwise (nonfinite_term). Added, not assigned, so
//      that it composes with what earlier tiles left in O (Inf + -Inf = NaN, as in f64).
// Whether a key is visible is decided by the causal mask alone, as in the reference (which
// multiplies even an underflowed weight by the value).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sdpa {

// Tile-relative key index meaning "none": tiles hold at most 255 keys.
constexpr uint8_t kNoKey = 0xff;

// Exponent bits of a 16-bit float type: all set means Inf or NaN. f16 has 5, bf16 8.
template <bool kBf16>
constexpr uint32_t kExp16 = kBf16 ? 0x7f80u : 0x7c00u;

// Whether either 16-bit half of w is Inf or NaN, for OR-ing over many words, branch-free (3
// instructions a word): bit 15 or 31 of the result is set iff the low or high half of w is Inf or
// NaN; the other bits are junk, so test the OR of the results with kNonFinite2Bits. t's halves are
// below 0x8000, and t - 1 sets bit 15 of a half only where that half is 0 (a borrow into the high
// half happens only then).
constexpr uint32_t kNonFinite2Bits = 0x80008000u;
template <bool kBf16>
__device__ __forceinline__ uint32_t nonfinite2_bits(uint32_t w) {
  constexpr uint32_t m = kExp16<kBf16> * 0x10001u;
  const uint32_t t = ~w & m;  // a half is 0 iff its exponent bits are all set
  return (t - 0x10001u) & ~t;
}
// nonfinite2_bits of the four words of a 16-byte load, OR-ed.
template <bool kBf16>
__device__ __forceinline__ uint32_t nonfinite8_bits(uint4 w) {
  return nonfinite2_bits<kBf16>(w.x) | nonfinite2_bits<kBf16>(w.y) | nonfinite2_bits<kBf16>(w.z) |
         nonfinite2_bits<kBf16>(w.w);
}

// The same test for accumulating over many words in one instruction a word: acc + w * 0 in the
// 16-bit type, two lanes at once. Finite halves add (+-)0 and leave a zero acc at +0; an Inf or
// NaN half makes its lane NaN, which stays. Start from acc = 0; a non-finite value was seen iff
// (acc & 0x7fff7fff) != 0 at the end. (sm_80 and later: fma.rn.bf16x2.)
template <bool kBf16>
__device__ __forceinline__ uint32_t nonfinite2_acc(uint32_t acc, uint32_t w) {
  uint32_t r;
  if constexpr (kBf16)
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(w), "r"(0u), "r"(acc));
  else
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(w), "r"(0u), "r"(acc));
  return r;
}

// One 16-bit value's kind: 0 finite, 1 NaN, 2 +Inf, 3 -Inf.
template <bool kBf16>
__device__ __forceinline__ int nonfinite_kind(uint32_t h) {
  constexpr uint32_t m = kExp16<kBf16>;
  if ((h & m) != m) return 0;
  if (h & (0x7fffu & ~m)) return 1;  // mantissa bits set: NaN
  return (h & 0x8000u) ? 3 : 2;
}

// Per column of one V tile: the first key holding a NaN, a +Inf and a -Inf (kNoKey if none).
template <int D>
struct NonFiniteCols {
  uint8_t first[3][D];  // [NaN, +Inf, -Inf][column]
};

// Records value h of (key, col) into c (a tile scanned key by key in increasing order per
// column, by one thread per column) and says whether it must be zeroed.
template <bool kBf16, int D>
__device__ __forceinline__ bool record_nonfinite(NonFiniteCols<D>& c, int key, int col,
                                                 uint32_t h) {
  const int kind = nonfinite_kind<kBf16>(h);
  if (kind == 0) return false;
  uint8_t& f = c.first[kind - 1][col];
  if (f == kNoKey) f = uint8_t(key);
  return true;
}

// The term a row's visible keys add, from whether they hold a NaN, a +Inf, a -Inf.
__device__ __forceinline__ float nonfinite_value(bool nan, bool pos, bool neg) {
  if (nan || (pos && neg)) return __int_as_float(0x7fc00000);
  if (pos) return __int_as_float(0x7f800000);
  if (neg) return __int_as_float(0xff800000);
  return 0.f;
}

// What the keys [0, last] of the tile (tile-relative; last < 0: none) add to column col of a
// row in the reference, given the tile's recorded columns: NaN, +Inf, -Inf or 0.
template <int D>
__device__ __forceinline__ float nonfinite_term(const NonFiniteCols<D>& c, int col, int last) {
  last = min(last, int(kNoKey) - 1);
  return nonfinite_value(int(c.first[0][col]) <= last, int(c.first[1][col]) <= last,
                         int(c.first[2][col]) <= last);
}

// What the keys [lo, BN) of the tile (tile-relative, lo > 0) add to column col, from the last
// key of each kind (kNoKey: none).
template <int D>
__device__ __forceinline__ float nonfinite_term_from(const NonFiniteCols<D>& last, int col,
                                                     int lo) {
  const auto at_or_after = [&](int k) {
    return int(last.first[k][col]) != kNoKey && int(last.first[k][col]) >= lo;
  };
  return nonfinite_value(at_or_after(0), at_or_after(1), at_or_after(2));
}

// A band's row sees keys [lo, hi] of the tile (tile-relative; the caller skips rows that see
// none there): they start at the tile's first key (the first records answer) or end at its last
// real key (the last records answer). A window at least a tile wide (mask::narrow_window) never
// leaves both edges of a row inside one tile.
template <int D>
__device__ __forceinline__ float band_nonfinite_term(const NonFiniteCols<D>& first,
                                                     const NonFiniteCols<D>& last, int col, int lo,
                                                     int hi) {
  return lo <= 0 ? nonfinite_term(first, col, hi) : nonfinite_term_from(last, col, lo);
}

// Key index meaning "none" over a whole sequence (the unfused backend's per-head records,
// cpp/src/cublas/nonfinite_v.cu): above every key, what atomicMin lowers, and what a 0xff byte
// memset writes.
constexpr uint32_t kNoKey32 = 0xffffffffu;

// nonfinite_term over a whole sequence: the first keys holding a NaN, a +Inf, a -Inf in the
// column (kNoKey32: none) and the last key the row sees (negative: none).
__device__ __forceinline__ float nonfinite_term(uint32_t first_nan, uint32_t first_pos,
                                                uint32_t first_neg, int64_t last) {
  if (last < 0) return 0.f;
  const uint64_t l = uint64_t(last);
  return nonfinite_value(first_nan <= l, first_pos <= l, first_neg <= l);
}

}  // namespace sdpa
