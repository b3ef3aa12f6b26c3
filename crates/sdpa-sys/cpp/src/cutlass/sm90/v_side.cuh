// The sm_90a kernel's work on V beside the loads, by the producer warpgroup's spare warps:
// e4m3 V converted to f16 in shared memory (kConvertV), the non-finite V check of partly masked
// V tiles; and the consumers' side of that check, the non-finite terms added to O after the
// tile's last P·V.
#pragma once

#include "common/launch.cuh"
#include "cutlass/sm90/kernel_traits.cuh"
#include "cutlass/sm90/nonfinite_v.cuh"
#include "cutlass/sm90/softmax.cuh"
#include "cutlass/sm90/tile_keys.cuh"
#include "cutlass/sm90/v_prepass.cuh"

namespace sdpa::cutlass_sm90 {

template <class E, int D, class Mask>
struct VSide {
  using T = KernelTraits<E, D, Mask>;
  using K = TileKeys<E, D, Mask>;
  using C = typename T::C;
  using PV = typename E::PV;
  using Sched = typename T::Sched;
  using Params = typename T::Params;
  using Walk = typename T::Walk;
  static constexpr int BM = T::BM, BN = T::BN, S = T::S;
  static constexpr bool kBand = T::kBand, kTracked = T::kTracked;

  // kConvertV, producer warps 1-3 (thread ct of C::kConverters): each e4m3 V tile of the ring, 8
  // codes a thread and step (8-byte reads along the unswizzled rows, 16-byte writes into the
  // swizzled f16 tile: both free of bank conflicts), into the f16 V stage the consumers read, in
  // the order the TMA thread loads; the non-finite V check on the partly masked ones.
  __device__ __forceinline__ static void convert_v(const Params& p,
                                                   const typename Sched::Params& sp,
                                                   typename C::Smem& sm, int ct) {
    const uint32_t v8 = uint32_t(__cvta_generic_to_shared(sm.v8));
    const uint32_t v16 = uint32_t(__cvta_generic_to_shared(sm.v));
    // CuTe's GMMA atoms keep their swizzle apart from the element layout and apply it to the
    // shared-memory byte address (1024-aligned base), as done here in 32 bits.
    constexpr auto kSwizzle = get_swizzle_portion(typename C::LayoutV{});
    constexpr auto kFlatV = get_nonswizzle_portion(typename C::LayoutV{});
    constexpr int S8 = C::kV8Stages;
    int it = 0;
    const auto make = [&](int t) { return K::record(p, sp, t); };
    const auto run_tile = [&](const TileRecord& r, uint32_t /*at*/) __attribute__((always_inline)) {
      const KeyTiles kt = r.kt;
      for (int n = 0; n < kt.n_tiles; ++n, ++it) {
        const PipelineState<S> use{it};
        const PipelineState<S8> use8{it};
        const int s = use.stage(), s8 = use8.stage();
        T::v8_ring(sm).wait(use8);
        T::v_ring(sm).ring.acquire(use);
        // The thread's columns recomputed per tile from an opaque index: fewer registers held
        // across the loop. nan8: non-finite V, a NaN code among this thread's.
        int ci = ct;
        asm volatile("" : "+r"(ci));
        const bool nan8 = convert_e4m3_tile<BN, D, C::kConverters, false, true>(
            v8 + uint32_t(s8 * BN * D), ci, [&](int key, int d) __attribute__((always_inline)) {
              return kSwizzle(v16 + uint32_t(kFlatV(key, d, s) * sizeof(PV)));
            });
        // The check, on the converted tile (its barrier is also the one after which every
        // converted value is visible to all).
        if (K::key_tile(n, kt) >= kt.n_first)
          settle_nonfinite<C>(sm, s, s, nan8, ct, kCheckBarrier);
        // These generic-proxy writes must be visible to the wgmmas (async proxy).
        cutlass::arch::fence_view_async_shared();
        T::v8_ring(sm).release(use8);
        T::v_ring(sm).ring.commit(use);
      }
    };
    Walk::follow(sp, sm, make, run_tile);
  }

  // Masked kernels without kConvertV, producer warps 1-3 (thread ct of C::kConverters): the
  // non-finite V check of each partly masked V tile, once TMA has landed it, before the
  // consumers' P·V (they wait on checked_v for those tiles). A query tile walks its keys as
  // key_tile says: its partly masked tiles are its first ring uses (two across the diagonal, a
  // band's lower edge adds up to two more, which take the stages again), each recorded in its own
  // slot. The causal kernel runs one tile a CTA: full_vd's phases follow its uses. The band
  // kernel walks the tile feed: full_vd's phase per stage is tracked (only checked uses complete
  // it), and each tile's records take the slots of its parity once the consumers have read the
  // tile's two back (nf_free), and are announced as complete (nf_ready).
  __device__ __forceinline__ static void check_v(const Params& p, const typename Sched::Params& sp,
                                                 typename C::Smem& sm, int ct) {
    static_assert(S >= 2);
    const uint32_t v16 = uint32_t(__cvta_generic_to_shared(sm.v));
    int it = 0, nt = 0;  // ring uses and tiles with queries so far
    PhaseBits landed;    // kTracked: bit s, the phase of stage s's landed barrier
    const auto make = [&](int t) {
      asm volatile("" : "+r"(t));  // opaque: nothing shared with the TMA thread's registers
      return K::record(p, sp, t);
    };
    const auto run_tile = [&](const TileRecord& r, uint32_t at) __attribute__((always_inline)) {
      const Seq<int> seq = K::seq(p, r.w, at);
      const KeyTiles kt = r.kt;
      const int n_checked = K::checked_uses(kt);
      const int slot0 = kTracked ? (nt & 1) * C::kTileSlots : 0;
      if constexpr (kTracked) T::records(sm).acquire(nt);
      for (int u = 0; u < n_checked; ++u) {
        const PipelineState<S> use{it + u};
        const int s = use.stage();
        T::v_ring(sm).wait_landed(use, landed);
        const uint32_t tile = v16 + uint32_t(s * BN * C::kDV * sizeof(PV));
        // Rows past the sequence's keys (packed K/V: the next sequence's) are zeroed unrecorded.
        const int real_keys = seq.seq_k - K::key_tile(u, kt) * BN;
        const bool any = settle_nonfinite<C, kBand>(
            sm, s, slot0 + u, scan_nonfinite<PV, BN, C::kDV>(tile, ct, C::kConverters), ct,
            kCheckBarrier, real_keys);
        if (any) cutlass::arch::fence_view_async_shared();  // the zeros, for the wgmmas
        T::v_ring(sm).commit_checked(use);
      }
      if constexpr (kTracked) T::records(sm).commit(nt);
      it += kt.n_tiles;
      ++nt;
    };
    Walk::follow(sp, sm, make, run_tile);
  }

  // A consumer thread's O elements' (row, col) in the row/col view, from an opaque copy of its
  // index: made where the rare path needs them, not held across the main loop.
  __device__ __forceinline__ static auto o_coords(int ctid) {
    int etid = ctid;
    asm volatile("" : "+r"(etid));
    typename C::MmaPV mma_pv;
    Tensor cO = mma_pv.get_thread_slice(etid).partition_C(
        make_identity_tensor(Shape<Int<BM>, Int<C::kDV>>{}));
    return make_tensor(cO.data(), rowcol(cO.layout()));
  }

  // After the tile's last P·V: the non-finite values the check took out of its partly masked V
  // tiles, added once rather than after each tile's P·V (the terms are NaN or ±Inf, which the
  // rescaling in between keeps as they are). Those tiles were the tile's first ring uses (stages
  // 0 and 1), and only they write records, so the records are all still there, from slot0 (the
  // slots of the tile's parity; 0 where a CTA runs one tile).
  template <class TO>
  __device__ __forceinline__ static void add_masked_nonfinite(const Params& p, const WorkTile& w,
                                                              typename C::Smem& sm,
                                                              const Mask& mask, int m0,
                                                              const KeyTiles& kt, TO& tOrO,
                                                              int ctid, int slot0) {
    if constexpr (E::kFp8PV) {
      // The unmasked kernel keeps V's NaN codes (every row sees every key): no table.
      if constexpr (Mask::kMasksKeys)
        if (p.nan_first != nullptr) add_nan_columns(p, w, mask, m0, tOrO, ctid);
    } else if constexpr (kBand) {
      Tensor O = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
      for (int u = 0; u < kt.n_cross; ++u) {  // check slot slot0 + u: the tile's ring use u
        if (!sm.nf_any[slot0 + u]) continue;
        add_band_nonfinite_terms(O, o_coords(ctid), sm.nf[slot0 + u], sm.nf_last[slot0 + u], mask,
                                 m0, K::key_tile(u, kt) * BN);
      }
    } else if constexpr (Mask::kMasksKeys) {
      Tensor O = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
      for (int j = kt.n_first; j < kt.n_tiles; ++j) {
        // Check slot: slot0 + the tile's ring use (key_tile is an involution here).
        const int sv = slot0 + K::key_tile(j, kt);
        if (!sm.nf_any[sv]) continue;
        add_nonfinite_terms(O, o_coords(ctid), sm.nf[sv], mask, m0, j * BN);
      }
    }
  }

  // Fast mode, masked kernels: O set to NaN where a row sees a key whose V code in that column
  // was a NaN, which the pre-pass wrote as zero and recorded (nan_table_words). The table is the
  // pre-pass's output: these threads wait for it too (at once: the producer already has).
  template <class TO>
  __device__ __forceinline__ static void add_nan_columns(const Params& p, const WorkTile& w,
                                                         const Mask& mask, int m0, TO& tOrO,
                                                         int ctid) {
    pdl_wait();
    const uint32_t* table =
        p.nan_first + (int64_t(w.b) * p.kv_heads + p.div_group.div(w.h)) * nan_table_words(D);
    const uint32_t first = __ldg(table);
    if (first == ~0u || int64_t(first) > mask.last_key(m0 + BM - 1)) return;
    Tensor O = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
    const auto cO = o_coords(ctid);
    CUTE_UNROLL
    for (int r = 0; r < size<0>(O); ++r) {
      const int64_t last = mask.last_key(m0 + get<0>(cO(r, 0)));
      CUTE_UNROLL
      for (int c = 0; c < size<1>(O); ++c)
        if (int64_t(__ldg(table + 1 + get<1>(cO(r, c)))) <= last) O(r, c) = NAN;
    }
  }
};

}  // namespace sdpa::cutlass_sm90
