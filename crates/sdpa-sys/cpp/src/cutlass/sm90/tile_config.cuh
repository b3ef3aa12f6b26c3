// The sm_90a kernel's tile configuration: element types, the per-head-dim tuning table, the
// wgmma atoms, shared-memory layouts, TMA copy types and the shared storage. Everything here is
// compile-time; the collectives (tile_scheduler, mainloop, softmax, epilogue) and the kernel in
// sm90_fwd.cuh read their sizes from it.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>
#include <utility>

// clang-format off: cute/tensor.hpp first, the cute headers below assume its declarations
#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>
// clang-format on

#include "common/nonfinite.cuh"

// The kernel bodies exist only in the sm_90a device pass; other passes (sm_80 in the default
// "80;90a" build) compile them empty, and the host side refuses to launch off sm_90.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SDPA_SM90_DEVICE 1
#endif

namespace sdpa::cutlass_sm90 {

using namespace cute;

// The tuning table: every choice that depends on the head dim, in one place. A head dim without
// an entry does not compile; adding one is an entry here and a line in cpp/kernels.txt.
//   kWGs         consumer warpgroups of 64 query rows each (tiles of 64 kWGs rows). D = 64:
//                three, as FA3 and fa4 run it (e4m3 fast mode keeps two: E4m3Fast): there the
//                exponentials (MUFU) take as long as the wgmmas, and a third softmax in flight
//                keeps the SFU busier (measured: docs/log/2026-11-notebook.md, "three consumer
//                warpgroups"). The registers left a consumer follow from it (FwdCollectives).
//   kStages      K/V ring depth. D = 128 f16/bf16: Q 32 + O 32 + 2 x (K 32 + V 32) = 192 KB, a
//                third stage does not fit; e4m3 at D = 128: Q 16 + O 32 + 3 x (K 16 + V 32).
//   kPingPong    whether the consumer warpgroups may take turns issuing (Params::turns
//                decides per launch). At D = 128 the turns cost more than the ordering gains
//                on the problems that matter, so they are compiled out (measured:
//                docs/log/2026-11-perf-history.md, "Next to FlashAttention-4"), but for the
//                band kernel on the tile feed (KernelTraits::kTurns).
//   kOneExpLoop  the softmax's huge-logit fallback pre-multiplies the scores and reuses the one
//                FMA exponent loop (D = 128), or compiles a loop per form (D = 64): each chosen
//                by timing both where it is used (measured: docs/log/2026-11-notebook.md, "one
//                exponent loop").
//   kConvertV    e4m3: V converted to f16 in shared memory by the producer's spare warps (D =
//                64), or by a pre-pass the attention grid overlaps (D >= 128). The converting
//                warps take issue slots and shared-memory bandwidth that D >= 128 needs more.
//   kBN          keys per tile: 128, or 64 where two stages of 128-key K and V tiles and Q do
//                not fit (D = 192: Q 48 + O 48 + 2 x (K 24 + V 24) = 192 KB).
//   kAliasO      the output staging reuses Q's buffer (D = 256: Q 64 + 2 x (K 32 + V 32) =
//                192 KB leaves no room for O's 64 KB); Q is then released after the epilogue.
//                E4m3 Q is too small for O's staging, and leaves room for a buffer of its own:
//                Q 32 + O 64 + 2 x (K 16 + V 32 in f16) = 192 KB.
template <int D, bool kFp8>
struct Tuning;
template <bool kFp8>
struct Tuning<64, kFp8> {
  static constexpr int kWGs = 3;
  static constexpr int kStages = 3;
  static constexpr bool kPingPong = true;
  static constexpr bool kOneExpLoop = false;
  static constexpr bool kConvertV = true;
  static constexpr int kBN = 128;
  static constexpr bool kAliasO = false;
};
template <bool kFp8>
struct Tuning<128, kFp8> {
  static constexpr int kWGs = 2;
  static constexpr int kStages = kFp8 ? 3 : 2;
  static constexpr bool kPingPong = false;
  static constexpr bool kOneExpLoop = true;
  static constexpr bool kConvertV = false;
  static constexpr int kBN = 128;
  static constexpr bool kAliasO = false;
};
template <bool kFp8>
struct Tuning<192, kFp8> {
  static constexpr int kWGs = 2;
  static constexpr int kStages = 2;
  static constexpr bool kPingPong = false;
  static constexpr bool kOneExpLoop = true;
  static constexpr bool kConvertV = false;
  static constexpr int kBN = 64;
  static constexpr bool kAliasO = false;
};
template <bool kFp8>
struct Tuning<256, kFp8> {
  static constexpr int kWGs = 2;
  static constexpr int kStages = 2;
  static constexpr bool kPingPong = false;
  static constexpr bool kOneExpLoop = true;
  static constexpr bool kConvertV = false;
  static constexpr int kBN = 64;
  static constexpr bool kAliasO = !kFp8;
};

// Element types of one instantiation: QK for Q and K (the operands of S = Q·Kᵀ), PV for V and
// P in shared memory and registers (the operands of O = P·V), Out for O. The 16-bit kernels
// use one type throughout (Same<T>), or write O in f32 straight from the accumulator (F32Out:
// a partial result that is merged before it is rounded; Out then only sizes the unused
// staging area, so the shared-memory layout is Same<T>'s); e4m3 runs P·V in f16 (E4m3,
// accurate mode) or in e4m3 (E4m3Fast, fast mode). kDV_: V's and O's head dim where it is
// narrower than Q's and K's (SameDV; 0: the same), which their tiles then take. kWGs_: consumer
// warpgroups other than the tuning table's (0: the table's; WithWGs).
template <typename QK_, typename PV_, typename Out_, bool kConvertV_ = false, bool kF32Out_ = false,
          int kDV_ = 0, int kWGs_ = 0>
struct Elems {
  using QK = QK_;
  using PV = PV_;
  using Out = Out_;
  static constexpr bool kF32Out = kF32Out_;
  static constexpr int kDV = kDV_;
  static constexpr int kWGs = kWGs_;
  template <int W>
  using WithWGs = Elems<QK_, PV_, Out_, kConvertV_, kF32Out_, kDV_, W>;
  // E4M3: dequantization scales, and V converted to PV either by a pre-pass the attention grid
  // overlaps (kPrepass: programmatic launch, the grid waits before its first V load instead of
  // at the start), or in shared memory by the producer warpgroup's spare warps (kConvertV).
  static constexpr bool kFp8 = std::is_same_v<QK, cute::float_e4m3_t>;
  static constexpr bool kConvertV = kFp8 && kConvertV_;
  static constexpr bool kPrepass = kFp8 && !kConvertV_;
  // Fast mode: P rounded to e4m3 for an e4m3 P·V, whose B operand (V) must be K-major: the
  // pre-pass writes V transposed, [d][key] (v_prepass.cuh).
  static constexpr bool kFp8PV = std::is_same_v<PV, cute::float_e4m3_t>;
  static_assert(sizeof(Out) == 2, "O in a 16-bit type");
  static_assert(sizeof(PV) == 2 || (kFp8PV && kPrepass), "P·V in a 16-bit type, or e4m3 on V^T");
  static_assert(!(kF32Out && kFp8), "f32 output from 16-bit inputs only");
};
template <typename T>
using Same = Elems<T, T, T>;
template <typename T>
using F32Out = Elems<T, T, T, false, true>;
// 16-bit, V and O DV wide (DeepSeek's 192 / 128).
template <typename T, int DV>
using SameDV = Elems<T, T, T, false, false, DV>;

// E4M3 Q, K, V, O in Out. P·V in f16 for either output type (P rounded to f16 keeps 3 more bits
// than bf16; V's codes are exact in both).
template <typename Out, int D>
using E4m3 = Elems<cute::float_e4m3_t, cute::half_t, Out, Tuning<D, true>::kConvertV>;
// Fast mode: E4M3 Q, K, V and P, O in Out; V transposed by the pre-pass at every head dim. Two
// consumer warpgroups at every head dim: its two-level accumulation's second O does not fit
// the 160 registers three leave a consumer at D = 64 (ptxas spills).
template <typename Out>
using E4m3Fast = Elems<cute::float_e4m3_t, cute::float_e4m3_t, Out, false, false, 0, 2>;

// The widest GMMA K-major swizzle atom whose row (128, 64 or 32 bytes) divides a row of D
// elements of T: 128 bytes for the 16-bit types and e4m3 at D = 128, 64 bytes for e4m3 at
// D = 64.
template <typename T, int D>
using KAtom =
    std::conditional_t<D * sizeof(T) % 128 == 0, GMMA::Layout_K_SW128_Atom<T>,
                       std::conditional_t<D * sizeof(T) % 64 == 0, GMMA::Layout_K_SW64_Atom<T>,
                                          GMMA::Layout_K_SW32_Atom<T>>>;

// Global tensors as TMA sees them: (seq, d, head, batch), d contiguous. The d extent is the
// problem's (at most D): a narrower operand's columns past it land as zeros (TMA's
// out-of-bounds fill), so the kernel of head dim D runs narrower head dims (mask::narrowed).
template <typename T, int D>
using GTensorOf = decltype(make_tensor(make_gmem_ptr(static_cast<const T*>(nullptr)),
                                       std::declval<Shape<int, int, int, int>>(),
                                       std::declval<Stride<int64_t, _1, int64_t, int64_t>>()));

// Fast mode's V^T as TMA sees it: (d, key, head, batch), keys contiguous.
template <typename T, int D>
using GTensorTOf = decltype(make_tensor(make_gmem_ptr(static_cast<const T*>(nullptr)),
                                        std::declval<Shape<Int<D>, int, int, int>>(),
                                        std::declval<Stride<int64_t, _1, int64_t, int64_t>>()));

// V^T in shared memory, (D, BN, stages): 16-bit V's rows seen as [d][key], MN-major; fast
// mode's transposed V, K-major (made lazily: each form compiles for its own element type only).
template <typename PV, int D, int BN, int S, bool kKMajor>
struct VtLayout {
  using type = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<PV>{},
                                      Shape<Int<D>, Int<BN>, Int<S>>{}, Step<_2, _1, _3>{}));
};
template <typename PV, int D, int BN, int S>
struct VtLayout<PV, D, BN, S, true> {
  using type = decltype(tile_to_shape(KAtom<PV, BN>{}, Shape<Int<D>, Int<BN>, Int<S>>{}));
};

template <class E, int D>
struct TileConfig {
  using QK = typename E::QK;
  using PV = typename E::PV;
  using Out = typename E::Out;
  using Tune = Tuning<D, E::kFp8>;
  // Consumer warpgroups at most, each 64 query rows.
  static constexpr int kWG = E::kWGs > 0 ? E::kWGs : Tune::kWGs;
  static constexpr int kThreads = 128 * (kWG + 1);  // + the producer warpgroup
  static constexpr int kBM = 64 * kWG;
  static constexpr int kBN = Tune::kBN;
  static constexpr int kHD = D;
  // V's and O's head dim: D, or narrower (SameDV): V's tiles, O's accumulators and its staging.
  static constexpr int kDV = E::kDV > 0 ? E::kDV : D;
  static_assert(kDV <= D && kDV % 64 == 0, "V rows of whole 128-byte swizzle atoms");
  static_assert(kDV == D || !E::kFp8, "e4m3 kernels take one head dim");
  static constexpr bool kAliasO = Tune::kAliasO;
  static_assert(!(kAliasO && E::kFp8), "O staging reuses a 16-bit Q buffer");
  static constexpr int kStages = Tune::kStages;
  static constexpr bool kPingPong = Tune::kPingPong;
  // kConvertV: e4m3 V tiles land by TMA in a ring of their own, unswizzled rows of D bytes, for
  // the converting warps to read.
  static constexpr int kV8Stages = 2;
  static constexpr int kConverters = 96;  // producer warps 1-3 (warp 0 issues the TMA loads)
  // Partly masked V tiles of one query tile the non-finite V check records: those a block's
  // diagonal crosses (two where kBM <= kBN), as many again across a band's lower edge; the band
  // kernel keeps two tiles' records (its check runs a tile ahead of the consumers).
  static constexpr int kCrossTiles = (kBM + kBN - 1) / kBN + 1;
  static constexpr int kTileSlots = 2 * kCrossTiles;
  static constexpr int kCheckSlots = 2 * kTileSlots;
  using BM = Int<kBM>;
  using BN = Int<kBN>;
  using HD = Int<D>;
  using HDV = Int<kDV>;
  using Stages = Int<kStages>;

  // The warpgroups tile M: warpgroup w owns rows [64w, 64w + 64) of S and O.
  using MmaQK =
      decltype(make_tiled_mma(SM90::GMMA::ss_op_selector<QK, QK, float, Shape<_64, BN, HD>,
                                                         GMMA::Major::K, GMMA::Major::K>(),
                              Layout<Shape<Int<kWG>, _1, _1>>{}));
  static constexpr auto kMajorV = E::kFp8PV ? GMMA::Major::K : GMMA::Major::MN;
  using MmaPV = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<PV, PV, float, Shape<_64, HDV, BN>, GMMA::Major::K, kMajorV>(),
      Layout<Shape<Int<kWG>, _1, _1>>{}));

  // Shared memory layouts: Q and K rows of D elements in swizzle atoms of 8 rows (KAtom). 16-bit
  // V: rows of 64 elements (128 bytes) with the 128-byte swizzle, stacked 8 rows to an atom; Vt
  // is the same bytes seen as [d][key] for the MN-major B operand of P·V. Fast mode: Vt is the
  // pre-pass's transposed V, rows of BN keys (128 bytes), K-major (LayoutV goes unused).
  using LayoutQ = decltype(tile_to_shape(KAtom<QK, D>{}, Shape<BM, HD>{}));
  using LayoutK = decltype(tile_to_shape(KAtom<QK, D>{}, Shape<BN, HD, Stages>{}));
  using LayoutVt = typename VtLayout<PV, kDV, kBN, kStages, E::kFp8PV>::type;
  using LayoutV = decltype(composition(
      LayoutVt{}, make_layout(Shape<BN, HDV, Stages>{}, Stride<HDV, _1, Int<kDV * kBN>>{})));

  // P as the A operand of P·V, over the registers of the S accumulator. S per thread is
  // ((2 cols, 2 rows, BN/8 col groups), 1, 1), compact, whatever QK is. 16-bit P: the A fragment
  // of one 16-key step is ((2 cols, 2 rows, 2 col groups)), so key step kb takes col groups 2kb
  // and 2kb + 1, in place. E4m3 P: the fragment of a 32-key step is ((4 cols, 2 rows, 2 col
  // halves)), packed by convert_p from the step's 4 col groups (softmax.cuh) with its keys in
  // the order the pre-pass gives V^T's (v_prepass.cuh).
  using LayoutP = std::conditional_t<
      E::kFp8PV,
      Layout<Shape<Shape<_4, _2, _2>, _1, Int<kBN / 32>>, Stride<Stride<_1, _4, _8>, _0, _16>>,
      Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBN / 16>>, Stride<Stride<_1, _2, _4>, _0, _8>>>;

  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorOf<QK, D>>(), LayoutQ{},
                                      Shape<BM, HD>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorOf<QK, D>>(),
                                      take<0, 2>(LayoutK{}), Shape<BN, HD>{}, _1{}));
  using LayoutV8 =
      Layout<Shape<BN, HD, Int<kV8Stages>>, Stride<HD, _1, Int<kBN * D>>>;  // kConvertV's ring
  // (Each branch's type is formed whichever is chosen: all read V at kDV, which the e4m3 kernels
  // keep at D.)
  using TmaV = std::conditional_t<
      E::kConvertV,
      decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorOf<QK, D>>(),
                             take<0, 2>(LayoutV8{}), Shape<BN, HD>{}, _1{})),
      std::conditional_t<E::kFp8PV,
                         decltype(make_tma_copy(SM90_TMA_LOAD{},
                                                std::declval<GTensorTOf<PV, kDV>>(),
                                                take<0, 2>(LayoutVt{}), Shape<HDV, BN>{}, _1{})),
                         decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorOf<PV, D>>(),
                                                take<0, 2>(LayoutV{}), Shape<BN, HDV>{}, _1{}))>>;

  // kConvertV's e4m3 V ring, a base of Smem (empty, so of no size, in the other kernels).
  struct V8Ring {
    alignas(1024) QK v8[kV8Stages * kBN * D];
  };
  struct NoRing {};
  // The output staging, 64 rows per consumer warpgroup: its own buffer, or (kAliasO) Q's.
  struct OStage {
    alignas(1024) Out o[kBM * kDV];
  };
  struct NoOStage {};
  struct Smem : std::conditional_t<E::kConvertV, V8Ring, NoRing>,
                std::conditional_t<kAliasO, NoOStage, OStage> {
    alignas(1024) QK q[kBM * D];
    alignas(1024) QK k[kStages * kBN * D];
    alignas(1024) PV v[kStages * kBN * kDV];
    alignas(8) uint64_t bar_q;
    uint64_t empty_q;
    uint64_t full_k[kStages];
    uint64_t full_v[kStages];
    uint64_t empty_k[kStages];
    uint64_t empty_v[kStages];
    uint64_t full_v8[kV8Stages];  // kConvertV only (within the struct's alignment padding)
    uint64_t empty_v8[kV8Stages];
    // Non-finite V check (nonfinite_v.cuh), masked kernels: V tiles partly masked for the query
    // tile land on full_vd instead of full_v, are checked by the producer's spare warps, which
    // then arrive on checked_v, and the consumers wait for that (kConvertV: the converting warps
    // check, full_v as for every tile). These are the first ring uses of the CTA's one query tile
    // (TileKeys::key_tile): at most two for causal (phase 0 of both barriers of stages 0 and 1),
    // at most four for a band (its lower edge's too), and full_v's phases on those stages run
    // behind by as many. Per checked use (a slot): nf_any, whether its tile had any non-finite
    // value, nf the first key of each kind per column, and for a band nf_last the last.
    uint64_t full_vd[kStages];
    uint64_t checked_v[kStages];
    // Kernels on the tile feed: their work tiles as the producer hands them out (tile_feed.cuh),
    // and the hand-over of each tile's records (slots kTileSlots * (tile % 2) on): the check has
    // written them (nf_ready), the consumers have read them (nf_free).
    uint64_t feed_full[2], feed_empty[2];
    uint64_t nf_ready[2], nf_free[2];
    alignas(16) uint32_t feed_slot[2][12];  // a TileRecord each (tile_keys.cuh)
    uint32_t feed_next;                     // the producer's next feed index
    uint32_t nf_any[kCheckSlots];
    NonFiniteCols<kDV> nf[kCheckSlots];
    NonFiniteCols<kDV> nf_last[kCheckSlots];
  };
  // Where the epilogue stages warpgroup rows of O.
  __device__ __forceinline__ static Out* staging(Smem& sm) {
    if constexpr (kAliasO)
      return reinterpret_cast<Out*>(sm.q);
    else
      return sm.o;
  }
  // +1 KB: the kernel aligns the dynamic smem base up to 1024 bytes (128-byte swizzle atoms).
  static constexpr int kSmemBytes = int(sizeof(Smem)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory over the sm_90 per-CTA limit");
};

// The element types the band kernel (the general path) of E runs on: E, with two consumer
// warpgroups where the table gives more. Its short rows (windows, varlen) want the tile feed's
// persistent grid, whose producer registers two warpgroups afford, and its mask and mods more
// registers than three leave a consumer.
template <class E, int D>
using BandElems =
    std::conditional_t<TileConfig<E, D>::kWG == 2, E, typename E::template WithWGs<2>>;

// Aligns the dynamic shared memory base up to 1024 bytes.
template <class Smem>
__device__ __forceinline__ Smem& smem_storage() {
  extern __shared__ uint8_t smem_raw[];
  return *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                  ~uintptr_t(1023));
}

}  // namespace sdpa::cutlass_sm90
