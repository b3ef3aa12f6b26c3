// The online softmax of the sm_90a kernels, on wgmma accumulators: a tile of scores as the masks
// and score mods take it, the running row max and sum, O's rescaling and final normalization. The
// main kernel runs it once per key tile; the small-problem kernel once per CTA.
#pragma once

#include "common/score_mods.cuh"
#include "common/sinks.cuh"
#include "cutlass/dtype.cuh"
#include "cutlass/sm90/primitives.cuh"
#include "cutlass/sm90/tile_config.cuh"

namespace sdpa::cutlass_sm90 {

// ((2, 2, N/8), M, N) accumulator layout -> ((2 rows, M), (2 cols, N/8, N)) row/column view.
template <class L>
__device__ __forceinline__ constexpr auto rowcol(L const& l) {
  static_assert(decltype(rank(l))::value == 3);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// A thread's part of a tile of scores as the mask policies (common/mask.cuh: apply) and the score
// mods (common/score_mods.cuh) take it: S in the row/col view, cS each element's (row, col) within
// the tile. kBitMask: keep() by one mask word a row; without it, by each score's column (the e4m3
// P kernels: there the mask word's registers let ptxas move the softmax's first exponentials in
// front of K's release in the key loop, which delays the next K load; docs/perf.md, step 7).
template <class TS, class TC, bool kBitMask = true>
struct ScoreTile {
  TS& s;
  TC const& cs;
  static constexpr int kRows = decltype(size<0>(std::declval<TS&>()))::value;
  static constexpr int kCols = decltype(size<1>(std::declval<TS&>()))::value;
  static constexpr int kSize = decltype(size(std::declval<TS&>()))::value;

  __device__ __forceinline__ int row(int r) const { return get<0>(cs(r, 0)); }
  __device__ __forceinline__ int col(int r, int c) const { return get<1>(cs(r, c)); }
  // Hides row r's scores outside columns [lo, hi] (each within [-1, kN], kN the tile's columns)
  // with one mask word a row: bit c set where the thread's c-th column is kept, then one test and
  // select a score (fa4's R2P masks). A wgmma accumulator gives a thread columns in pairs 8 apart,
  // 2 q + 8 j + {0, 1} for its lane's quad position q (col(r, 0) = 2 q), so the count of its
  // columns below x is 2 (y / 8) + min(y % 8, 2), y = x - 2 q where positive.
  __device__ __forceinline__ void keep(int r, int lo, int hi) const {
    if constexpr (!kBitMask) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c)
        if (col(r, c) < lo || col(r, c) > hi) s(r, c) = -INFINITY;
      return;
    }
    static_assert(kCols <= 32, "one mask word a row");
    const int base = col(r, 0);
    const auto below = [base](int x) {
      const int y = max(x - base, 0);
      return 2 * (y >> 3) + min(y & 7, 2);
    };
    const uint32_t kept = shl_clamped(~0u, below(lo)) & ~shl_clamped(~0u, below(hi + 1));
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c)
      if (!(kept & (1u << c))) s(r, c) = -INFINITY;
  }
  __device__ __forceinline__ auto& x(int i) const { return s(i); }
  __device__ __forceinline__ auto& x(int r, int c) const { return s(r, c); }
};
template <bool kBitMask = true, class TS, class TC>
__device__ __forceinline__ ScoreTile<TS, TC, kBitMask> score_tile(TS& s, TC const& cs) {
  return {s, cs};
}

// Row state of the online softmax for the kRows accumulator rows a thread holds: the running
// max m (raw score units), this thread's partial row sum l (the quad adds them last), and alpha,
// the factor by which O must be rescaled after the latest step. The exponentials are scaled by
// 2^kLog2P (the row max's is 2^kLog2P): e4m3 P takes kLog2P = 8, P in (0, 256], where its 3
// mantissa bits hold the most of it below the 448 it saturates at. The row sum is of the same
// unrounded values, so normalize() cancels the scale; lse() takes it out.
//
// With kKeepMax, m need not be the exact row max: a step keeps it while no score of the warp's
// rows exceeds it by more than kMaxGrowth (in exponent units, log2), so the exponentials stay
// within 2^kMaxGrowth, and that step needs neither the quad's shuffles for the new max nor O's
// rescale. 16-bit P has the range for it; e4m3 P (kLog2P = 8) has none left and always takes
// the exact max, as does a kernel of one step a row (its first step always moves m).
template <int kRows, bool kOneExpLoop, int kLog2P = 0, bool kKeepMax = false>
struct OnlineSoftmax {
  static constexpr bool kKeeps = kKeepMax && kLog2P == 0;
  static constexpr float kMaxGrowth = 8.f;
  float m[kRows], l[kRows], alpha[kRows];

  __device__ __forceinline__ OnlineSoftmax() {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      m[r] = -INFINITY;
      l[r] = 0.f;
    }
  }

  // One tile, in place on S (the row/col view, already masked): new running max, S <-
  // exp2(S·sl2 - max·sl2), row sums, and alpha. O is rescaled apart (rescale_o): it is still
  // being accumulated by the previous tile's P·V, and gets the factor just before this tile's.
  // Past the fold limit (primitives.cuh) the exact form RN(x·sl2) - base replaces the FMA, chosen
  // by one vote per warp: with kOneExpLoop the scores are then pre-multiplied and the one FMA loop
  // runs with scale 1; otherwise a loop is compiled per form.
  template <class TS>
  __device__ __forceinline__ void step(TS& S, float sl2) {
    static_assert(decltype(size<0>(S))::value == kRows);
    float mx[kRows];
    bool keep = true;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      // Four partial maxima (and sums below): chains a quarter as long on the path to the
      // exponentials. Each chain starts from its first element: max(-inf, x) and 0 + x cannot be
      // folded (x may be NaN, or -0), and would cost an instruction a chain.
      static_assert(decltype(size<1>(S))::value >= 4);
      float part[4] = {S(r, 0), S(r, 1), S(r, 2), S(r, 3)};
      CUTE_UNROLL
      for (int c = 4; c < size<1>(S); ++c) part[c % 4] = fmaxf(part[c % 4], S(r, c));
      mx[r] = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3]));
      // False where m = -inf (the difference is +inf or NaN) and for a NaN or +inf maximum:
      // those take the exact path. A thread whose scores are all masked (-inf) keeps m.
      if constexpr (kKeeps) keep &= (mx[r] - m[r]) * sl2 <= kMaxGrowth;
    }
    if (kKeeps && __all_sync(0xffffffffu, keep)) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) alpha[r] = 1.f;
    } else {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        float row_max = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));  // a quad's row
        row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
        const float m_new = fmaxf(m[r], row_max);
        alpha[r] = ex2(__fmul_rn(m[r], sl2) - scaled_base(m_new, sl2));  // 0 from -inf
        m[r] = m_new;
      }
    }
    float base[kRows];
    bool large = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      base[r] = scaled_base(m[r], sl2);
      large |= !(fabsf(base[r]) < kFoldLimit);
      if constexpr (kLog2P != 0) base[r] -= float(kLog2P);
    }
    const auto exps = [&](auto exponent) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        float sum[4];
        CUTE_UNROLL
        for (int c = 0; c < size<1>(S); ++c) {
          const float e = ex2(exponent(S(r, c), base[r]));
          S(r, c) = e;
          sum[c % 4] = c < 4 ? e : sum[c % 4] + e;
        }
        l[r] = l[r] * alpha[r] + ((sum[0] + sum[1]) + (sum[2] + sum[3]));
      }
    };
    const bool exact = __any_sync(0xffffffffu, large);
    if constexpr (kOneExpLoop) {
      float s_eff = sl2;
      if (exact) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTE_UNROLL
          for (int c = 0; c < size<1>(S); ++c) S(r, c) = __fmul_rn(S(r, c), sl2);
        }
        s_eff = 1.f;
      }
      exps([&](float x, float b) { return fmaf(x, s_eff, -b); });
    } else if (!exact) {
      exps([&](float x, float b) { return fmaf(x, sl2, -b); });
    } else {
      exps([&](float x, float b) { return __fmul_rn(x, sl2) - b; });
    }
  }

  // The whole row's sum (over the quad that holds the row).
  __device__ __forceinline__ float row_sum(int r) const {
    float s = l[r];
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    return s;
  }

  // O *= alpha per row, skipped when no row of the warp moved its max (alpha is then exactly 1):
  // after the first few key tiles the running max rarely moves.
  template <class TO>
  __device__ __forceinline__ void rescale_o(TO& O) const {
    bool moved = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) moved |= alpha[r] != 1.f;
    if (!__any_sync(0xffffffffu, moved)) return;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(O); ++c) O(r, c) *= alpha[r];
    }
  }

  // Folds the sink logit `sink` (natural log, raw; common/sinks.cuh) into every row once its
  // last key tile is done, before lse() and normalize(). The steps' exponentials are
  // 2^(x·sl2 - m·sl2 + kLog2P): in log2 units the row's maximum is m·sl2 - kLog2P. A sink less
  // than 2^64 above it joins the row sum alone (m and O stay: the cheap, common case); a row
  // without keys, a sink far above the row and a NaN or +inf sink take the general fold, which
  // moves m and rescales O. Each lane of the quad then holds a quarter of the row sum, which its
  // four lanes add back exactly. Every lane of the quad calls it.
  template <class TO>
  __device__ __forceinline__ void fold_sink(TO& O, float sink, float sl2) {
    if (sink == -INFINITY) return;  // no sink: the rows as they are
    const float s2 = sink * kLog2e;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float sum = row_sum(r);
      float m2 = m[r] * sl2 - float(kLog2P);
      if (s2 - m2 < 64.f) {  // false for m = -inf and for a NaN or +inf sink
        l[r] = 0.25f * (sum + exp2f(s2 - m2));
        continue;
      }
      const float a = sdpa::fold_sink(m2, sum, sink);
      m[r] = (m2 + float(kLog2P)) / sl2;
      l[r] = 0.25f * sum;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(O); ++c) O(r, c) *= a;
    }
  }

  // The natural log-sum-exp of row r, for the scale sl2 the steps took: ln 2 · (m · sl2 +
  // log2 l); -inf for a row with no visible key. Every lane of the quad calls it.
  __device__ __forceinline__ float lse(int r, float sl2) const {
    const float sum = row_sum(r);
    return sum > 0.f ? (m[r] * sl2 + __log2f(sum) - float(kLog2P)) * 0.6931471805599453f
                     : -INFINITY;
  }

  // O *= f / row sum (f: 1, or V's dequantization scale); a row with no visible key has l = 0
  // and outputs zeros. l >= 1 otherwise (the max element contributes exp2(0)), so the
  // approximate reciprocal is safe.
  template <class TO>
  __device__ __forceinline__ void normalize(TO& O, float f) const {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = row_sum(r);
      const float inv = sum > 0.f ? __fdividef(f, sum) : 0.f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(O); ++c) O(r, c) *= inv;
    }
  }
};

// Four floats as e4m3 codes (a in the low byte): round to nearest even, saturating at 448.
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(lo) : "f"(a), "f"(b));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(hi) : "f"(c), "f"(d));
  return uint32_t(lo) | (uint32_t(hi) << 16);
}

// S accumulator (f32) -> P in rP's type, in the register layout of P·V's A operand
// (TileConfig::LayoutP). 16-bit P: pairs in place. E4m3 P: per 32-key step (S elements 16kb ..
// 16kb + 15: 2 cols, 2 rows, 4 col groups), its 4 registers take row r's cols of groups 0-1,
// row r + 8's, row r's of groups 2-3, row r + 8's: the keys p_key_of (v_prepass.cuh) orders
// V^T's by.
template <class TP, class TS>
__device__ __forceinline__ void convert_p(TP& rP, TS const& tSrS) {
  using T = typename TP::value_type;
  Tensor rP32 = recast<uint32_t>(rP);
  if constexpr (std::is_same_v<T, cute::float_e4m3_t>) {
    CUTE_UNROLL
    for (int kb = 0; kb < size(rP32) / 4; ++kb) {
      const auto s = [&](int i) { return tSrS(16 * kb + i); };
      rP32(4 * kb + 0) = e4m3x4(s(0), s(1), s(4), s(5));
      rP32(4 * kb + 1) = e4m3x4(s(2), s(3), s(6), s(7));
      rP32(4 * kb + 2) = e4m3x4(s(8), s(9), s(12), s(13));
      rP32(4 * kb + 3) = e4m3x4(s(10), s(11), s(14), s(15));
    }
  } else {
    CUTE_UNROLL
    for (int i = 0; i < size(rP32); ++i) rP32(i) = pack2<T>(tSrS(2 * i), tSrS(2 * i + 1));
  }
}

}  // namespace sdpa::cutlass_sm90
