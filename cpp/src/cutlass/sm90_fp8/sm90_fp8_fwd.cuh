// Native FP8 (e4m3) attention for sm_90a: the e4m3 sibling of cutlass/sm90/sm90_fwd.cuh (same
// warp roles, pipeline, tile order and softmax; read that file first). Assumes validated
// arguments (crates/sdpa/src/problem.rs): dtype E4M3, out_dtype F16 or BF16, head_dim == D,
// heads % kv_heads == 0, seq_q, seq_k >= 1, 16-byte aligned bases, Q/K/V strides multiples of
// 16 elements (bytes), O strides multiples of 8 elements, workspace of workspace_bytes().
//
// What differs from the f16 kernel:
//   S = Q·Kᵀ    wgmma e4m3 SS (K = 32 per instruction), Q [BM][D] and K [BN][D] K-major in
//               smem (128-byte swizzle at D = 128, 64-byte at D = 64: one swizzle row = D bytes).
//   softmax     q_scale·k_scale folded into the log2-domain softmax scale; P = 2^8 · exp2(..)
//               (the 2^8 rides in the exp2 bias for free): P <= 256 < 448, and weights down to
//               2^-14 of the row's largest stay e4m3 normals. The row sum carries the same
//               factor, so O / l cancels it. Row max and sum reduce in 4 independent chains.
//   O += P·V    wgmma e4m3 RS. Both FP8 operands must be K-major, so V arrives as Vᵀ [D][keys]
//               from a transpose pre-pass (transpose_v, enqueued first on the same stream,
//               into the caller's workspace). The f32 accumulator of S and the 8-bit A
//               fragment do not share their column ownership (per 32-key step a thread holds
//               keys {2c, 2c+1, 8+2c, 9+2c, 16+2c, ...} of S but needs A columns
//               {4c..4c+3, 16+4c..16+4c+3}), so instead of shuffling P between lanes the
//               pre-pass stores the keys of each 32-key block of Vᵀ in the order the
//               registers already have (see key_of): P is converted in place, no shuffles.
//   P split     P = P_hi + P_lo, both e4m3 (Cfg::kSplitP), O += P_hi·V + P_lo·V: P as one
//               e4m3 (3 mantissa bits) left ||o - ref|| / ||ref|| at 2.0-2.5e-2 on random
//               data (one key tile already), over the 2e-2 bar; with the residual 0.6-4e-3.
//   promotion   At D = 64 each key tile's P·V goes into a zeroed f32 accumulator added into O
//               (Cfg::kPromote): FP8 wgmma accumulates with limited precision, which shows
//               once P is split when V has a mean (V ~ N(1, 1), 1000 keys: 9.3e-3 -> 1.8e-3).
//               D = 128 has no registers for it at 192-key tiles (see DefaultCfg).
//   epilogue    O · v_scale / l, written as f16 or bf16.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

// clang-format off: cute/tensor.hpp first, the cute headers below assume its declarations
#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>
// clang-format on

#include "common/attributes.cuh"
#include "common/check.cuh"
#include "common/launch.cuh"
#include "cutlass/dtype.cuh"
#include "cutlass/sm90/primitives.cuh"

// The kernel bodies exist only in the sm_90a device pass; other passes (sm_80 in the default
// "80;90a" build) compile them empty, and the host side refuses to launch off sm_90.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SDPA_SM90_FP8_DEVICE 1
#endif

// Everything but the entry points lives in `fp8`, apart from the f16 kernel's namesakes.
namespace sdpa::cutlass_sm90::fp8 {

using namespace cute;
using E = cute::float_e4m3_t;

// The position of A column k' (0..31) of a 32-key step in real key order: thread lane
// 4r + c holds S columns 2c, 2c+1 (col group 0), 8+2c, 9+2c (group 1), 16+2c, ... (groups 2,
// 3) and the e4m3 A fragment wants columns 4c..4c+3 (register 0) and 16+4c..16+4c+3
// (register 2); calling S's groups 0-1 A's columns 4c..4c+3 and groups 2-3 A's 16+4c.. makes
// the thread's own values its own fragment. Vᵀ's key order follows (transpose_v).
__host__ __device__ constexpr int key_of(int kp) {
  const int h = kp >> 4, c = (kp >> 2) & 3, i = kp & 3;
  return 16 * h + 8 * (i >> 1) + 2 * c + (i & 1);
}

// Vᵀ rows are padded to whole 32-key blocks (the permutation stays inside a block), which also
// makes every row a multiple of 16 bytes, as TMA needs.
inline int64_t seq_k_pad(int64_t seq_k) { return (seq_k + 31) / 32 * 32; }

// Four f32 -> four e4m3 in one register (a in the low byte), round to nearest even, saturating.
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  uint32_t r;
  asm("{\n\t.reg .b16 lo, hi;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\t"
      "mov.b32 %0, {lo, hi};\n\t}"
      : "=r"(r)
      : "f"(a), "f"(b), "f"(c), "f"(d));
  return r;
}

// The widest GMMA swizzle whose row (128, 64 or 32 bytes) divides `bytes`.
template <int kBytes>
using KAtom = std::conditional_t<
    kBytes % 128 == 0, GMMA::Layout_K_SW128_Atom<E>,
    std::conditional_t<kBytes % 64 == 0, GMMA::Layout_K_SW64_Atom<E>, GMMA::Layout_K_SW32_Atom<E>>>;

// Tile configuration: output type, head dim, keys per tile, and whether the softmax keeps a
// stale row maximum while it is within kSlack of the true one (softmax_tile).
template <typename TO, int D, int BN_, bool kLazy_, bool kSplitP_ = true, bool kPromote_ = false>
struct Cfg {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static_assert(BN_ % 32 == 0, "key tiles of whole 32-key wgmma steps");
  using Out = TO;
  static constexpr int kD = D;
  // P = 2^kPLog2 · exp2(s - m) goes to e4m3: weights down to 2^-14 of the row's largest stay
  // e4m3 normals (2^-6). With a stale maximum m (kLazy) P reaches 2^(8 + kSlack) = 430 < 448.
  static constexpr bool kLazy = kLazy_;
  static constexpr int kPLog2 = 8;
  static constexpr float kSlack = kLazy ? 0.75f : 0.f;
  // P·V of each key tile goes into a zeroed f32 accumulator that is then added into O (O =
  // alpha·O + T): FP8 wgmma accumulates with limited precision, so O carried across all key
  // tiles inside the wgmma accumulator loses accuracy with seq_k.
  static constexpr bool kPromote = kPromote_;
  // P = P_hi + P_lo, both e4m3 (P_lo the e4m3 residual, via f16), and O += P_hi·V + P_lo·V: a
  // single e4m3 P (3 mantissa bits) leaves ~2% relative error in O on random data.
  static constexpr bool kSplitP = kSplitP_;
  static constexpr int kWG = 2;  // consumer warpgroups at most, each 64 query rows
  static constexpr int kThreads = 128 * (kWG + 1);
  static constexpr int kBM = 64 * kWG;
  static constexpr int kBN = BN_;
  // e4m3 tiles are half the f16 bytes: as many K/V stages (up to 4) as fit next to Q and the
  // O staging. D = 128, BN = 192: Q 16 + 3 x (K 24 + Vt 24) + O 32 = 192 KB; D = 64, BN = 128:
  // Q 8 + 4 x (K 8 + Vt 8) + O 16 = 88 KB.
  static constexpr int kStages =
      std::min(4, (226 * 1024 - kBM * D * (1 + int(sizeof(TO))) - 256) / (2 * kBN * D));
  using BM = Int<kBM>;
  using BN = Int<kBN>;
  using HD = Int<D>;
  using Stages = Int<kStages>;

  using MmaQK = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<E, E, float, Shape<_64, BN, HD>, GMMA::Major::K, GMMA::Major::K>(),
      Layout<Shape<Int<kWG>, _1, _1>>{}));
  using MmaPV = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<E, E, float, Shape<_64, HD, BN>, GMMA::Major::K, GMMA::Major::K>(),
      Layout<Shape<Int<kWG>, _1, _1>>{}));

  using LayoutQ = decltype(tile_to_shape(KAtom<D>{}, Shape<BM, HD>{}));
  using LayoutK = decltype(tile_to_shape(KAtom<D>{}, Shape<BN, HD, Stages>{}));
  using LayoutVt = decltype(tile_to_shape(KAtom<kBN>{}, Shape<HD, BN, Stages>{}));

  // P as the A operand of P·V: per 32-key step kb the fragment is ((4 cols, 2 rows, 2 col
  // halves)), 16 bytes = registers 4kb .. 4kb + 3 (convert_p fills them).
  using LayoutP =
      Layout<Shape<Shape<_4, _2, _2>, _1, Int<kBN / 32>>, Stride<Stride<_1, _4, _8>, _0, _16>>;

  // Q and K as TMA sees them: (seq, d, head, batch), d contiguous. Vᵀ: (d, key, batch·kv_head).
  using GShape = Shape<int, HD, int, int>;
  using GStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GTensor = decltype(make_tensor(make_gmem_ptr(static_cast<const E*>(nullptr)),
                                       std::declval<GShape>(), std::declval<GStride>()));
  using GTensorVt = decltype(make_tensor(make_gmem_ptr(static_cast<const E*>(nullptr)),
                                         std::declval<Shape<HD, int, int>>(),
                                         std::declval<Stride<int64_t, _1, int64_t>>()));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensor>(), LayoutQ{},
                                      Shape<BM, HD>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensor>(),
                                      take<0, 2>(LayoutK{}), Shape<BN, HD>{}, _1{}));
  using TmaVt = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorVt>(),
                                       take<0, 2>(LayoutVt{}), Shape<HD, BN>{}, _1{}));

  struct Smem {
    alignas(1024) E q[kBM * D];
    alignas(1024) E k[kStages * kBN * D];
    alignas(1024) E vt[kStages * kBN * D];
    alignas(1024) TO o[kBM * D];  // output staging, 64 rows per consumer warpgroup
    alignas(8) uint64_t bar_q;
    uint64_t empty_q;
    uint64_t full_k[kStages];
    uint64_t full_v[kStages];
    uint64_t empty_k[kStages];
    uint64_t empty_v[kStages];
  };
  // +1 KB: the kernel aligns the dynamic smem base up to 1024 bytes (swizzle atoms).
  static constexpr int kSmemBytes = int(sizeof(Smem)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory over the sm_90 per-CTA limit");
};

template <class C>
struct Params {
  typename C::TmaQ tma_q;
  typename C::TmaK tma_k;
  typename C::TmaVt tma_vt;
  typename C::Out* o;
  Strides os;
  const float *q_scale, *k_scale, *v_scale;
  int per_head;  // scales per (batch, head) pair, else one per tensor
  int seq_q, seq_k, seq_k_pad, heads, kv_heads, batch;
  float scale_log2;  // scale * log2(e), before the dequantization scales
  int wgs;           // consumer warpgroups in this launch (1 or 2); tiles of 64 * wgs rows
  int turns;         // 1: the two consumers take turns issuing their wgmmas (as the f16 kernel)
  int m_blocks;      // query tiles per (batch, head)
  int tiles;         // m_blocks * heads * batch
  int tail_bh;       // causal: the first (batch, head) pair of the interleaved tail group
  FastDiv div_m_blocks, div_heads, div_group, div_tail;
};

// ((2, 2, N/8), M, N) accumulator layout -> ((2 rows, M), (2 cols, N/8, N)) row/column view.
template <class L>
__device__ __forceinline__ constexpr auto rowcol(L const& l) {
  static_assert(decltype(rank(l))::value == 3);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// One tile of the online softmax in place on S (row/col view of the accumulator): mask, row
// maximum, S <- 2^kPLog2 · exp2(S·sl2 - m·sl2), row sums, and per row the factor alpha by which
// O and l must be rescaled (rescale_o applies it to O later, while S_n+1 runs). sl2 includes
// the dequantization scales; m_run is in raw score units. The running maximum m is only moved
// when the tile's maximum exceeds it by more than kSlack (log2 units): between moves alpha is
// exactly 1 and O needs no rescale. Reductions run as 4 independent chains per row: a single
// fmax/add chain over 32 columns was the longest dependency of the loop.
template <bool CAUSAL, int kPLog2, class TS, class TC>
__device__ __forceinline__ void softmax_tile(TS& S, TC const& cSrc, float* m_run, float* l_run,
                                             float* alpha, int m0, int n0, int bn, int seq_k,
                                             int off, float sl2, float slack) {
  constexpr int kRows = decltype(size<0>(S))::value;
  constexpr int kCols = decltype(size<1>(S))::value;
  static_assert(kCols % 4 == 0);
  const bool edge = n0 + bn > seq_k || (CAUSAL && n0 + bn - 1 > m0 + off);
  if (edge) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = m0 + get<0>(cSrc(r, 0));
      const int last = CAUSAL ? min(seq_k - 1, row + off) : seq_k - 1;  // last key it sees
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c)
        if (n0 + get<1>(cSrc(r, c)) > last) S(r, c) = -INFINITY;
    }
  }
  float mx[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float a[4] = {S(r, 0), S(r, 1), S(r, 2), S(r, 3)};
    CUTE_UNROLL
    for (int c = 4; c < kCols; ++c) a[c & 3] = fmaxf(a[c & 3], S(r, c));
    mx[r] = fmaxf(fmaxf(a[0], a[1]), fmaxf(a[2], a[3]));
  }
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    // A row with nothing visible yet keeps m = -inf (then base 0 keeps p = 0, not NaN); the
    // first visible tile always moves m (-inf - x > slack is false, hence the first test).
    const bool move =
        (m_run[r] == -INFINITY && mx[r] != -INFINITY) || (mx[r] - m_run[r]) * sl2 > slack;
    const float m_new = move ? mx[r] : m_run[r];
    // Exponents exact at any logit size, as in softmax_tile of sm90_fwd.cuh: one FMA with the
    // bias while |m·scale| < 2^15 (residuals <= 2^-8: P <= 257 < 448), else the rounded product
    // minus the base, so the max's exponent is exactly kPLog2. alpha: ratio of the two bases.
    const float base = scaled_base(m_new, sl2);
    alpha[r] = move ? ex2(__fmul_rn(m_run[r], sl2) - base) : 1.f;
    m_run[r] = m_new;
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
    const auto exps = [&](auto exponent) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const float e = ex2(exponent(S(r, c)));
        S(r, c) = e;
        sum[c & 3] += e;
      }
    };
    if (fabsf(base) < kFoldLimit) {
      const float bias = float(kPLog2) - base;
      exps([&](float x) { return fmaf(x, sl2, bias); });
    } else {
      exps([&](float x) { return (__fmul_rn(x, sl2) - base) + float(kPLog2); });
    }
    // This thread's partial sum; the quad adds at the end.
    l_run[r] = l_run[r] * alpha[r] + ((sum[0] + sum[1]) + (sum[2] + sum[3]));
  }
}

// O *= alpha per row, skipped when no row of the warp moved its max (alpha exactly 1).
template <class TO_, class TA>
__device__ __forceinline__ void rescale_o(TO_& O, const TA* alpha) {
  bool moved = false;
  CUTE_UNROLL
  for (int r = 0; r < decltype(size<0>(O))::value; ++r) moved |= alpha[r] != 1.f;
  if (!__any_sync(0xffffffffu, moved)) return;
  CUTE_UNROLL
  for (int r = 0; r < decltype(size<0>(O))::value; ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(O); ++c) O(r, c) *= alpha[r];
  }
}

// O = alpha·O + T per row (the promoted P·V of one key tile, T, into the f32 O).
template <class TO_, class TT>
__device__ __forceinline__ void add_tile(TO_& O, TT const& T, const float* alpha) {
  CUTE_UNROLL
  for (int r = 0; r < decltype(size<0>(O))::value; ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(O); ++c) O(r, c) = fmaf(O(r, c), alpha[r], T(r, c));
  }
}

// O *= v_scale / l; a row with no visible key has l = 0 and outputs zeros (l >= 2^kPLog2
// otherwise: the row max contributes 2^kPLog2).
template <class TO_>
__device__ __forceinline__ void normalize(TO_& O, const float* l_run, float v_scale) {
  CUTE_UNROLL
  for (int r = 0; r < decltype(size<0>(O))::value; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float f = l > 0.f ? __fdividef(v_scale, l) : 0.f;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(O); ++c) O(r, c) *= f;
  }
}

// S accumulator (f32, P after the softmax) -> e4m3 A fragment of P·V, per 32-key step kb:
// S values 16kb + {0,1,4,5} (row r, col groups 4kb, 4kb+1), {2,3,6,7} (row r+8), {8,9,12,13}
// (row r, groups 4kb+2, 4kb+3), {10,11,14,15} (row r+8) become registers 4kb .. 4kb+3; key_of
// is the matching order of Vᵀ's keys.
// Four f32 -> e4m3 hi (as e4m3x4) and the e4m3 of the residual lo = x - hi, computed in f16
// (x to f16 first: x - hi is then exact in f16 and hi + lo carries ~8 significant bits).
__device__ __forceinline__ void e4m3x4_split(float a, float b, float c, float d, uint32_t& hi,
                                             uint32_t& lo) {
  asm("{\n\t.reg .b32 p0, p1, d0, d1;\n\t.reg .b16 h0, h1, l0, l1;\n\t"
      "cvt.rn.f16x2.f32 p0, %3, %2;\n\t"
      "cvt.rn.f16x2.f32 p1, %5, %4;\n\t"
      "cvt.rn.satfinite.e4m3x2.f16x2 h0, p0;\n\t"
      "cvt.rn.satfinite.e4m3x2.f16x2 h1, p1;\n\t"
      "cvt.rn.f16x2.e4m3x2 d0, h0;\n\t"
      "cvt.rn.f16x2.e4m3x2 d1, h1;\n\t"
      "sub.rn.f16x2 d0, p0, d0;\n\t"
      "sub.rn.f16x2 d1, p1, d1;\n\t"
      "cvt.rn.satfinite.e4m3x2.f16x2 l0, d0;\n\t"
      "cvt.rn.satfinite.e4m3x2.f16x2 l1, d1;\n\t"
      "mov.b32 %0, {h0, h1};\n\t"
      "mov.b32 %1, {l0, l1};\n\t}"
      : "=r"(hi), "=r"(lo)
      : "f"(a), "f"(b), "f"(c), "f"(d));
}

// convert_p with P split into hi and lo fragments (same register order).
template <class TP, class TS>
__device__ __forceinline__ void convert_p_split(TP& rP, TP& rPlo, TS const& tSrS) {
  Tensor h32 = recast<uint32_t>(rP);
  Tensor l32 = recast<uint32_t>(rPlo);
  static_assert(decltype(size(h32))::value * 4 == decltype(size(tSrS))::value);
  CUTE_UNROLL
  for (int kb = 0; kb < size(h32) / 4; ++kb) {
    const int s = 16 * kb;
    e4m3x4_split(tSrS(s + 0), tSrS(s + 1), tSrS(s + 4), tSrS(s + 5), h32(4 * kb + 0),
                 l32(4 * kb + 0));
    e4m3x4_split(tSrS(s + 2), tSrS(s + 3), tSrS(s + 6), tSrS(s + 7), h32(4 * kb + 1),
                 l32(4 * kb + 1));
    e4m3x4_split(tSrS(s + 8), tSrS(s + 9), tSrS(s + 12), tSrS(s + 13), h32(4 * kb + 2),
                 l32(4 * kb + 2));
    e4m3x4_split(tSrS(s + 10), tSrS(s + 11), tSrS(s + 14), tSrS(s + 15), h32(4 * kb + 3),
                 l32(4 * kb + 3));
  }
}

template <class TP, class TS>
__device__ __forceinline__ void convert_p(TP& rP, TS const& tSrS) {
  Tensor r32 = recast<uint32_t>(rP);
  static_assert(decltype(size(r32))::value * 4 == decltype(size(tSrS))::value);
  CUTE_UNROLL
  for (int kb = 0; kb < size(r32) / 4; ++kb) {
    const int s = 16 * kb;
    r32(4 * kb + 0) = e4m3x4(tSrS(s + 0), tSrS(s + 1), tSrS(s + 4), tSrS(s + 5));
    r32(4 * kb + 1) = e4m3x4(tSrS(s + 2), tSrS(s + 3), tSrS(s + 6), tSrS(s + 7));
    r32(4 * kb + 2) = e4m3x4(tSrS(s + 8), tSrS(s + 9), tSrS(s + 12), tSrS(s + 13));
    r32(4 * kb + 3) = e4m3x4(tSrS(s + 10), tSrS(s + 11), tSrS(s + 14), tSrS(s + 15));
  }
}

template <class Smem>
__device__ __forceinline__ Smem& smem_storage() {
  extern __shared__ uint8_t smem_raw[];
  return *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                  ~uintptr_t(1023));
}

// Work tile t -> (query tile, head, batch): the f16 kernel's order (per-head, heaviest causal
// tile first, the tail heads interleaved where make_params says so).
template <bool CAUSAL, class P>
__device__ __forceinline__ void decode_tile(const P& p, int t, int& m_block, int& h, int& b) {
  const int nb = p.m_blocks;
  int bh;
  if (!CAUSAL) {
    bh = p.div_m_blocks.div(t);
    m_block = t - bh * nb;
  } else if (t < p.tail_bh * nb) {
    bh = p.div_m_blocks.div(t);
    m_block = nb - 1 - (t - bh * nb);
  } else {
    const int r = t - p.tail_bh * nb, q = p.div_tail.div(r);
    m_block = nb - 1 - q;
    bh = p.tail_bh + (r - q * p.div_tail.d);
  }
  b = p.div_heads.div(bh);
  h = bh - b * p.heads;
}

// Vᵀ[bk][d][kp] = V[b][hk][key_of(kp)][d], bk = b * kv_heads + hk, zero for keys >= seq_k, kp
// < seq_k_pad. One CTA per 64 keys of one (batch, kv head): V rows in through smem with
// 16-byte loads, Vᵀ rows out 16 bytes a thread (four threads cover 64 contiguous bytes).
template <int D>
__global__ void __launch_bounds__(256)
    transpose_v(const uint8_t* __restrict__ v, Strides vs, int seq_k, int seq_k_pad, int kv_heads,
                uint8_t* __restrict__ vt) {
  constexpr int kKeys = 64, kRow = D + 4;  // +4: the four 16-key groups fall on 2 bank halves
  __shared__ uint32_t tile[kKeys * kRow / 4];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The attention grid may start now: it waits (griddepcontrol.wait) before it reads Vᵀ.
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  const int bk = blockIdx.y, b = bk / kv_heads, hk = bk - b * kv_heads;
  const int k0 = blockIdx.x * kKeys;
  const uint8_t* vb = v + int64_t(b) * vs.batch + int64_t(hk) * vs.head;
  constexpr int kChunks = D / 16;  // 16-byte chunks per V row
  for (int i = threadIdx.x; i < kKeys * kChunks; i += 256) {
    const int r = i / kChunks, j = i % kChunks, key = k0 + r;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (key < seq_k) x = *reinterpret_cast<const uint4*>(vb + int64_t(key) * vs.seq + 16 * j);
    uint32_t* t = tile + (r * kRow + 16 * j) / 4;
    t[0] = x.x;
    t[1] = x.y;
    t[2] = x.z;
    t[3] = x.w;
  }
  __syncthreads();
  const uint8_t* tb = reinterpret_cast<const uint8_t*>(tile);
  uint8_t* out = vt + int64_t(bk) * D * seq_k_pad;
  for (int i = threadIdx.x; i < D * 4; i += 256) {
    const int d = i / 4, g = i % 4;  // 16-key group g of this CTA's 64
    if (k0 + 16 * g >= seq_k_pad) continue;
    uint32_t w[4];
    CUTE_UNROLL
    for (int q = 0; q < 4; ++q) {
      uint32_t x = 0;
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int key = 32 * (g / 2) + key_of(16 * (g % 2) + 4 * q + e);
        x |= uint32_t(tb[key * kRow + d]) << (8 * e);
      }
      w[q] = x;
    }
    *reinterpret_cast<uint4*>(out + int64_t(d) * seq_k_pad + k0 + 16 * g) =
        make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <class C, bool CAUSAL>
__global__ void __launch_bounds__(C::kThreads, 1) fwd_kernel(const __grid_constant__ Params<C> p) {
#ifdef SDPA_SM90_FP8_DEVICE
  using TO = typename C::Out;
  constexpr int D = C::kD;
  using Bar = cutlass::arch::ClusterTransactionBarrier;
  constexpr int BM = C::kBM, BN = C::kBN, S = C::kStages;
  constexpr int kTurn = 1;      // named barriers kTurn + w: consumer warpgroup w may issue
  constexpr int kEpilogue = 3;  // named barriers kEpilogue + w: warpgroup w's output staging
  auto& sm = smem_storage<typename C::Smem>();

  const int tid = threadIdx.x;
  const int consumers = 128 * p.wgs;
  const int bm = 64 * p.wgs;
  const int off = p.seq_k - p.seq_q;
  const auto key_tiles = [&](int m_block) {
    int n_end = p.seq_k;
    if (CAUSAL) n_end = min(p.seq_k, max(0, min(m_block * bm + bm, p.seq_q) + off));
    return (n_end + BN - 1) / BN;
  };

  if (tid == 0) {
    prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_vt.get_tma_descriptor());
    mbar_init(&sm.bar_q, 1);
    mbar_init(&sm.empty_q, consumers);
    for (int s = 0; s < S; ++s) {
      mbar_init(&sm.full_k[s], 1);
      mbar_init(&sm.full_v[s], 1);
      mbar_init(&sm.empty_k[s], consumers);
      mbar_init(&sm.empty_v[s], consumers);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(sm.q), typename C::LayoutQ{});     // (BM, D)
  Tensor sK = make_tensor(make_smem_ptr(sm.k), typename C::LayoutK{});     // (BN, D, stage)
  Tensor sVt = make_tensor(make_smem_ptr(sm.vt), typename C::LayoutVt{});  // (D, BN, stage)

  if (tid < 128) {
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (tid != 0) return;
    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.seq_q, Int<D>{}, p.heads, p.batch));
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seq_k, Int<D>{}, p.kv_heads, p.batch));
    Tensor mVt = p.tma_vt.get_tma_tensor(make_shape(Int<D>{}, p.seq_k_pad, p.kv_heads * p.batch));
    constexpr uint32_t kQBytes = BM * D;
    constexpr uint32_t kKVBytes = BN * D;
    int it = 0, qi = 0;
    for (int t = blockIdx.x; t < p.tiles; t += gridDim.x, ++qi) {
      int m_block, h, b;
      decode_tile<CAUSAL>(p, t, m_block, h, b);
      const int hk = p.div_group.div(h);
      const int n_tiles = key_tiles(m_block);
      Tensor gQ = local_tile(domain_offset(make_coord(m_block * bm, _0{}), mQ(_, _, h, b)),
                             Shape<Int<BM>, Int<D>>{}, make_coord(_0{}, _0{}));
      Tensor gK = local_tile(mK(_, _, hk, b), Shape<Int<BN>, Int<D>>{}, make_coord(_, _0{}));
      Tensor gVt =
          local_tile(mVt(_, _, b * p.kv_heads + hk), Shape<Int<D>, Int<BN>>{}, make_coord(_0{}, _));
      auto tQ = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                              group_modes<0, 2>(gQ));
      auto tK = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK),
                              group_modes<0, 2>(gK));
      auto tV = tma_partition(p.tma_vt, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sVt),
                              group_modes<0, 2>(gVt));
      const auto load_q = [&]() {
        if (qi > 0) Bar::wait(&sm.empty_q, (qi - 1) & 1);
        Bar::arrive_and_expect_tx(&sm.bar_q, kQBytes);
        copy(p.tma_q.with(sm.bar_q), get<0>(tQ), get<1>(tQ));
      };
      for (int n = 0; n < n_tiles; ++n, ++it) {
        const int s = it % S;
        const uint32_t phase = ((it / S) + 1) & 1;
        if (it >= S) Bar::wait(&sm.empty_k[s], phase);
        Bar::arrive_and_expect_tx(&sm.full_k[s], kKVBytes);
        copy(p.tma_k.with(sm.full_k[s]), get<0>(tK)(_, n), get<1>(tK)(_, s));
        if (n == 0) load_q();
        // Vᵀ comes from transpose_v, which this grid may overlap (programmatic launch): wait
        // for it before the first Vᵀ load only (a no-op when launched the ordinary way).
        if (it == 0) asm volatile("griddepcontrol.wait;" ::: "memory");
        if (it >= S) Bar::wait(&sm.empty_v[s], phase);
        Bar::arrive_and_expect_tx(&sm.full_v[s], kKVBytes);
        copy(p.tma_vt.with(sm.full_v[s]), get<0>(tV)(_, n), get<1>(tV)(_, s));
      }
      if (n_tiles == 0) load_q();
    }
    return;
  }

  // Consumer warpgroups.
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int ctid = tid - 128;
  const int wg = ctid / 128;
  const bool turns = p.turns;
  const auto turn_sync = [&](int w) {
    if (turns) named_sync(kTurn + w, 256);
  };
  const auto turn_arrive = [&](int w) {
    if (turns) named_arrive(kTurn + w, 256);
  };

  typename C::MmaQK mma_qk;
  typename C::MmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(ctid);
  auto thr_pv = mma_pv.get_thread_slice(ctid);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);
  Tensor tSrK = thr_qk.partition_fragment_B(sK);
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<BM>, Int<D>>{});
  Tensor tOrT = partition_fragment_C(mma_pv, Shape<Int<BM>, Int<D>>{});  // kPromote: P·V of a tile
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<BM>, Int<BN>>{});
  Tensor rP = make_tensor<E>(typename C::LayoutP{});
  Tensor rPlo = make_tensor<E>(typename C::LayoutP{});  // kSplitP: P's residual

  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));
  Tensor cSrc = make_tensor(cS.data(), rowcol(cS.layout()));
  Tensor O = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
  Tensor Srow = make_tensor(tSrS.data(), rowcol(tSrS.layout()));
  Tensor Trow = make_tensor(tOrT.data(), rowcol(tOrT.layout()));
  constexpr int kRows = decltype(size<0>(O))::value;
  static_assert(kRows == 2);

  const auto issue_s = [&](int sk) {
    mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tSrQ); ++kb) {
      cute::gemm(mma_qk, tSrQ(_, _, kb), tSrK(_, _, kb, sk), tSrS);
      mma_qk.accumulate_ = GMMA::ScaleOut::One;
    }
  };
  // O += P·V (kPromote: T = P·V, each 32-key step after the first accumulating onto it).
  const auto issue_pv = [&](int sv) {
    if constexpr (C::kPromote) {
      mma_pv.accumulate_ = GMMA::ScaleOut::Zero;
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(rP); ++kb) {
        cute::gemm(mma_pv, rP(_, _, kb), tOrV(_, _, kb, sv), tOrT);
        mma_pv.accumulate_ = GMMA::ScaleOut::One;
      }
      if constexpr (C::kSplitP) cute::gemm(mma_pv, rPlo, tOrV(_, _, _, sv), tOrT);
    } else {
      cute::gemm(mma_pv, rP, tOrV(_, _, _, sv), tOrO);
      if constexpr (C::kSplitP) cute::gemm(mma_pv, rPlo, tOrV(_, _, _, sv), tOrO);
    }
  };
  const auto to_p = [&]() {
    if constexpr (C::kSplitP)
      convert_p_split(rP, rPlo, tSrS);
    else
      convert_p(rP, tSrS);
  };
  const auto fence_all = [&]() {
    warpgroup_fence_operand(tSrS);
    warpgroup_fence_operand(tOrO);
    if constexpr (C::kPromote) warpgroup_fence_operand(tOrT);
    warpgroup_fence_operand(rP);
    if constexpr (C::kSplitP) warpgroup_fence_operand(rPlo);
  };

  int it = 0, qi = 0;
  for (int t = blockIdx.x; t < p.tiles; t += gridDim.x, ++qi) {
    int m_block, h, b;
    decode_tile<CAUSAL>(p, t, m_block, h, b);
    const int m0 = m_block * bm;
    const int n_tiles = key_tiles(m_block);
    // Dequantization scales: q·k into the softmax scale, v into the epilogue.
    const int hk = p.div_group.div(h);
    const int qsi = p.per_head ? b * p.heads + h : 0;
    const int kvi = p.per_head ? b * p.kv_heads + hk : 0;
    const float sl2 = p.scale_log2 * __ldg(p.q_scale + qsi) * __ldg(p.k_scale + kvi);
    const float v_scale = __ldg(p.v_scale + kvi);

    clear(tOrO);
    float m_run[kRows], l_run[kRows], alpha[kRows], alpha_pv[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      m_run[r] = -INFINITY;
      l_run[r] = 0.f;
    }

    // Issue rounds as in the f16 kernel: S_0; then per n: S_n and O += P_{n-1}·V_{n-1} (two
    // commit groups, the softmax of S_n overlapping P_{n-1}·V_{n-1}); last: O += P·V.
    if (n_tiles > 0) {
      if (wg == 1) turn_arrive(0);
      Bar::wait(&sm.bar_q, qi & 1);

      {
        const int sk = it % S;
        Bar::wait(&sm.full_k[sk], (it / S) & 1);
        turn_sync(wg);
        fence_all();
        warpgroup_arrive();
        issue_s(sk);
        warpgroup_commit_batch();
        turn_arrive(wg ^ 1);
        warpgroup_wait<0>();
        fence_all();
        Bar::arrive(&sm.empty_k[sk]);
        if (n_tiles == 1) Bar::arrive(&sm.empty_q);
        softmax_tile<CAUSAL, C::kPLog2>(Srow, cSrc, m_run, l_run, alpha, m0, 0, BN, p.seq_k, off,
                                        sl2, C::kSlack);
        to_p();
      }

      for (int n = 1; n < n_tiles; ++n) {
        const int uk = it + n, uv = it + n - 1;
        const int sk = uk % S, sv = uv % S;
        Bar::wait(&sm.full_k[sk], (uk / S) & 1);
        Bar::wait(&sm.full_v[sv], (uv / S) & 1);
        turn_sync(wg);
        fence_all();
        warpgroup_arrive();
        issue_s(sk);
        warpgroup_commit_batch();
        if constexpr (C::kPromote) {
          // alpha of tile n - 1 rescales O when T = P_{n-1}·V_{n-1} is added (softmax of
          // tile n overwrites alpha meanwhile).
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) alpha_pv[r] = alpha[r];
        } else {
          if (n > 1) rescale_o(O, alpha);
          warpgroup_fence_operand(tOrO);
        }
        warpgroup_arrive();
        issue_pv(sv);
        warpgroup_commit_batch();
        turn_arrive(wg ^ 1);
        warpgroup_wait<1>();
        warpgroup_fence_operand(tSrS);
        Bar::arrive(&sm.empty_k[sk]);
        if (n == n_tiles - 1) Bar::arrive(&sm.empty_q);
        softmax_tile<CAUSAL, C::kPLog2>(Srow, cSrc, m_run, l_run, alpha, m0, n * BN, BN, p.seq_k,
                                        off, sl2, C::kSlack);
        warpgroup_wait<0>();
        fence_all();
        Bar::arrive(&sm.empty_v[sv]);
        if constexpr (C::kPromote) add_tile(O, Trow, alpha_pv);
        to_p();
      }

      {
        const int uv = it + n_tiles - 1, sv = uv % S;
        Bar::wait(&sm.full_v[sv], (uv / S) & 1);
        turn_sync(wg);
        if (!C::kPromote && n_tiles > 1) rescale_o(O, alpha);
        fence_all();
        warpgroup_arrive();
        issue_pv(sv);
        warpgroup_commit_batch();
        if (wg == 0) turn_arrive(1);
        warpgroup_wait<0>();
        fence_all();
        Bar::arrive(&sm.empty_v[sv]);
        if constexpr (C::kPromote) add_tile(O, Trow, alpha);
      }
      it += n_tiles;
    } else {
      Bar::wait(&sm.bar_q, qi & 1);
      Bar::arrive(&sm.empty_q);
    }

    normalize(O, l_run, v_scale);

    // Output through this warpgroup's 64-row staging area, 16-byte chunk j of row r at chunk
    // j ^ (r % 8) (as the f16 kernel: conflict-free both ways).
    int etid = ctid;
    asm volatile("" : "+r"(etid));
    const uint32_t so =
        uint32_t(__cvta_generic_to_shared(sm.o)) + uint32_t(wg * 64 * D * sizeof(TO));
    if (qi > 0) named_sync(kEpilogue + wg, 128);
    {
      Tensor cO =
          mma_pv.get_thread_slice(etid).partition_C(make_identity_tensor(Shape<Int<BM>, Int<D>>{}));
      CUTE_UNROLL
      for (int i = 0; i < size(tOrO); i += 2) {
        const int r = get<0>(cO(i)) - 64 * wg, c = get<1>(cO(i));
        const int phys = r * D + (((c >> 3) ^ (r & 7)) << 3) + (c & 7);
        st_shared(so + phys * sizeof(TO), pack2<TO>(tOrO(i), tOrO(i + 1)));
      }
    }
    named_sync(kEpilogue + wg, 128);
    TO* ob = p.o + int64_t(b) * p.os.batch + int64_t(h) * p.os.head;
    constexpr int CH = D / 8;
    const int wtid = etid % 128;
    CUTE_UNROLL
    for (int i = 0; i < 64 * CH / 128; ++i) {
      const int ci = wtid + i * 128, r = ci / CH, j = ci % CH;
      const int row = m0 + 64 * wg + r;
      if (row < p.seq_q)
        *reinterpret_cast<uint4*>(ob + int64_t(row) * p.os.seq + j * 8) =
            ld_shared_128(so + (r * D + ((j ^ (r & 7)) << 3)) * sizeof(TO));
    }
  }
#endif
}

// Host side ----------------------------------------------------------------------------------

// 16-byte aligned base and strides that are 16-byte multiples below 2^40 bytes (TMA; the
// transpose's and the epilogue's 16-byte accesses): the Rust layer guarantees them, this turns
// a broken promise into an error instead of a fault.
inline void check_operand(const void* ptr, const Strides& s, int elem_bytes, const char* what) {
  const auto ok = [&](int64_t st) {
    return st >= 0 && (st * elem_bytes) % 16 == 0 && st * elem_bytes < (int64_t(1) << 40);
  };
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0 || !ok(s.batch) || !ok(s.head) || !ok(s.seq))
    throw Error(std::string("cutlass-sm90 e4m3: ") + what +
                " is not 16-byte addressable (16-byte aligned base and strides required)");
}

inline int device_info(int& sms) {
  int dev = 0, major = 0;
  SDPA_CUDA_CHECK(cudaGetDevice(&dev));
  SDPA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  SDPA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return major;
}

// Launch choices a tuning harness may override; -1 keeps the measured default.
struct Tuning {
  int turns = -1;
  int wgs = -1;
  int pdl = -1;  // programmatic launch of the attention grid behind transpose_v
};

template <class C>
Params<C> make_params(const FwdArgs& a, int sms, bool causal, const Tuning& tune) {
  using TO = typename C::Out;
  constexpr int D = C::kD;
  const auto gmem = [&](const void* ptr, int64_t seq, int64_t heads, const Strides& st) {
    return make_tensor(make_gmem_ptr(static_cast<const E*>(ptr)),
                       make_shape(int(seq), Int<D>{}, int(heads), int(a.batch)),
                       make_stride(st.seq, _1{}, st.head, st.batch));
  };
  const int64_t pad = seq_k_pad(a.seq_k);
  Params<C> p{};
  p.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gmem(a.q, a.seq_q, a.heads, a.q_stride),
                          typename C::LayoutQ{}, Shape<Int<C::kBM>, Int<D>>{}, _1{});
  p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gmem(a.k, a.seq_k, a.kv_heads, a.k_stride),
                          take<0, 2>(typename C::LayoutK{}), Shape<Int<C::kBN>, Int<D>>{}, _1{});
  const auto vt = make_tensor(make_gmem_ptr(static_cast<const E*>(a.workspace)),
                              make_shape(Int<D>{}, int(pad), int(a.batch * a.kv_heads)),
                              make_stride(pad, _1{}, int64_t(D) * pad));
  p.tma_vt = make_tma_copy(SM90_TMA_LOAD{}, vt, take<0, 2>(typename C::LayoutVt{}),
                           Shape<Int<D>, Int<C::kBN>>{}, _1{});
  p.o = static_cast<TO*>(a.o);
  p.os = a.o_stride;
  p.q_scale = a.q_scale;
  p.k_scale = a.k_scale;
  p.v_scale = a.v_scale;
  p.per_head = a.per_head_scales ? 1 : 0;
  p.seq_q = int(a.seq_q);
  p.seq_k = int(a.seq_k);
  p.seq_k_pad = int(pad);
  p.heads = int(a.heads);
  p.kv_heads = int(a.kv_heads);
  p.batch = int(a.batch);
  p.scale_log2 = a.scale * 1.4426950408889634f;
  const int bh = int(a.heads * a.batch);
  // 64-row tiles when 128-row tiles would leave more than half the SMs idle (the f16 kernel's
  // rule, measured there on the mission problem).
  const int tiles128 = int((a.seq_q + C::kBM - 1) / C::kBM) * bh;
  p.wgs = tune.wgs > 0 ? tune.wgs : (2 * tiles128 <= sms ? 1 : 2);
  p.m_blocks = int((a.seq_q + 64 * p.wgs - 1) / (64 * p.wgs));
  p.tiles = p.m_blocks * bh;
  // Turns as in the f16 kernel (only at D = 64); at D = 128 they measured the same here
  // (s8k 664 vs 669 us, s16k-causal 1330 vs 1327 us with and without).
  p.turns =
      tune.turns >= 0 ? tune.turns : (D == 64 && p.wgs == 2 && (causal || p.tiles <= sms) ? 1 : 0);
  if (p.wgs == 1) p.turns = 0;
  int tail = 0;
  if (causal) {
    const double nb = p.m_blocks, per_sm = bh * nb * nb / (2.0 * sms);
    if (nb - nb * nb / (2.0 * sms) > 0.12 * per_sm)
      tail = std::min(bh, std::max(1, (4 * sms + p.m_blocks - 1) / p.m_blocks));
  }
  p.tail_bh = bh - tail;
  p.div_m_blocks = FastDiv(p.m_blocks);
  p.div_heads = FastDiv(p.heads);
  p.div_group = FastDiv(int(a.heads / a.kv_heads));
  p.div_tail = FastDiv(std::max(1, tail));
  return p;
}

inline int64_t workspace_bytes(const FwdArgs& a) {
  return a.batch * a.kv_heads * a.head_dim * seq_k_pad(a.seq_k);
}

template <int D>
void launch_transpose(const FwdArgs& a, cudaStream_t stream) {
  const int64_t pad = seq_k_pad(a.seq_k);
  const dim3 grid(unsigned((pad + 63) / 64), unsigned(a.batch * a.kv_heads));
  transpose_v<D><<<grid, 256, 0, stream>>>(static_cast<const uint8_t*>(a.v), a.v_stride,
                                           int(a.seq_k), int(pad), int(a.kv_heads),
                                           static_cast<uint8_t*>(a.workspace));
  SDPA_LAUNCH_CHECK("cutlass-sm90 e4m3 transpose_v launch");
}

template <class C, bool CAUSAL>
void launch_attention(const FwdArgs& a, cudaStream_t stream, const Tuning& tune) {
  static std::atomic<uint64_t> configured{0};
  const auto kernel = fwd_kernel<C, CAUSAL>;
  opt_in_smem(reinterpret_cast<const void*>(kernel), C::kSmemBytes, configured);
  int sms = 0;
  if (device_info(sms) != 9) throw Error("cutlass-sm90 e4m3: needs an sm_90 (Hopper) GPU");
  const Params<C> p = make_params<C>(a, sms, CAUSAL, tune);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(CAUSAL ? p.tiles : std::min(p.tiles, sms)));
  cfg.blockDim = dim3(unsigned(128 * (p.wgs + 1)));
  cfg.dynamicSmemBytes = C::kSmemBytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  // Programmatic launch: the grid starts (Q, K loads, first Q·Kᵀ) while transpose_v is still
  // running and waits only before its first Vᵀ load. Measured: mission 5.67 -> 4.98 us; no
  // change on the large problems.
  cfg.numAttrs = tune.pdl == 0 ? 0 : 1;
  SDPA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

template <class C>
void forward_cfg(const FwdArgs& a, cudaStream_t stream, const Tuning& tune) {
  constexpr int D = C::kD;
  check_operand(a.q, a.q_stride, 1, "q");
  check_operand(a.k, a.k_stride, 1, "k");
  check_operand(a.v, a.v_stride, 1, "v");
  check_operand(a.o, a.o_stride, 2, "o");
  if (a.workspace == nullptr || reinterpret_cast<uintptr_t>(a.workspace) % 16 != 0)
    throw Error("cutlass-sm90 e4m3: needs a 16-byte aligned workspace of workspace_bytes()");
  if (!a.q_scale || !a.k_scale || !a.v_scale)
    throw Error("cutlass-sm90 e4m3: q, k and v scales are required");
  launch_transpose<D>(a, stream);
  if (a.causal)
    launch_attention<C, true>(a, stream, tune);
  else
    launch_attention<C, false>(a, stream, tune);
}

// The configuration each (output type, head dim) ships with. Measured on an H200 (graph replay,
// .scratch-fp8 harness; exact running max), all with P split: D = 128, 192-key tiles: s8k 837
// us, s16k-causal 1649, s2k 234; with promotion and 128-key tiles (spills 60 B) 922, 1830, 248.
// D = 64, 128-key tiles with promotion: mission 5.65 us, s1k-d64 46.7; without promotion 5.67,
// 49.8; 256-key tiles without promotion (spills 96 B) 5.86, 59.3. The unsplit kernel ran s8k
// 641, s16k-causal 1290, s2k 188, mission 4.96, s1k-d64 40.5 at 2.0-2.7e-2 error.
// Promotion at D = 128 too: without it, V with a non-zero mean over 3072 keys measured 3.65e-2
// (tests/fp8.rs, e4m3_native_long_rows_with_biased_v), growing with the key count.
template <typename TO, int D>
using DefaultCfg = Cfg<TO, D, 128, false, true, true>;

template <typename TO, int D>
void forward(const FwdArgs& a, cudaStream_t stream, const Tuning& tune = {}) {
  forward_cfg<DefaultCfg<TO, D>>(a, stream, tune);
}

template <int D>
void forward_any(const FwdArgs& a, cudaStream_t stream) {
  if (a.out_dtype == Dtype::F16) return forward<cute::half_t, D>(a, stream);
  if (a.out_dtype == Dtype::BF16) return forward<cute::bfloat16_t, D>(a, stream);
  throw Error("cutlass-sm90 e4m3: out_dtype must be f16 or bf16");
}

template <int D>
void attributes(std::vector<KernelAttr>& out) {
  using F = DefaultCfg<cute::half_t, D>;
  using B = DefaultCfg<cute::bfloat16_t, D>;
  const void* f16[2] = {reinterpret_cast<const void*>(fwd_kernel<F, false>),
                        reinterpret_cast<const void*>(fwd_kernel<F, true>)};
  const void* bf16[2] = {reinterpret_cast<const void*>(fwd_kernel<B, false>),
                         reinterpret_cast<const void*>(fwd_kernel<B, true>)};
  push_attributes(out, "cutlass-sm90", "e4m3_f16", D, f16, F::kSmemBytes);
  push_attributes(out, "cutlass-sm90", "e4m3_bf16", D, bf16, B::kSmemBytes);
}

}  // namespace sdpa::cutlass_sm90::fp8
