// CUTLASS/CuTe backend for sm_90a (Hopper): FlashAttention-2 style forward on wgmma, with Q, K
// and V brought into swizzled shared memory by TMA; a TMA producer warpgroup and one or two
// consumer warpgroups of 64 query rows on a ring of K/V stages; e4m3 inputs on the same kernel
// (S on e4m3 wgmma, P·V on f16). docs/design.md describes the tiles, roles, register split,
// overlap and scheduling. Assumes validated arguments (crates/sdpa/src/problem.rs and
// backend/fused.rs): head_dim == D, 16-byte aligned rows, strides in elements,
// heads % kv_heads == 0, seq_q, seq_k >= 1, sizes within the 32-bit limits fused.rs checks.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>
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
#include "common/nonfinite.cuh"
#include "cutlass/dtype.cuh"
#include "cutlass/sm90/primitives.cuh"

// The kernel bodies exist only in the sm_90a device pass; other passes (sm_80 in the default
// "80;90a" build) compile them empty, and the host side refuses to launch off sm_90.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SDPA_SM90_DEVICE 1
#endif

namespace sdpa::cutlass_sm90 {

using namespace cute;

// Element types of one instantiation: QK for Q and K (the operands of S = Q·Kᵀ), PV for V and
// P in shared memory and registers (the operands of O = P·V), Out for O. The 16-bit kernels
// use one type throughout (Same<T>).
template <typename QK_, typename PV_, typename Out_, bool kConvertV_ = false>
struct Elems {
  using QK = QK_;
  using PV = PV_;
  using Out = Out_;
  // E4M3: dequantization scales, and V converted to PV either by a pre-pass the attention grid
  // overlaps (kPrepass: programmatic launch, the grid waits before its first V load instead of
  // at the start), or in shared memory by the producer warpgroup's spare warps (kConvertV).
  static constexpr bool kFp8 = std::is_same_v<QK, cute::float_e4m3_t>;
  static constexpr bool kConvertV = kFp8 && kConvertV_;
  static constexpr bool kPrepass = kFp8 && !kConvertV_;
  static_assert(sizeof(PV) == 2 && sizeof(Out) == 2, "P·V and O in a 16-bit type");
};
template <typename T>
using Same = Elems<T, T, T>;

// E4M3 Q, K, V, O in Out. P·V in f16 for either output type (P rounded to f16 keeps 3 more bits
// than bf16; V's codes are exact in both). V converted in shared memory at D = 64, by the pre-pass
// at D = 128: each is the faster one where it is used (docs/log/); the converting warps take issue
// slots and shared-memory bandwidth from the consumers, which D = 128 keeps busier.
template <typename Out, int D>
using E4m3 = Elems<cute::float_e4m3_t, cute::half_t, Out, D == 64>;

// The widest GMMA K-major swizzle atom whose row (128, 64 or 32 bytes) divides a row of D
// elements of T: 128 bytes for the 16-bit types and e4m3 at D = 128, 64 bytes for e4m3 at
// D = 64.
template <typename T, int D>
using KAtom =
    std::conditional_t<D * sizeof(T) % 128 == 0, GMMA::Layout_K_SW128_Atom<T>,
                       std::conditional_t<D * sizeof(T) % 64 == 0, GMMA::Layout_K_SW64_Atom<T>,
                                          GMMA::Layout_K_SW32_Atom<T>>>;

// Global tensors as TMA sees them: (seq, d, head, batch), d contiguous.
template <typename T, int D>
using GTensorOf = decltype(make_tensor(make_gmem_ptr(static_cast<const T*>(nullptr)),
                                       std::declval<Shape<int, Int<D>, int, int>>(),
                                       std::declval<Stride<int64_t, _1, int64_t, int64_t>>()));

// Tile configuration.
template <class E, int D>
struct Cfg {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  using QK = typename E::QK;
  using PV = typename E::PV;
  using Out = typename E::Out;
  static constexpr int kWG = 2;  // consumer warpgroups at most, each 64 query rows
  static constexpr int kThreads = 128 * (kWG + 1);  // + the producer warpgroup
  static constexpr int kBM = 64 * kWG;
  static constexpr int kBN = 128;
  // D = 128: Q 32 + O 32 + 2 x (K 32 + V 32) = 192 KB; a third stage would not fit (and a third
  // stage with O written straight from registers measured no faster: K/V latency is hidden).
  // E4M3 at D = 128: Q 16 + O 32 + 3 x (K 16 + V 32) = 192 KB.
  static constexpr int kStages = D == 64 || E::kFp8 ? 3 : 2;
  // kConvertV: e4m3 V tiles land by TMA in a ring of their own, unswizzled rows of D bytes, for
  // the converting warps to read. D = 64: 96 KB above + 2 x 8 KB (D = 128 would fit too: 224).
  static constexpr int kV8Stages = 2;
  static constexpr int kConverters = 96;  // producer warps 1-3 (warp 0 issues the TMA loads)
  // Registers of a producer thread: 24, what the consumers' 240 leave of the 168 x 384 the
  // CTA launches with (2 x 128 x (240 - 168) = 128 x (168 - 24)); more makes the consumers'
  // setmaxnreg wait forever. The converting warps fit in them too.
  static constexpr int kProducerRegs = 24;
  // Whether the two consumers may take turns issuing (Params::turns decides per launch).
  // At D = 128 the turns cost more than the ordering gains everywhere that
  // matters (slower on s2k, s8k and s16k-causal, faster only on s4k-causal), so they are compiled
  // out; at D = 64 they cost a little in the persistent grid (s1k) but save a good part of the time
  // when every CTA runs one tile (mission problem with 128-row tiles).
  static constexpr bool kPingPong = D == 64;
  using BM = Int<kBM>;
  using BN = Int<kBN>;
  using HD = Int<D>;
  using Stages = Int<kStages>;

  // The warpgroups tile M: warpgroup w owns rows [64w, 64w + 64) of S and O.
  using MmaQK =
      decltype(make_tiled_mma(SM90::GMMA::ss_op_selector<QK, QK, float, Shape<_64, BN, HD>,
                                                         GMMA::Major::K, GMMA::Major::K>(),
                              Layout<Shape<Int<kWG>, _1, _1>>{}));
  using MmaPV =
      decltype(make_tiled_mma(SM90::GMMA::rs_op_selector<PV, PV, float, Shape<_64, HD, BN>,
                                                         GMMA::Major::K, GMMA::Major::MN>(),
                              Layout<Shape<Int<kWG>, _1, _1>>{}));

  // Shared memory layouts: Q and K rows of D elements in swizzle atoms of 8 rows (KAtom). V
  // rows of 64 16-bit elements (128 bytes) with the 128-byte swizzle, stacked 8 rows to an atom;
  // Vt is the same bytes seen as [d][key] for the MN-major B operand of P·V.
  using LayoutQ = decltype(tile_to_shape(KAtom<QK, D>{}, Shape<BM, HD>{}));
  using LayoutK = decltype(tile_to_shape(KAtom<QK, D>{}, Shape<BN, HD, Stages>{}));
  using LayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<PV>{}, Shape<HD, BN, Stages>{},
                                          Step<_2, _1, _3>{}));
  using LayoutV = decltype(composition(
      LayoutVt{}, make_layout(Shape<BN, HD, Stages>{}, Stride<HD, _1, Int<D * kBN>>{})));

  // P as the A operand of P·V, over the registers of the S accumulator. S per thread is
  // ((2 cols, 2 rows, BN/8 col groups), 1, 1), compact, whatever QK is; the A fragment of one
  // 16-key step is ((2 cols, 2 rows, 2 col groups)), so key step kb takes col groups 2kb and
  // 2kb + 1.
  using LayoutP =
      Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBN / 16>>, Stride<Stride<_1, _2, _4>, _0, _8>>;

  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorOf<QK, D>>(), LayoutQ{},
                                      Shape<BM, HD>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorOf<QK, D>>(),
                                      take<0, 2>(LayoutK{}), Shape<BN, HD>{}, _1{}));
  using LayoutV8 =
      Layout<Shape<BN, HD, Int<kV8Stages>>, Stride<HD, _1, Int<kBN * D>>>;  // kConvertV's ring
  using TmaV =
      std::conditional_t<E::kConvertV,
                         decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorOf<QK, D>>(),
                                                take<0, 2>(LayoutV8{}), Shape<BN, HD>{}, _1{})),
                         decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorOf<PV, D>>(),
                                                take<0, 2>(LayoutV{}), Shape<BN, HD>{}, _1{}))>;

  // kConvertV's e4m3 V ring, a base of Smem (empty, so of no size, in the other kernels).
  struct V8Ring {
    alignas(1024) QK v8[kV8Stages * kBN * D];
  };
  struct NoRing {};
  struct Smem : std::conditional_t<E::kConvertV, V8Ring, NoRing> {
    alignas(1024) QK q[kBM * D];
    alignas(1024) QK k[kStages * kBN * D];
    alignas(1024) PV v[kStages * kBN * D];
    alignas(1024) Out o[kBM * D];  // output staging, 64 rows per consumer warpgroup
    alignas(8) uint64_t bar_q;
    uint64_t empty_q;
    uint64_t full_k[kStages];
    uint64_t full_v[kStages];
    uint64_t empty_k[kStages];
    uint64_t empty_v[kStages];
    uint64_t full_v8[kV8Stages];  // kConvertV only (within the struct's alignment padding)
    uint64_t empty_v8[kV8Stages];
    // Non-finite V check, causal kernels: V tiles crossing the diagonal land on full_vd instead of
    // full_v, are checked for non-finite values by the producer's spare warps, which then arrive on
    // checked_v, and the consumers wait for that (kConvertV: the converting warps check, full_v as
    // for every tile). Causal CTAs run one query tile and walk its keys diagonal first (key_tile in
    // the kernel): these are ring uses 0 and 1, phase 0 of both barriers of stages 0 and 1, and
    // full_v's phases on those stages run one behind. nf_any: whether the stage's tile had any
    // non-finite value, nf what it had.
    uint64_t full_vd[kStages];
    uint64_t checked_v[kStages];
    uint32_t nf_any[kStages];
    NonFiniteCols<D> nf[kStages];
  };
  // +1 KB: the kernel aligns the dynamic smem base up to 1024 bytes (128-byte swizzle atoms).
  static constexpr int kSmemBytes = int(sizeof(Smem)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory over the sm_90 per-CTA limit");
};

template <class E, int D>
struct Params {
  typename Cfg<E, D>::TmaQ tma_q;
  typename Cfg<E, D>::TmaK tma_k;
  typename Cfg<E, D>::TmaV tma_v;
  typename E::Out* o;
  Strides os;
  // 32-bit sizes, rows, keys and tile numbers (offsets are 64-bit): the Rust layer keeps
  // seq_q, seq_k <= 2^31 - 128 (row and key indices reach a tile past the end), causal
  // seq_q + seq_k <= 2^31 - 1 (the producer's diagonal), and ceil(seq_q / 128) x batch x heads
  // <= 2^30 (tiles, and t + gridDim.x in the tile loops); fused::supports,
  // crates/sdpa/src/backend/fused.rs.
  int seq_q, seq_k, heads, kv_heads, batch;
  float scale_log2;  // scale * log2(e)
  int wgs;           // consumer warpgroups in this launch (1 or 2); tiles of 64 * wgs rows
  int turns;         // 1: the two consumers take turns issuing (see Cfg::kPingPong)
  int m_blocks;      // query tiles per (batch, head)
  int tiles;         // m_blocks * heads * batch
  int tail_bh;       // causal: the first (batch, head) pair of the interleaved tail group
  FastDiv div_m_blocks, div_heads, div_group, div_tail;  // div_tail: by bh - tail_bh
  // E4M3 only: dequantization scales, one per tensor or one per (batch, head) (per_head).
  const float *q_scale, *k_scale, *v_scale;
  int per_head;
};

// ((2, 2, N/8), M, N) accumulator layout -> ((2 rows, M), (2 cols, N/8, N)) row/column view.
template <class L>
__device__ __forceinline__ constexpr auto rowcol(L const& l) {
  static_assert(decltype(rank(l))::value == 3);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// One tile of the online softmax, in place on S (row/col view of the accumulator): mask, new
// running max, S <- exp2(S·scale_log2 - max·scale_log2), row sums, and per row the factor
// alpha by which O must be rescaled (rescale_o; kept apart: O is still being accumulated by
// P_{n-1}·V_{n-1}, and gets the factor just before P_n·V_n is issued). cSrc gives each S
// element's (row, col) within the CTA tile. m_run is in raw score units.
// Scores of keys >= seq_k and, if causal, of keys past each row's bottom-right diagonal set
// to -inf, for the bn keys from n0 of rows from m0 (S in the row/col view, cSrc as below).
// Only the last key tile and causal tiles crossing the rows' diagonal need it.
template <bool CAUSAL, class TS, class TC>
__device__ __forceinline__ void mask_keys(TS& S, TC const& cSrc, int m0, int n0, int bn, int seq_k,
                                          int off) {
  if (!(n0 + bn > seq_k || (CAUSAL && n0 + bn - 1 > m0 + off))) return;
  CUTE_UNROLL
  for (int r = 0; r < decltype(size<0>(S))::value; ++r) {
    const int row = m0 + get<0>(cSrc(r, 0));
    const int last = CAUSAL ? min(seq_k - 1, row + off) : seq_k - 1;  // last key it sees
    CUTE_UNROLL
    for (int c = 0; c < size<1>(S); ++c)
      if (n0 + get<1>(cSrc(r, c)) > last) S(r, c) = -INFINITY;
  }
}

template <bool CAUSAL, bool kOneLoop, class TS, class TC>
__device__ __forceinline__ void softmax_tile(TS& S, TC const& cSrc, float* m_run, float* l_run,
                                             float* alpha, int m0, int n0, int bn, int seq_k,
                                             int off, float sl2) {
  constexpr int kRows = decltype(size<0>(S))::value;
  mask_keys<CAUSAL>(S, cSrc, m0, n0, bn, seq_k, off);
  float base[kRows];
  bool large = false;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float mx = -INFINITY;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(S); ++c) mx = fmaxf(mx, S(r, c));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // a row lives in a quad
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run[r], mx);
    base[r] = scaled_base(m_new, sl2);
    large |= !(fabsf(base[r]) < kFoldLimit);
    alpha[r] = ex2(__fmul_rn(m_run[r], sl2) - base[r]);  // ratio of the bases; 0 from -inf
    m_run[r] = m_new;
  }
  // Past the fold limit (primitives.cuh) the exact form RN(x·scale) - base replaces the FMA, chosen
  // by one vote per warp. At D = 128 the scores are then pre-multiplied and the one FMA loop runs
  // with scale 1, so a single exponent loop is compiled; at D = 64 the loop is compiled once per
  // form: a single loop was slightly faster at D = 128 and slower at D = 64 (docs/log/).
  const auto exps = [&](auto exponent) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float sum = 0.f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(S); ++c) {
        const float e = ex2(exponent(S(r, c), base[r]));
        S(r, c) = e;
        sum += e;
      }
      l_run[r] = l_run[r] * alpha[r] + sum;  // this thread's partial sum; the quad adds last
    }
  };
  const bool exact = __any_sync(0xffffffffu, large);
  if constexpr (kOneLoop) {
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

// O *= alpha per row, skipped when no row of the warp moved its max (alpha is then exactly 1):
// after the first few key tiles the running max rarely moves, and the skip was measured faster.
template <class TO>
__device__ __forceinline__ void rescale_o(TO& O, const float* alpha) {
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

// O *= f / row sum (f: 1, or V's dequantization scale); a row with no visible key has l = 0
// and outputs zeros. l >= 1 otherwise (the max element contributes exp2(0)), so the
// approximate reciprocal is safe.
template <class TO>
__device__ __forceinline__ void normalize(TO& O, const float* l_run, float f) {
  CUTE_UNROLL
  for (int r = 0; r < decltype(size<0>(O))::value; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.f ? __fdividef(f, l) : 0.f;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(O); ++c) O(r, c) *= inv;
  }
}

// S accumulator (f32) -> P in T, in the register layout of P·V's A operand.
template <typename T, class TP, class TS>
__device__ __forceinline__ void convert_p(TP& rP, TS const& tSrS) {
  Tensor rP32 = recast<uint32_t>(rP);
  CUTE_UNROLL
  for (int i = 0; i < size(rP32); ++i) rP32(i) = pack2<T>(tSrS(2 * i), tSrS(2 * i + 1));
}

// The non-finite V check (common/nonfinite.cuh), for a V tile of BN keys x D columns crossing the
// causal diagonal, run by threads i of n. First whether this thread's share of the tile (BN * D
// contiguous 16-bit values from shared address `tile`, in any order) holds a non-finite value; once
// some thread's does (an OR over the n threads), the rare path: one thread a column records into nf
// (shared address of a NonFiniteCols<D>) the first NaN, +Inf and -Inf of its column and zeroes
// them. addr(key, col): the shared address of one value. The zeros are generic-proxy writes: the
// caller fences them before any wgmma reads the tile. Everything in 32-bit shared addresses: the
// producer's spare warps run it in 24 registers.
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
template <typename T, int BN, int D, class Addr>
__device__ __forceinline__ void record_nonfinite_cols(uint32_t nf, Addr addr, int i, int n) {
  constexpr bool kBf16 = std::is_same_v<T, cute::bfloat16_t>;
  static_assert(sizeof(T) == 2 && BN < kNoKey && sizeof(NonFiniteCols<D>) == 3 * D);
  for (int col = i; col < D; col += n) {
    for (int j = 0; j < 3; ++j) st_shared_8(nf + uint32_t(j * D + col), kNoKey);
    for (int key = 0; key < BN; ++key) {
      const uint32_t a = addr(key, col);
      const int kind = nonfinite_kind<kBf16>(ld_shared_16(a));
      if (kind == 0) continue;
      const uint32_t f = nf + uint32_t((kind - 1) * D + col);
      if (ld_shared_8(f) == kNoKey) st_shared_8(f, uint8_t(key));
      st_shared_16(a, 0);
    }
  }
}

// After P·V of a tile checked above (keys from n0): every O element adds the reference's term
// of the non-finite values its row sees there. cO: O's (row, col) coordinates in the row/col
// view, rows from m0.
template <int D, class TO, class TC>
__device__ __forceinline__ void add_nonfinite_terms(TO& O, TC const& cO, const NonFiniteCols<D>& nf,
                                                    int m0, int n0, int seq_k, int off) {
  CUTE_UNROLL
  for (int r = 0; r < decltype(size<0>(O))::value; ++r) {
    const int last = min(seq_k - 1, m0 + int(get<0>(cO(r, 0))) + off) - n0;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(O); ++c) O(r, c) += nonfinite_term(nf, get<1>(cO(r, c)), last);
  }
}

// Aligns the dynamic shared memory base up to 1024 bytes.
template <class Smem>
__device__ __forceinline__ Smem& smem_storage() {
  extern __shared__ uint8_t smem_raw[];
  return *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                  ~uintptr_t(1023));
}

// Work tile t -> (query tile, head, batch). Non-causal tiles are all alike: the query tiles of one
// head are neighbours, so the CTAs running at once share that head's K/V in L2. Causal tiles differ
// in cost (query tile m sees about m + 1 key tiles): heads one after another, each heaviest tile
// first (L2 locality as above), except the (batch, head) pairs from tail_bh on, which are
// interleaved heaviest first, so that the CTAs launched last are the cheap ones (make_params says
// when; interleaving every head in groups of 3 was slower on s16k-causal).
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

template <class E, int D, bool CAUSAL>
__global__ void __launch_bounds__(Cfg<E, D>::kThreads, 1)
    fwd_kernel(const __grid_constant__ Params<E, D> p) {
#ifdef SDPA_SM90_DEVICE
  using C = Cfg<E, D>;
  using QK = typename E::QK;
  using PV = typename E::PV;
  using Out = typename E::Out;
  using Bar = cutlass::arch::ClusterTransactionBarrier;
  constexpr int BM = C::kBM, BN = C::kBN, S = C::kStages;
  constexpr int kTurn = 1;      // named barriers kTurn + w: consumer warpgroup w may issue
  constexpr int kEpilogue = 3;  // named barriers kEpilogue + w: warpgroup w's output staging
  constexpr int kCheck = 5;     // named barrier of the producer's spare warps (non-finite V)
  auto& sm = smem_storage<typename C::Smem>();

  const int tid = threadIdx.x;
  const int consumers = 128 * p.wgs;
  const int bm = 64 * p.wgs;  // query rows per tile (the Q buffer always holds BM = 128)
  const int off = p.seq_k - p.seq_q;
  // Non-finite V check: the first key tile holding keys that some row of query tile m does not see
  // (causal; the tiles from it on cross the diagonal).
  const auto first_crossing = [&](int m_block) { return max(0, (m_block * bm + off + 1) / BN); };
  // Key tiles that query tile m sees.
  const auto key_tiles = [&](int m_block) {
    int n_end = p.seq_k;
    if (CAUSAL) n_end = min(p.seq_k, max(0, min(m_block * bm + bm, p.seq_q) + off));
    return (n_end + BN - 1) / BN;
  };
  // The key tile of a query tile's i-th ring use (of n): causal query tiles walk their keys
  // diagonal first, so that the (at most two) tiles crossing the diagonal, which the non-finite V
  // check holds back, come first, and their check runs while the consumers compute the first
  // S = Q·Kᵀ and softmax instead of sitting between the last V load and the last P·V. (The online
  // softmax does not depend on the order; rows that see nothing of the first tiles keep m = -inf
  // and p = 0 until they do.)
  const auto key_tile = [&](int i, int n) { return CAUSAL ? n - 1 - i : i; };

  if (tid == 0) {
    prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    mbar_init(&sm.bar_q, 1);
    mbar_init(&sm.empty_q, consumers);
    for (int s = 0; s < S; ++s) {
      mbar_init(&sm.full_k[s], 1);
      mbar_init(&sm.full_v[s], E::kConvertV ? C::kConverters : 1);
      mbar_init(&sm.empty_k[s], consumers);  // every consumer thread releases
      mbar_init(&sm.empty_v[s], consumers);
      mbar_init(&sm.full_vd[s], 1);
      mbar_init(&sm.checked_v[s], C::kConverters);
    }
    if constexpr (E::kConvertV) {
      for (int s = 0; s < C::kV8Stages; ++s) {
        mbar_init(&sm.full_v8[s], 1);
        mbar_init(&sm.empty_v8[s], C::kConverters);
      }
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();  // the last CTA-wide barrier: the roles part here
  // Programmatic launch (launch()): everything above overlapped the previous grid; nothing
  // global is read or written before this. E4M3 with the pre-pass: the grid before is
  // convert_v, itself launched the ordinary way (everything before it has completed), and only
  // V depends on it: the producer waits before its first V load instead.
  if constexpr (!E::kPrepass) pdl_wait();
  pdl_launch_dependents();

  Tensor sQ = make_tensor(make_smem_ptr(sm.q), typename C::LayoutQ{});    // (BM, D)
  Tensor sK = make_tensor(make_smem_ptr(sm.k), typename C::LayoutK{});    // (BN, D, stage)
  Tensor sV = make_tensor(make_smem_ptr(sm.v), typename C::LayoutV{});    // (BN, D, stage)
  Tensor sVt = make_tensor(make_smem_ptr(sm.v), typename C::LayoutVt{});  // (D, BN, stage)

  // The CTA takes tiles blockIdx.x, blockIdx.x + gridDim.x, ...: one tile when the grid covers
  // them all, several when it is persistent. Both roles walk the same sequence; the K/V ring
  // position (`it`: uses of the ring so far) and the Q buffer's use count (`qi`) carry over
  // from tile to tile.
  if (tid < 128) {
    // Producer warpgroup: 24 registers a thread are plenty to issue TMA.
    cutlass::arch::warpgroup_reg_dealloc<C::kProducerRegs>();
    // Non-finite V check, by warps 1-3 (thread ct of kConverters) once they have checked the V tile
    // of stage s crossing the diagonal (hit: this thread's share had a non-finite value): whether
    // any share had one, and if so the tile's records and zeros (nf[s]; the caller fences the zeros
    // for the wgmmas).
    const auto settle_nonfinite = [&](int s, bool hit, int ct) {
      const bool any = named_or(kCheck, C::kConverters, hit);
      if (any) {
        constexpr auto kSwizzle = get_swizzle_portion(typename C::LayoutV{});
        constexpr auto kFlatV = get_nonswizzle_portion(typename C::LayoutV{});
        const uint32_t v16 = uint32_t(__cvta_generic_to_shared(sm.v));
        record_nonfinite_cols<PV, BN, D>(
            uint32_t(__cvta_generic_to_shared(&sm.nf[s])),
            [&](int key, int col) {
              return kSwizzle(v16 + uint32_t(kFlatV(key, col, s) * sizeof(PV)));
            },
            ct, C::kConverters);
      }
      if (ct == 0) sm.nf_any[s] = any;
      return any;
    };
    if constexpr (E::kConvertV) {
      // Warps 1-3: each e4m3 V tile of the ring, 8 codes a thread and step (8-byte reads along
      // the unswizzled rows, 16-byte writes into the swizzled f16 tile: both free of bank
      // conflicts), into the f16 V stage the consumers read, in the order the TMA thread loads.
      if (tid >= 32) {
        const int ct = tid - 32;
        const uint32_t v8 = uint32_t(__cvta_generic_to_shared(sm.v8));
        const uint32_t v16 = uint32_t(__cvta_generic_to_shared(sm.v));
        // CuTe's GMMA atoms keep their swizzle apart from the element layout and apply it to
        // the shared-memory byte address (1024-aligned base), as done here in 32 bits.
        constexpr auto kSwizzle = get_swizzle_portion(typename C::LayoutV{});
        constexpr auto kFlatV = get_nonswizzle_portion(typename C::LayoutV{});
        // A thread keeps its 8 columns and steps over rows (no index division in the loop).
        constexpr int S8 = C::kV8Stages, kPerRow = D / 8, kStep = C::kConverters / kPerRow;
        static_assert(C::kConverters % kPerRow == 0);
        int it = 0;
        for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
          int m_block, h, b;
          decode_tile<CAUSAL>(p, t, m_block, h, b);
          const int n_tiles = key_tiles(m_block);
          // Non-finite V check: key tiles from n_first on cross the causal diagonal.
          const int n_first = CAUSAL ? first_crossing(m_block) : n_tiles;
          for (int n = 0; n < n_tiles; ++n, ++it) {
            const int s = it % S, s8 = it % S8;
            Bar::wait(&sm.full_v8[s8], (it / S8) & 1);
            if (it >= S) Bar::wait(&sm.empty_v[s], ((it / S) + 1) & 1);
            bool nan8 = false;  // non-finite V: a NaN code among this thread's (no infinities)
            // Recomputed per tile from an opaque index: fewer registers held across the loop.
            int ci = ct;
            asm volatile("" : "+r"(ci));
            const int d = ci % kPerRow * 8, key0 = ci / kPerRow;
            for (int key = key0; key < BN; key += kStep) {
              const uint2 x = ld_shared_64(v8 + uint32_t(s8 * BN * D + key * D + d));
              nan8 |= e4m3_nan8(x);
              st_shared_128(kSwizzle(v16 + uint32_t(kFlatV(key, d, s) * sizeof(PV))),
                            make_uint4(f16x2_of_e4m3x2(x.x), f16x2_of_e4m3x2(x.x >> 16),
                                       f16x2_of_e4m3x2(x.y), f16x2_of_e4m3x2(x.y >> 16)));
            }
            // Non-finite V check, on the converted tile (its barrier is also the one after which
            // every converted value is visible to all).
            if (key_tile(n, n_tiles) >= n_first) settle_nonfinite(s, nan8, ct);
            // These generic-proxy writes must be visible to the wgmmas (async proxy).
            cutlass::arch::fence_view_async_shared();
            Bar::arrive(&sm.empty_v8[s8]);
            Bar::arrive(&sm.full_v[s]);
          }
          if constexpr (CAUSAL) break;  // causal grids run one tile a CTA (launch)
        }
        return;
      }
    }
    if (tid == 0) {
      Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.seq_q, Int<D>{}, p.heads, p.batch));
      Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seq_k, Int<D>{}, p.kv_heads, p.batch));
      Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.seq_k, Int<D>{}, p.kv_heads, p.batch));
      constexpr uint32_t kQBytes = BM * D * sizeof(QK);
      constexpr uint32_t kKBytes = BN * D * sizeof(QK);
      constexpr uint32_t kVBytes = BN * D * (E::kConvertV ? sizeof(QK) : sizeof(PV));
      int it = 0, qi = 0;
      // kConvertV: the grid stride re-read each tile; held in a register across the loop it is
      // the one value ptxas spills at 24 registers (4-8 bytes).
      const auto stride = [] {
        uint32_t n = gridDim.x;
        if constexpr (E::kConvertV) asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(n));
        return int(n);
      };
      for (int t = blockIdx.x; t < p.tiles; t += stride(), ++qi) {
        int m_block, h, b;
        decode_tile<CAUSAL>(p, t, m_block, h, b);
        const int hk = p.div_group.div(h);
        const int n_tiles = key_tiles(m_block);
        // BM rows from row m_block * bm (with 64-row tiles the upper half goes unused).
        Tensor gQ = local_tile(domain_offset(make_coord(m_block * bm, _0{}), mQ(_, _, h, b)),
                               Shape<Int<BM>, Int<D>>{}, make_coord(_0{}, _0{}));
        Tensor gK = local_tile(mK(_, _, hk, b), Shape<Int<BN>, Int<D>>{}, make_coord(_, _0{}));
        Tensor gV = local_tile(mV(_, _, hk, b), Shape<Int<BN>, Int<D>>{}, make_coord(_, _0{}));
        auto tQ = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                group_modes<0, 2>(gQ));
        auto tK = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                group_modes<0, 2>(gK));
        // kConvertV: V's e4m3 tiles go to their own ring.
        auto tV = [&]() {
          if constexpr (E::kConvertV) {
            Tensor sV8 = make_tensor(make_smem_ptr(sm.v8), typename C::LayoutV8{});
            return tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV8),
                                 group_modes<0, 2>(gV));
          } else {
            return tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                 group_modes<0, 2>(gV));
          }
        }();
        const auto load_q = [&]() {  // once the consumers are done with the previous Q
          if (qi > 0) Bar::wait(&sm.empty_q, (qi - 1) & 1);
          Bar::arrive_and_expect_tx(&sm.bar_q, kQBytes);
          copy(p.tma_q.with(sm.bar_q), get<0>(tQ), get<1>(tQ));
        };
        if (n_tiles == 0) load_q();  // nothing visible: the consumers still wait for (and free) Q
        for (int n = 0; n < n_tiles; ++n, ++it) {
          // Ring use: `it`, which is n in a causal grid (one tile a CTA; one register less).
          const int u = CAUSAL ? n : it;
          const int s = u % S;
          const uint32_t phase = ((u / S) + 1) & 1;  // the release of ring use u - S
          if (u >= S) Bar::wait(&sm.empty_k[s], phase);
          Bar::arrive_and_expect_tx(&sm.full_k[s], kKBytes);
          const int kt = key_tile(n, n_tiles);
          copy(p.tma_k.with(sm.full_k[s]), get<0>(tK)(_, kt), get<1>(tK)(_, s));
          if (n == 0) load_q();  // after K_0: the previous tile frees both at about the same time
          if constexpr (E::kConvertV) {
            constexpr int S8 = C::kV8Stages;
            const int s8 = u % S8;
            if (u >= S8) Bar::wait(&sm.empty_v8[s8], ((u / S8) + 1) & 1);
            Bar::arrive_and_expect_tx(&sm.full_v8[s8], kVBytes);
            copy(p.tma_v.with(sm.full_v8[s8]), get<0>(tV)(_, kt), get<1>(tV)(_, s8));
          } else {
            if constexpr (E::kPrepass)
              if (u == 0) pdl_wait();  // V comes from convert_v
            if (u >= S) Bar::wait(&sm.empty_v[s], phase);
            // Non-finite V check: tiles crossing the diagonal land on full_vd (the check waits for
            // them).
            uint64_t& full = CAUSAL && kt >= first_crossing(m_block) ? sm.full_vd[s] : sm.full_v[s];
            Bar::arrive_and_expect_tx(&full, kVBytes);
            copy(p.tma_v.with(full), get<0>(tV)(_, kt), get<1>(tV)(_, s));
          }
        }
        if constexpr (CAUSAL) break;  // causal grids run one tile a CTA (launch)
      }
      return;
    }
    if constexpr (CAUSAL && !E::kConvertV) {
      // Warps 1-3: the non-finite V check of each V tile crossing the diagonal, once TMA has landed
      // it, before the consumers' P·V (they wait on checked_v for those tiles).
      if (tid >= 32) {
        const int ct = tid - 32;
        const uint32_t v16 = uint32_t(__cvta_generic_to_shared(sm.v));
        // Causal grids run one tile a CTA (launch), and walk the key tiles diagonal first
        // (key_tile): the n_tiles - n_first tiles crossing the diagonal are ring uses 0, 1.
        int m_block, h, b, t = blockIdx.x;
        asm volatile("" : "+r"(t));  // opaque: nothing shared with the TMA thread's registers
        decode_tile<CAUSAL>(p, t, m_block, h, b);
        const int rows = 64 * p.wgs, diag = m_block * rows + p.seq_k - p.seq_q;
        const int n_end =
            min(p.seq_k, max(0, min(m_block * rows + rows, p.seq_q) + p.seq_k - p.seq_q));
        const int n_tiles = (n_end + BN - 1) / BN;    // key_tiles(m_block)
        const int n_first = max(0, (diag + 1) / BN);  // first_crossing(m_block)
        // Ring use i is stage i (at most 2 crossing tiles, S >= 2): full_vd's first phase.
        static_assert(S >= 2);
        for (int s = 0; s < n_tiles - n_first; ++s) {
          Bar::wait(&sm.full_vd[s], 0);
          const uint32_t tile = v16 + uint32_t(s * BN * D * sizeof(PV));
          const bool any =
              settle_nonfinite(s, scan_nonfinite<PV, BN, D>(tile, ct, C::kConverters), ct);
          if (any) cutlass::arch::fence_view_async_shared();  // the zeros, for the wgmmas
          Bar::arrive(&sm.checked_v[s]);
        }
        return;
      }
    }
    return;
  }

  // Consumer warpgroups.
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int ctid = tid - 128;  // 0 .. consumers - 1
  const int wg = ctid / 128;   // this consumer warpgroup: rows [64 wg, 64 wg + 64)
  const bool turns = C::kPingPong && p.turns;
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
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K) smem descriptors
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stage)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<BM>, Int<D>>{});
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<BM>, Int<BN>>{});
  Tensor rP = make_tensor<PV>(typename C::LayoutP{});

  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));
  Tensor cSrc = make_tensor(cS.data(), rowcol(cS.layout()));
  Tensor O = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
  Tensor Srow = make_tensor(tSrS.data(), rowcol(tSrS.layout()));
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
  const auto fence_all = [&]() {
    warpgroup_fence_operand(tSrS);
    warpgroup_fence_operand(tOrO);
    warpgroup_fence_operand(rP);
  };

  int it = 0, qi = 0;
  for (int t = blockIdx.x; t < p.tiles; t += gridDim.x, ++qi) {
    int m_block, h, b;
    decode_tile<CAUSAL>(p, t, m_block, h, b);
    const int m0 = m_block * bm;
    const int n_tiles = key_tiles(m_block);
    const int n_first = CAUSAL ? first_crossing(m_block) : n_tiles;
    // V of the tile's i-th ring use (u overall, stage sv): landed, and checked if it crosses
    // the diagonal. Causal: one tile a CTA (u = i), the n_cross crossing tiles are uses
    // 0 .. n_cross - 1 (key_tile), on stages 0 .. n_cross - 1, and complete full_vd and
    // checked_v (first phase) instead of full_v, whose phase for a later use of stage sv is one
    // behind where sv had a crossing tile.
    const auto wait_v = [&](int i, int u, int sv) {
      if constexpr (CAUSAL && !E::kConvertV) {
        const int n_cross = max(0, n_tiles - n_first);
        if (i < n_cross)
          Bar::wait(&sm.checked_v[sv], 0);
        else
          Bar::wait(&sm.full_v[sv], ((u / S) - (sv < n_cross ? 1 : 0)) & 1);
      } else {
        Bar::wait(&sm.full_v[sv], (u / S) & 1);
      }
    };

    // E4M3: q·k dequantization scales into the softmax scale, v's into the normalization.
    float sl2 = p.scale_log2, o_scale = 1.f;
    if constexpr (E::kFp8) {
      const int hk = p.div_group.div(h);
      const int qsi = p.per_head ? b * p.heads + h : 0;
      const int kvi = p.per_head ? b * p.kv_heads + hk : 0;
      sl2 *= __ldg(p.q_scale + qsi) * __ldg(p.k_scale + kvi);
      o_scale = __ldg(p.v_scale + kvi);
    }

    clear(tOrO);
    float m_run[kRows], l_run[kRows], alpha[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      m_run[r] = -INFINITY;
      l_run[r] = 0.f;
    }

    // Issue rounds, N = n_tiles:
    //   round 0:            S_0
    //   round n (1..N-1):   S_n, then O += P_{n-1}·V_{n-1}: two commit groups
    //   round N:            O += P_{N-1}·V_{N-1}
    // Once S_n is done its K stage is released (after the last S, Q too) and the softmax turns
    // it into exp2 scores; once P·V is done its V stage is released and P_n is written over
    // P_{n-1}. Every wgmma sits on an unconditional path of its round: wgmmas under a branch
    // make ptxas serialize them. With turns, each warpgroup waits for its turn barrier before
    // a round's wgmmas and hands the turn over after issuing them; warpgroup 0 goes first,
    // warpgroup 1 pre-arrives once per tile and skips its very last hand-over, so both
    // barriers see matched counts.
    if (n_tiles > 0) {
      if (wg == 1) turn_arrive(0);
      Bar::wait(&sm.bar_q, qi & 1);

      // Round 0.
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
        softmax_tile<CAUSAL, D == 128>(Srow, cSrc, m_run, l_run, alpha, m0,
                                       key_tile(0, n_tiles) * BN, BN, p.seq_k, off, sl2);
        convert_p<PV>(rP, tSrS);  // O is still zero: no rescale
      }

      for (int n = 1; n < n_tiles; ++n) {
        const int uk = it + n, uv = it + n - 1;  // ring uses of K_n and V_{n-1}
        const int sk = uk % S, sv = uv % S;
        Bar::wait(&sm.full_k[sk], (uk / S) & 1);
        wait_v(n - 1, uv, sv);
        turn_sync(wg);
        fence_all();
        warpgroup_arrive();
        issue_s(sk);
        warpgroup_commit_batch();
        // O was last written by P_{n-2}·V_{n-2} (done); rescale it by softmax n-1's factor
        // while S_n runs (O is still zero at n = 1).
        if (n > 1) rescale_o(O, alpha);
        warpgroup_fence_operand(tOrO);
        warpgroup_arrive();
        cute::gemm(mma_pv, rP, tOrV(_, _, _, sv), tOrO);
        warpgroup_commit_batch();
        turn_arrive(wg ^ 1);
        warpgroup_wait<1>();  // S_n done; P_{n-1}·V_{n-1} may still run
        warpgroup_fence_operand(tSrS);
        Bar::arrive(&sm.empty_k[sk]);
        if (n == n_tiles - 1) Bar::arrive(&sm.empty_q);
        softmax_tile<CAUSAL, D == 128>(Srow, cSrc, m_run, l_run, alpha, m0,
                                       key_tile(n, n_tiles) * BN, BN, p.seq_k, off, sl2);
        warpgroup_wait<0>();
        fence_all();
        Bar::arrive(&sm.empty_v[sv]);
        convert_p<PV>(rP, tSrS);
      }

      // Round N.
      {
        const int uv = it + n_tiles - 1, sv = uv % S;
        wait_v(n_tiles - 1, uv, sv);
        turn_sync(wg);
        if (n_tiles > 1) rescale_o(O, alpha);
        fence_all();
        warpgroup_arrive();
        cute::gemm(mma_pv, rP, tOrV(_, _, _, sv), tOrO);
        warpgroup_commit_batch();
        if (wg == 0) turn_arrive(1);
        warpgroup_wait<0>();
        fence_all();
        Bar::arrive(&sm.empty_v[sv]);
      }
      it += n_tiles;
    } else {
      Bar::wait(&sm.bar_q, qi & 1);  // every loaded Q is waited for before it is freed
      Bar::arrive(&sm.empty_q);
    }

    // Non-finite V check: the non-finite values it took out of the tiles crossing the diagonal,
    // added once after the last P·V rather than after each tile's (the terms are NaN or ±Inf, which
    // the rescaling in between keeps as they are; nothing of it in the main loop). Those tiles were
    // ring uses 0 and 1 (stages 0 and 1, S >= 2), and only they write records, so the records are
    // all still there.
    if constexpr (CAUSAL) {
      for (int j = n_first; j < n_tiles; ++j) {
        // `it` has moved past this tile's uses; key tile j was use key_tile(j) (an involution)
        const int sv = (it - n_tiles + key_tile(j, n_tiles)) % S;
        if (!sm.nf_any[sv]) continue;
        int etid = ctid;  // opaque: keeps the coordinates out of the main loop's registers
        asm volatile("" : "+r"(etid));
        Tensor cO = mma_pv.get_thread_slice(etid).partition_C(
            make_identity_tensor(Shape<Int<BM>, Int<D>>{}));
        add_nonfinite_terms(O, make_tensor(cO.data(), rowcol(cO.layout())), sm.nf[sv], m0, j * BN,
                            p.seq_k, off);
      }
    }
    normalize(O, l_run, o_scale);

    // Output through this warpgroup's 64-row staging area: row r, 16-byte chunk j lives at
    // chunk j ^ (r % 8), so the quad-strided 4-byte writes and the row-contiguous 16-byte reads are
    // both free of bank conflicts. (Writing O straight from registers, 4 bytes a store, was
    // slower.) The barrier in front keeps this tile's writes behind the reads of the previous one.
    // The addresses are the same for every tile: computed from an opaque thread index, or the
    // compiler hoists them out of the tile loop and holds them in registers across the main loop
    // (spills).
    int etid = ctid;
    asm volatile("" : "+r"(etid));
    const uint32_t so =
        uint32_t(__cvta_generic_to_shared(sm.o)) + uint32_t(wg * 64 * D * sizeof(Out));
    if (qi > 0) named_sync(kEpilogue + wg, 128);
    {
      Tensor cO =
          mma_pv.get_thread_slice(etid).partition_C(make_identity_tensor(Shape<Int<BM>, Int<D>>{}));
      CUTE_UNROLL
      for (int i = 0; i < size(tOrO); i += 2) {
        const int r = get<0>(cO(i)) - 64 * wg, c = get<1>(cO(i));  // element i + 1: (r, c + 1)
        const int phys = r * D + (((c >> 3) ^ (r & 7)) << 3) + (c & 7);
        st_shared(so + phys * sizeof(Out), pack2<Out>(tOrO(i), tOrO(i + 1)));
      }
    }
    named_sync(kEpilogue + wg, 128);
    Out* ob = p.o + int64_t(b) * p.os.batch + int64_t(h) * p.os.head;
    constexpr int CH = D / 8;  // 16-byte chunks per row
    const int wtid = etid % 128;
    CUTE_UNROLL
    for (int i = 0; i < 64 * CH / 128; ++i) {
      const int ci = wtid + i * 128, r = ci / CH, j = ci % CH;
      const int row = m0 + 64 * wg + r;
      if (row < p.seq_q)
        *reinterpret_cast<uint4*>(ob + int64_t(row) * p.os.seq + j * 8) =
            ld_shared_128(so + (r * D + ((j ^ (r & 7)) << 3)) * sizeof(Out));
    }
  }
#endif
}

// The E4M3 kernel's pre-pass: V's codes as f16 (exact) into the workspace, packed
// [batch][kv_head][seq_k][D]. 16 codes a thread and step: one 16-byte load, two 16-byte stores.
template <int D>
__global__ void __launch_bounds__(256)
    convert_v(const uint8_t* __restrict__ v, Strides vs, int seq_k, int kv_heads, int64_t chunks,
              uint4* __restrict__ out) {
#ifdef SDPA_SM90_DEVICE
  // The attention grid may launch now: it waits (griddepcontrol.wait) before its first V load.
  pdl_launch_dependents();
  constexpr int kChunks = D / 16;  // 16-code chunks per row
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < chunks; i += step) {
    const int64_t row = i / kChunks, bk = row / seq_k;  // bk = b * kv_heads + hk
    const int64_t key = row - bk * seq_k, b = bk / kv_heads, hk = bk - b * kv_heads;
    const uint4 x = *reinterpret_cast<const uint4*>(v + b * vs.batch + hk * vs.head + key * vs.seq +
                                                    16 * (i % kChunks));
    out[2 * i] = make_uint4(f16x2_of_e4m3x2(x.x), f16x2_of_e4m3x2(x.x >> 16), f16x2_of_e4m3x2(x.y),
                            f16x2_of_e4m3x2(x.y >> 16));
    out[2 * i + 1] = make_uint4(f16x2_of_e4m3x2(x.z), f16x2_of_e4m3x2(x.z >> 16),
                                f16x2_of_e4m3x2(x.w), f16x2_of_e4m3x2(x.w >> 16));
  }
#endif
}

// Host side ----------------------------------------------------------------------------------

// TMA needs a 16-byte aligned base and 16-byte multiple strides below 2^40 bytes (and dims
// below 2^32: the shapes here are int); the Rust layer guarantees them (fused::supports), this
// only turns a broken promise into an error instead of a fault.
inline void check_tma_operand(const void* ptr, const Strides& s, const char* what,
                              int elem_bytes = 2) {
  const auto ok = [&](int64_t st) {
    return st >= 0 && (st * elem_bytes) % 16 == 0 && st * elem_bytes < (int64_t(1) << 40);
  };
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0 || !ok(s.batch) || !ok(s.head) || !ok(s.seq))
    throw Error(std::string("cutlass-sm90: ") + what +
                " is not TMA-addressable (16-byte aligned base and strides required)");
}

// Whether device `dev` is an sm_90 part, and its multiprocessor count; cached per device.
inline bool is_sm90(int dev) {
  static std::atomic<uint64_t> known{0}, yes{0};
  const uint64_t bit = dev < 64 ? uint64_t(1) << dev : 0;
  if (bit && (known.load(std::memory_order_relaxed) & bit))
    return yes.load(std::memory_order_relaxed) & bit;
  int major = 0;
  SDPA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (bit) {
    if (major == 9) yes.fetch_or(bit, std::memory_order_relaxed);
    known.fetch_or(bit, std::memory_order_relaxed);
  }
  return major == 9;
}
inline int sm_count(int dev) {
  static std::atomic<int> known[64];
  const bool cached = dev >= 0 && dev < 64;
  if (cached) {
    const int n = known[dev].load(std::memory_order_relaxed);
    if (n > 0) return n;
  }
  int n = 0;
  SDPA_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  if (cached) known[dev].store(n, std::memory_order_relaxed);
  return n;
}

// E4M3 with the pre-pass: the packed f16 V that convert_v writes into the workspace, and its
// size (none where V is converted in shared memory).
inline Strides packed_v_strides(const FwdArgs& a) {
  return {a.kv_heads * a.seq_k * a.head_dim, a.seq_k * a.head_dim, a.head_dim};
}
inline int64_t workspace_e4m3_bytes(const FwdArgs& a) {
  const bool prepass =
      a.head_dim == 64 ? E4m3<cute::half_t, 64>::kPrepass : E4m3<cute::half_t, 128>::kPrepass;
  return prepass ? a.batch * a.kv_heads * a.seq_k * a.head_dim * int64_t(sizeof(cute::half_t)) : 0;
}

// The kernel parameters: a TMA descriptor per operand (make_tma_copy encodes it on the host;
// it travels in the __grid_constant__ parameter block) and the scalars.
template <class E, int D>
Params<E, D> make_params(const FwdArgs& a, int sms, bool causal) {
  using C = Cfg<E, D>;
  using QK = typename E::QK;
  using PV = typename E::PV;
  const auto gmem = [&](auto const* ptr, int64_t seq, int64_t heads, const Strides& st) {
    return make_tensor(make_gmem_ptr(ptr), make_shape(int(seq), Int<D>{}, int(heads), int(a.batch)),
                       make_stride(st.seq, _1{}, st.head, st.batch));
  };
  // E4M3 with the pre-pass: V is convert_v's f16 copy in the workspace.
  const void* v = E::kPrepass ? a.workspace : a.v;
  const Strides vs = E::kPrepass ? packed_v_strides(a) : a.v_stride;
  Params<E, D> p{};
  p.tma_q = make_tma_copy(SM90_TMA_LOAD{},
                          gmem(static_cast<const QK*>(a.q), a.seq_q, a.heads, a.q_stride),
                          typename C::LayoutQ{}, Shape<Int<C::kBM>, Int<D>>{}, _1{});
  p.tma_k = make_tma_copy(SM90_TMA_LOAD{},
                          gmem(static_cast<const QK*>(a.k), a.seq_k, a.kv_heads, a.k_stride),
                          take<0, 2>(typename C::LayoutK{}), Shape<Int<C::kBN>, Int<D>>{}, _1{});
  if constexpr (E::kConvertV)
    p.tma_v =
        make_tma_copy(SM90_TMA_LOAD{}, gmem(static_cast<const QK*>(v), a.seq_k, a.kv_heads, vs),
                      take<0, 2>(typename C::LayoutV8{}), Shape<Int<C::kBN>, Int<D>>{}, _1{});
  else
    p.tma_v =
        make_tma_copy(SM90_TMA_LOAD{}, gmem(static_cast<const PV*>(v), a.seq_k, a.kv_heads, vs),
                      take<0, 2>(typename C::LayoutV{}), Shape<Int<C::kBN>, Int<D>>{}, _1{});
  p.o = static_cast<typename E::Out*>(a.o);
  p.os = a.o_stride;
  p.seq_q = int(a.seq_q);
  p.seq_k = int(a.seq_k);
  p.heads = int(a.heads);
  p.kv_heads = int(a.kv_heads);
  p.batch = int(a.batch);
  p.scale_log2 = a.scale * 1.4426950408889634f;
  const int bh = int(a.heads * a.batch);
  // 64-row tiles when 128-row tiles would leave more than half the SMs idle (faster on the mission
  // problem, docs/log/).
  const int tiles128 = int((a.seq_q + C::kBM - 1) / C::kBM) * bh;
  p.wgs = 2 * tiles128 <= sms ? 1 : 2;
  p.m_blocks = int((a.seq_q + 64 * p.wgs - 1) / (64 * p.wgs));
  p.tiles = p.m_blocks * bh;
  // Non-causal grids are persistent past one wave (launch()); turns only pay where every CTA
  // runs a single tile.
  p.turns = p.wgs == 2 && (causal || p.tiles <= sms) ? 1 : 0;
  // Causal order (decode_tile). In per-head order the last head's heaviest tile (m_blocks key
  // tiles) starts when about one head's work, m_blocks^2 / 2 tiles, is left to all SMs, and
  // overruns the rest by about m_blocks - m_blocks^2 / (2 sms), against bh m_blocks^2 / (2 sms) per
  // SM in all. Where that overrun is over 12% of the whole, the last `tail` heads are interleaved,
  // just enough of them that their work per SM outlasts the heaviest tile twice:
  // tail m_blocks^2 / 2 >= 2 sms m_blocks. Below the threshold the interleaved heads' K/V crowd
  // L2 and cost more than the overrun they save (docs/log/).
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
  p.q_scale = a.q_scale;
  p.k_scale = a.k_scale;
  p.v_scale = a.v_scale;
  p.per_head = a.per_head_scales ? 1 : 0;
  return p;
}

template <class E, int D, bool CAUSAL>
void launch(const FwdArgs& a, cudaStream_t stream) {
  using C = Cfg<E, D>;
  constexpr int kSmem = C::kSmemBytes;
  int dev = 0;
  SDPA_CUDA_CHECK(cudaGetDevice(&dev));
  if (!is_sm90(dev)) throw Error("cutlass-sm90: needs an sm_90 (Hopper) GPU");
  static std::atomic<uint64_t> configured{0};
  opt_in_smem(reinterpret_cast<const void*>(fwd_kernel<E, D, CAUSAL>), kSmem, configured);
  constexpr int kIn = sizeof(typename E::QK);
  check_tma_operand(a.q, a.q_stride, "q", kIn);
  check_tma_operand(a.k, a.k_stride, "k", kIn);
  check_tma_operand(a.v, a.v_stride, "v", kIn);
  const int sms = sm_count(dev);
  if constexpr (E::kFp8) {
    if (!a.q_scale || !a.k_scale || !a.v_scale)
      throw Error("cutlass-sm90 e4m3: q, k and v scales are required");
  }
  if constexpr (E::kPrepass) {
    if (a.workspace == nullptr || reinterpret_cast<uintptr_t>(a.workspace) % 16 != 0)
      throw Error("cutlass-sm90 e4m3: needs a 16-byte aligned workspace of workspace_bytes()");
    // Launched the ordinary way: it starts once everything before it on the stream is done,
    // which is what lets the attention grid read Q and K before its own wait.
    const int64_t chunks = a.batch * a.kv_heads * a.seq_k * (D / 16);
    // At most 8 CTAs of 256 threads per SM (the SM's 2048 threads), a stride loop beyond.
    const int64_t blocks = std::min<int64_t>((chunks + 255) / 256, 8 * int64_t(sms));
    convert_v<D><<<unsigned(blocks), 256, 0, stream>>>(static_cast<const uint8_t*>(a.v), a.v_stride,
                                                       int(a.seq_k), int(a.kv_heads), chunks,
                                                       static_cast<uint4*>(a.workspace));
    SDPA_LAUNCH_CHECK("cutlass-sm90 e4m3 convert_v launch");
  }
  const Params<E, D> p = make_params<E, D>(a, sms, CAUSAL);
  // Non-causal: persistent, one CTA per SM (measured faster, most on s1k-d64). Causal: one CTA per
  // tile; a static persistent split of the uneven tiles was slower.
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(CAUSAL ? p.tiles : std::min(p.tiles, sms)));
  cfg.blockDim = dim3(unsigned(128 * (p.wgs + 1)));
  cfg.dynamicSmemBytes = kSmem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[1];
  add_pdl(cfg, attrs);
  SDPA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, fwd_kernel<E, D, CAUSAL>, p));
}

// The small-problem path at D = 64 (sm90_small.cuh, instantiated in fwd_small_<dtype>_d64.cu):
// launches and returns true where it applies.
template <typename T, int D>
bool small_forward(const FwdArgs& a, cudaStream_t stream);
template <typename T, int D>
void small_attributes(std::vector<KernelAttr>& out);

template <class E, int D>
void forward_elems(const FwdArgs& a, cudaStream_t stream) {
  if (a.mask == sdpa::Mask::CausalBottomRight)
    launch<E, D, true>(a, stream);
  else
    launch<E, D, false>(a, stream);
}

template <typename T, int D>
void forward(const FwdArgs& a, cudaStream_t stream) {
  if constexpr (D == 64)
    if (small_forward<T, D>(a, stream)) return;
  forward_elems<Same<T>, D>(a, stream);
}

// E4M3 Q, K, V; O in a.out_dtype.
template <int D>
void forward_e4m3(const FwdArgs& a, cudaStream_t stream) {
  if (a.out_dtype == Dtype::F16) return forward_elems<E4m3<cute::half_t, D>, D>(a, stream);
  if (a.out_dtype == Dtype::BF16) return forward_elems<E4m3<cute::bfloat16_t, D>, D>(a, stream);
  throw Error("cutlass-sm90 e4m3: out_dtype must be f16 or bf16");
}

template <class E, int D>
void push_elems_attributes(std::vector<KernelAttr>& out, const char* name) {
  const void* const fns[2] = {reinterpret_cast<const void*>(fwd_kernel<E, D, false>),
                              reinterpret_cast<const void*>(fwd_kernel<E, D, true>)};
  push_attributes(out, "cutlass-sm90", name, D, fns, Cfg<E, D>::kSmemBytes);
}

template <typename T, int D>
void attributes(std::vector<KernelAttr>& out) {
  push_elems_attributes<Same<T>, D>(out, dtype_name<T>());
  if constexpr (D == 64) small_attributes<T, D>(out);
}

template <int D>
void attributes_e4m3(std::vector<KernelAttr>& out) {
  push_elems_attributes<E4m3<cute::half_t, D>, D>(out, "e4m3_f16");
  push_elems_attributes<E4m3<cute::bfloat16_t, D>, D>(out, "e4m3_bf16");
}

}  // namespace sdpa::cutlass_sm90
