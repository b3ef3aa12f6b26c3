// What the roles of one sm_90a kernel (element types E, head dim D, mask Mask) share: the
// constants that choose its paths, its parameters, its pipelines over the barriers in shared
// memory, and the walk over its work tiles.
#pragma once

#include "common/mask.cuh"
#include "cutlass/sm90/mainloop_params.cuh"
#include "cutlass/sm90/pipeline.cuh"
#include "cutlass/sm90/score_mod.cuh"
#include "cutlass/sm90/seq_layout.cuh"
#include "cutlass/sm90/tile_config.cuh"
#include "cutlass/sm90/tile_scheduler.cuh"

namespace sdpa::cutlass_sm90 {

// Named barriers (0 is __syncthreads).
enum NamedBarrier : int {
  kTurnBarrier = 1,      // + w: consumer warpgroup w may issue (turns)
  kEpilogueBarrier = 4,  // + w: warpgroup w's output staging
  kCheckBarrier = 7,     // the producer's spare warps (non-finite V check)
  kStagingBarrier = 8,   // kAliasO: every consumer warpgroup is done reading Q
};

template <class E, int D, class Mask>
struct KernelTraits {
  using C = TileConfig<E, D>;
  using Sched = TileScheduler<Mask::kMasksKeys>;
  using Params = MainloopParams<E, D>;
  static constexpr int BM = C::kBM, BN = C::kBN, S = C::kStages;
  static constexpr int kLog2BN = BN == 128 ? 7 : 6;
  static_assert(BN == 1 << kLog2BN);
  // A band mask (windows, top-left causal): a lower edge inside a block's key range, so partly
  // masked key tiles at both ends of it.
  static constexpr bool kBand = mask::kIsBand<Mask>;
  static_assert(!(kBand && E::kConvertV), "no band kernel for e4m3 V converted in shared memory");
  // The kernels' tiers: the band kernel is the general path, and its score mods and sequence
  // layout are the call's, chosen at run time; the plain kernels (no mask, causal bottom-right)
  // run dense sequences without mods (mask::needs_band routes every other call to the band).
  using Mods = std::conditional_t<kBand, CapAlibiMod, NoScoreMod>;
  using Seqs = std::conditional_t<kBand, VarSeqs<kLog2BN>, DenseSeqs>;

  // Whether the masked (causal, band) 16-bit kernels walk the tile feed (a persistent grid where
  // there is a counter): up to D = 128, with two consumer warpgroups. At D = 192 and 256 the
  // producer's TMA thread, which issues three or four copies a tile, has no registers left for
  // the walk (ptxas spills); with three consumer warpgroups the feed's 48 producer registers
  // leave a consumer 152, where the causal kernel spills and runs slower than on one tile a CTA
  // (measured: docs/log/2026-11-notebook.md, "three consumer warpgroups"); and the e4m3 kernels
  // keep their one tile a CTA: they run one tile a CTA.
  static constexpr bool kFeed = Mask::kMasksKeys && !E::kFp8 && D <= 128 && C::kWG == 2;
  // Whether a CTA runs one work tile only: the masked kernels without the feed. The unmasked
  // kernel walks its tiles statically (a persistent grid).
  static constexpr bool kOneTile = Mask::kMasksKeys && !kFeed;
  // Whether the non-finite V check's records and the V barriers' phases are tracked across
  // tiles (check_v, mma): the kernels on the feed, and the band kernel always (one code path).
  static constexpr bool kTracked = kFeed || kBand;
  // Whether the producer's spare warps check partly masked V tiles for non-finite values: the
  // masked kernels, except where V's e4m3 codes are checked as they are converted (kConvertV)
  // and fast mode, whose pre-pass took V's NaN codes out (add_nan_columns).
  static constexpr bool kChecksV = Mask::kMasksKeys && !E::kConvertV && !E::kFp8PV;

  // Whether the consumer warpgroups may take turns issuing (Params::turns decides per launch):
  // where the tuning table allows them, and in the band kernel on the tile feed, whose short
  // query tiles' starts and ends they stagger (compiled into the D = 128 causal kernel, they
  // slow it even when off; measured: docs/log/2026-11-notebook.md, "turns on the D = 128 feed").
  static constexpr bool kTurns = C::kPingPong || (kFeed && kBand);

  // The walk over the CTA's work tiles every role takes (the tile feed, or the static walk).
  using Walk = TileWalk<kFeed, kOneTile>;

  // How the V ring's phases follow from its uses (VRing): the check's detour, tracked across
  // tiles or following from the uses of one.
  static constexpr VCheck kVCheck = !kChecksV  ? VCheck::kNone
                                    : kTracked ? VCheck::kTracked
                                    : BN < BM  ? VCheck::kOneTileMany
                                               : VCheck::kOneTile;

  // The CTA's pipelines over its barriers in shared memory, each made where it is used: a
  // bundle of them made once and held across a loop makes the compiler lay the loop out
  // otherwise (and larger).
  using Smem = typename C::Smem;
  __device__ __forceinline__ static Ring<S> k_ring(Smem& sm) { return {sm.full_k, sm.empty_k}; }
  __device__ __forceinline__ static VRing<S, kVCheck> v_ring(Smem& sm) {
    return {{sm.full_v, sm.empty_v}, sm.full_vd, sm.checked_v};
  }
  // kConvertV: the e4m3 V tiles, for the converting warps.
  __device__ __forceinline__ static Ring<C::kV8Stages> v8_ring(Smem& sm) {
    return {sm.full_v8, sm.empty_v8};
  }
  __device__ __forceinline__ static Handoff<1> q_slot(Smem& sm) { return {&sm.bar_q, &sm.empty_q}; }
  // kTracked: the check's records of a query tile, in the check slots of its parity: written
  // (full) and read by the consumers (empty).
  __device__ __forceinline__ static Handoff<2> records(Smem& sm) {
    return {sm.nf_ready, sm.nf_free};
  }
};

}  // namespace sdpa::cutlass_sm90
