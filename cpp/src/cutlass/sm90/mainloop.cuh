// The sm_90a kernel's mainloop: the producer warpgroup's loads (TMA into the K/V ring), its
// spare warps' work on V (e4m3 conversion, the non-finite V check), and the consumers' wgmma
// rounds over the ring with the online softmax in between.
#pragma once

#include <cutlass/arch/barrier.h>

#include <type_traits>

#include "common/launch.cuh"
#include "common/mask.cuh"
#include "common/seqs.cuh"
#include "cutlass/sm90/nonfinite_v.cuh"
#include "cutlass/sm90/pipeline.cuh"
#include "cutlass/sm90/primitives.cuh"
#include "cutlass/sm90/softmax.cuh"
#include "cutlass/sm90/tile_config.cuh"
#include "cutlass/sm90/tile_feed.cuh"
#include "cutlass/sm90/tile_scheduler.cuh"
#include "cutlass/sm90/v_prepass.cuh"

namespace sdpa::cutlass_sm90 {

// Named barriers (0 is __syncthreads).
enum NamedBarrier : int {
  kTurnBarrier = 1,      // + w: consumer warpgroup w may issue (turns)
  kEpilogueBarrier = 3,  // + w: warpgroup w's output staging
  kCheckBarrier = 5,     // the producer's spare warps (non-finite V check)
  kStagingBarrier = 6,   // kAliasO: both consumer warpgroups are done reading Q
};

// The key tiles of one query tile: how many it sees, and from which on they are partly masked
// (n_tiles where none is). A band's tiles start at `begin`, and its n_cross partly masked ones
// (n_upper across the diagonal, the rest across the lower edge) are visited first.
struct KeyTiles {
  int n_tiles, n_first;
  int begin, n_cross, n_upper;
};

// A consumer thread's view of its operands: the wgmma descriptors of Q, K and V in shared memory
// and the (row, col) of each S element it holds (Mainloop::consumer_operands makes it).
template <class TQ, class TK, class TV, class TC>
struct ConsumerOperands {
  TQ q;
  TK k;
  TV v;
  TC coords;
  __device__ __forceinline__ ConsumerOperands(TQ q_, TK k_, TV v_, TC c_)
      : q(q_), k(k_), v(v_), coords(c_) {}
};

template <class E, int D, class Mask>
struct Mainloop {
  using C = TileConfig<E, D>;
  using QK = typename E::QK;
  using PV = typename E::PV;
  using Sched = TileScheduler<Mask::kMasksKeys>;
  static constexpr int BM = C::kBM, BN = C::kBN, S = C::kStages;
  static constexpr int kLog2BN = BN == 128 ? 7 : 6;
  static_assert(BN == 1 << kLog2BN);
  // The general path: a band mask (windows, top-left causal) with softcap and ALiBi.
  static constexpr bool kBand = mask::kIsBand<Mask>;
  static_assert(!(kBand && E::kConvertV), "no band kernel for e4m3 V converted in shared memory");

  // 32-bit sizes, rows and keys (offsets are 64-bit): can_implement (sm90_fwd.cuh) keeps seq_q,
  // seq_k <= 2^31 - 128 (row and key indices reach a tile past the end) and masked seq_q + seq_k
  // <= 2^31 - 1 (the producer's diagonal).
  struct Params {
    typename C::TmaQ tma_q;
    typename C::TmaK tma_k;
    typename C::TmaV tma_v;
    int seq_q, seq_k, heads, kv_heads, batch;
    float scale_log2;  // scale * log2(e)
    int turns;         // 1: the two consumers take turns issuing (C::kPingPong)
    FastDiv div_group;
    // E4M3 only: dequantization scales, one per tensor or one per (batch, head) (per_head).
    const float *q_scale, *k_scale, *v_scale;
    int per_head;
    // Band only: the band (mask::Band's diag, left, right, top_left) and the score mods:
    // softcap · log2 e (0: none), ALiBi slopes (null: none) of (b, h) at b * alibi_bstride + h.
    int diag, left, right, top_left;
    float cap2;
    const float* alibi;
    int alibi_bstride;
    // Band only: sequences of different lengths (dense: none). Packed Q, K and V are TMA
    // tensors of one batch entry whose rows start at each sequence's offset; a paged cache's
    // pages hold whole key tiles (can_implement), found through the block table per tile.
    SeqParams seqs;
    // Fast mode: V^T's keys a row (v_prepass.cuh), and the masked kernels' table of the NaN
    // codes the pre-pass took out of V (null: none).
    int keys_t;
    const uint32_t* nan_first;
  };
  // Whether the masked (causal, band) 16-bit kernels walk the tile feed (a persistent grid where
  // there is a counter): up to D = 128. At D = 192 and 256 the producer's TMA thread, which
  // issues three or four copies a tile, has no registers left for the walk (ptxas spills), and
  // the e4m3 kernels keep their one tile a CTA: they run one tile a CTA.
  static constexpr bool kFeed = Mask::kMasksKeys && !E::kFp8 && D <= 128;
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

  // The walk over the CTA's work tiles every role takes (the tile feed, or the static walk).
  using Walk = TileWalk<kFeed, kOneTile>;

  // How the V ring's phases follow from its uses (VRing): the check's detour, tracked across
  // tiles or following from the uses of one.
  static constexpr VCheck kVCheck = !kChecksV  ? VCheck::kNone
                                    : kTracked ? VCheck::kTracked
                                    : BN < BM  ? VCheck::kOneTileMany
                                               : VCheck::kOneTile;

  // The CTA's pipelines over its barriers in shared memory.
  struct Pipes {
    Ring<S> k;
    VRing<S, kVCheck> v;
    Ring<C::kV8Stages> v8;  // kConvertV: the e4m3 V tiles, for the converting warps
    Handoff<1> q;
    // kTracked: the check's records of a query tile, in the check slots of its parity: written
    // (full) and read by the consumers (empty).
    Handoff<2> records;
  };
  __device__ __forceinline__ static Pipes pipes(typename C::Smem& sm) {
    return {{sm.full_k, sm.empty_k},
            {{sm.full_v, sm.empty_v}, sm.full_vd, sm.checked_v},
            {sm.full_v8, sm.empty_v8},
            {&sm.bar_q, &sm.empty_q},
            {sm.nf_ready, sm.nf_free}};
  }

  // Work tile w's sequence: its rows in the packed tensors and its lengths (the call's for
  // dense sequences, which every kernel but the band kernel runs). Read afresh (an opaque b)
  // wherever it is needed rather than held in registers across the main loop.
  __device__ __forceinline__ static Seq<int> seq_of_tile(const Params& p, const WorkTile& w) {
    if constexpr (kBand) {
      int b = w.b;
      asm volatile("" : "+r"(b));
      return seq_of<int>(p.seqs, b, p.seq_q, p.seq_k);
    } else {
      return {0, 0, p.seq_q, p.seq_k};
    }
  }

  // Whether work tile w (rows from m0) lies past its sequence's queries, or is none
  // (TileScheduler): every role of the CTA skips it (a grid covers the longest sequence).
  __device__ __forceinline__ static bool past_end(const Seq<int>& seq, int m0) {
    return kBand && (m0 < 0 || m0 >= seq.seq_q);
  }

  // The mask of one sequence (the band rebased to its lengths: the call's own for dense ones).
  __device__ __forceinline__ static Mask mask_of(const Params& p, const Seq<int>& seq) {
    if constexpr (kBand)
      return Mask{p.seq_q, p.seq_k, p.diag, p.left, p.right, p.top_left != 0}.rebased(seq.seq_q,
                                                                                      seq.seq_k);
    else
      return Mask{seq.seq_q, seq.seq_k};
  }

  // Where key tile j of sequence b lies among the BN-row tiles of K's and V's TMA tensor from
  // the sequence's first row: tile j itself, or for a paged cache the tile its page holds it
  // as (pages hold whole tiles; the cache's rows and the table's entries fit an int:
  // can_implement; the entry clamped into the cache like every metadata value, seqs.cuh).
  // Recomputed per copy from an opaque b: the producer thread holds nothing of the block table
  // across its loop.
  __device__ __forceinline__ static int key_tile_at(const Params& p, int b, int j) {
    if constexpr (kBand) {
      if (p.seqs.paged()) {
        asm volatile("" : "+r"(b));
        const int shift = p.seqs.page_shift - kLog2BN;  // tiles a page: 1 << shift
        const int last = int(p.seqs.kv_rows >> p.seqs.page_shift) - 1;
        const int entry =
            __ldg(p.seqs.block_table + (b * int(p.seqs.pages_per_seq) + (j >> shift)));
        const int page = min(max(entry, 0), last);
        return (page << shift) | (j & ((1 << shift) - 1));
      }
    }
    return j;
  }

  // The key tiles of the query tile of `rows` rows from m0 of sequence `seq`.
  __device__ __forceinline__ static KeyTiles key_tiles(const Params& p, const Seq<int>& seq, int m0,
                                                       int rows) {
    const Mask mask = mask_of(p, seq);
    if constexpr (kBand) {
      const int begin = mask.key_begin(m0, rows) / BN;
      const int end = max(begin, (mask.key_end(m0, rows) + BN - 1) / BN);
      int upper = max(begin, min(end, mask.first_partial_tile(m0, BN, end)));
      // A last tile that runs past the sequence's keys holds rows TMA does not zero where the K/V
      // tensors go on (packed, paged or seqused_k): it is partly masked, and checked, too.
      const bool foreign_tail =
          p.seqs.cu_k != nullptr || p.seqs.used_k != nullptr || p.seqs.paged();
      if (foreign_tail && end > begin && end * BN > mask.seq_k) upper = min(upper, end - 1);
      const int lower = max(begin, min(upper, mask.lower_partial_end(m0, rows, BN)));
      return {end - begin, upper, begin, (end - upper) + (lower - begin), end - upper};
    } else {
      const int n_tiles = (mask.key_end(m0, rows) + BN - 1) / BN;
      return {n_tiles, mask.first_partial_tile(m0, BN, n_tiles), 0, 0, 0};
    }
  }

  // The key tile of a query tile's i-th ring use. Masked query tiles walk their keys from the
  // last: the (at most two) partly masked tiles, which the non-finite V check holds back, come
  // first, and their check runs while the consumers compute the first S = Q·Kᵀ and softmax
  // instead of sitting between the last V load and the last P·V. (The online softmax does not
  // depend on the order; rows that see nothing of the first tiles keep m = -inf and p = 0 until
  // they do.) A band visits its upper partly masked tiles from the last, then its lower ones,
  // then the rest from the last.
  __device__ __forceinline__ static int key_tile(int i, const KeyTiles& kt) {
    if constexpr (kBand) {
      const int end = kt.begin + kt.n_tiles;
      if (i < kt.n_upper) return end - 1 - i;
      if (i < kt.n_cross) return kt.begin + (i - kt.n_upper);
      return end - 1 - kt.n_upper - (i - kt.n_cross);
    } else {
      return Mask::kMasksKeys ? kt.n_tiles - 1 - i : i;
    }
  }

  // How many of a query tile's first ring uses the non-finite V check takes (partly masked).
  __device__ __forceinline__ static int checked_uses(const KeyTiles& kt) {
    if constexpr (kBand)
      return kt.n_cross;
    else
      return max(0, kt.n_tiles - kt.n_first);
  }

  __device__ __forceinline__ static void prefetch_descriptors(const Params& p) {
    prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
  }

  // Producer warp 0, one thread: Q once per work tile, K and V tiles into the ring. The K/V ring
  // position (`it`: uses of the ring so far) and the Q buffer's use count (`qi`) carry over
  // from tile to tile.
  __device__ __forceinline__ static void load(const Params& p, const typename Sched::Params& sp,
                                              typename C::Smem& sm) {
    Tensor sQ = make_tensor(make_smem_ptr(sm.q), typename C::LayoutQ{});  // (BM, D)
    Tensor sK = make_tensor(make_smem_ptr(sm.k), typename C::LayoutK{});  // (BN, D, stage)
    Tensor sV = make_tensor(make_smem_ptr(sm.v), typename C::LayoutV{});  // (BN, D, stage)
    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.seq_q, Int<D>{}, p.heads, p.batch));
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seq_k, Int<D>{}, p.kv_heads, p.batch));
    // V, or fast mode's V^T (d, key, head, batch).
    Tensor mV = [&]() {
      if constexpr (E::kFp8PV)
        return p.tma_v.get_tma_tensor(make_shape(Int<D>{}, p.keys_t, p.kv_heads, p.batch));
      else
        return p.tma_v.get_tma_tensor(make_shape(p.seq_k, Int<D>{}, p.kv_heads, p.batch));
    }();
    constexpr uint32_t kQBytes = BM * D * sizeof(QK);
    constexpr uint32_t kKBytes = BN * D * sizeof(QK);
    constexpr uint32_t kVBytes = BN * D * (E::kConvertV ? sizeof(QK) : sizeof(PV));
    const int bm = 64 * sp.wgs;
    int it = 0, qi = 0;  // qi: the tiles with queries so far (Q loads)
    // Work tile t's loads.
    Walk::template issue<E::kConvertV>(sp, sm, [&](int t) {
      const Pipes pp = pipes(sm);
      const WorkTile w = Sched::decode(sp, t);
      const int hk = p.div_group.div(w.h);
      const int m0 = w.m_block * bm;
      const Seq<int> seq = seq_of_tile(p, w);
      if (past_end(seq, m0)) return;
      const KeyTiles kt = key_tiles(p, seq, m0, bm);
      // Packed or paged tensors are one batch entry.
      const int qb = kBand && p.seqs.cu_q != nullptr ? 0 : w.b;
      const int kb = kBand && (p.seqs.cu_k != nullptr || p.seqs.paged()) ? 0 : w.b;
      // BM rows from row m0 (with 64-row tiles the upper half goes unused).
      Tensor gQ = local_tile(domain_offset(make_coord(seq.q0 + m0, _0{}), mQ(_, _, w.h, qb)),
                             Shape<Int<BM>, Int<D>>{}, make_coord(_0{}, _0{}));
      // K and V as tiles of BN rows from the sequence's first (key_tile_at).
      Tensor gK = local_tile(domain_offset(make_coord(seq.k0, _0{}), mK(_, _, hk, kb)),
                             Shape<Int<BN>, Int<D>>{}, make_coord(_, _0{}));
      Tensor gV = [&]() {
        if constexpr (E::kFp8PV)  // dense sequences only
          return local_tile(mV(_, _, hk, kb), Shape<Int<D>, Int<BN>>{}, make_coord(_0{}, _));
        else
          return local_tile(domain_offset(make_coord(seq.k0, _0{}), mV(_, _, hk, kb)),
                            Shape<Int<BN>, Int<D>>{}, make_coord(_, _0{}));
      }();
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
        } else if constexpr (E::kFp8PV) {
          Tensor sVt = make_tensor(make_smem_ptr(sm.v), typename C::LayoutVt{});  // (D, BN, stage)
          return tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sVt),
                               group_modes<0, 2>(gV));
        } else {
          return tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV),
                               group_modes<0, 2>(gV));
        }
      }();
      const auto load_q = [&]() {  // once the consumers are done with the previous Q
        pp.q.acquire(qi);
        uint64_t& full_q = pp.q.expect(qi, kQBytes);
        copy(p.tma_q.with(full_q), get<0>(tQ), get<1>(tQ));
      };
      // The causal and band kernels' first tile of a CTA loads Q first (nothing frees it); later
      // tiles, and every tile of the unmasked kernel, after K_0, which the previous tile frees at
      // about the same time.
      const bool q_first = kOneTile || kt.n_tiles == 0 || (kFeed && qi == 0);
      if (q_first) load_q();
      for (int n = 0; n < kt.n_tiles; ++n, ++it) {
        // Ring use `it`, which is n where a CTA runs one tile (one register less).
        const PipelineState<S> use{kOneTile ? n : it};
        const int s = use.stage();
        pp.k.acquire(use);
        uint64_t& full_k = pp.k.expect(use, kKBytes);
        const int j = key_tile(n, kt), jt = key_tile_at(p, w.b, j);
        copy(p.tma_k.with(full_k), get<0>(tK)(_, jt), get<1>(tK)(_, s));
        if (!q_first && n == 0) load_q();
        if constexpr (E::kConvertV) {
          const PipelineState<C::kV8Stages> use8{use.u};
          const int s8 = use8.stage();
          pp.v8.acquire(use8);
          uint64_t& full_v8 = pp.v8.expect(use8, kVBytes);
          copy(p.tma_v.with(full_v8), get<0>(tV)(_, jt), get<1>(tV)(_, s8));
        } else {
          if constexpr (E::kPrepass)
            if (use.u == 0) pdl_wait();  // V comes from convert_v
          pp.v.ring.acquire(use);
          // Partly masked tiles take the check's detour: it waits for them.
          const bool checked = kBand ? n < kt.n_cross : j >= kt.n_first;
          uint64_t& full_v = pp.v.expect(use, checked, kVBytes);
          copy(p.tma_v.with(full_v), get<0>(tV)(_, jt), get<1>(tV)(_, s));
        }
      }
      ++qi;
    });
  }

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
    // A thread keeps its 8 columns and steps over rows (no index division in the loop).
    constexpr int S8 = C::kV8Stages, kPerRow = D / 8, kStep = C::kConverters / kPerRow;
    static_assert(C::kConverters % kPerRow == 0);
    const Pipes pp = pipes(sm);
    const int bm = 64 * sp.wgs;
    int it = 0;
    Walk::follow(sp, sm, [&](int t) __attribute__((always_inline)) {
      const WorkTile w = Sched::decode(sp, t);
      const KeyTiles kt = key_tiles(p, seq_of_tile(p, w), w.m_block * bm, bm);
      for (int n = 0; n < kt.n_tiles; ++n, ++it) {
        const PipelineState<S> use{it};
        const PipelineState<S8> use8{it};
        const int s = use.stage(), s8 = use8.stage();
        pp.v8.wait(use8);
        pp.v.ring.acquire(use);
        bool nan8 = false;  // non-finite V: a NaN code among this thread's (no infinities)
        // Recomputed per tile from an opaque index: fewer registers held across the loop.
        int ci = ct;
        asm volatile("" : "+r"(ci));
        const int d = ci % kPerRow * 8, key0 = ci / kPerRow;
        for (int key = key0; key < BN; key += kStep) {
          const uint2 x = ld_shared_64(v8 + uint32_t(s8 * BN * D + key * D + d));
          nan8 |= e4m3_nan8(x);
          st_shared_128(kSwizzle(v16 + uint32_t(kFlatV(key, d, s) * sizeof(PV))),
                        f16x8_of_e4m3x8(x));
        }
        // The check, on the converted tile (its barrier is also the one after which every
        // converted value is visible to all).
        if (key_tile(n, kt) >= kt.n_first) settle_nonfinite<C>(sm, s, s, nan8, ct, kCheckBarrier);
        // These generic-proxy writes must be visible to the wgmmas (async proxy).
        cutlass::arch::fence_view_async_shared();
        pp.v8.release(use8);
        pp.v.ring.commit(use);
      }
    });
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
    const int bm = 64 * sp.wgs;
    int it = 0, nt = 0;  // ring uses and tiles with queries so far
    PhaseBits landed;    // kTracked: bit s, the phase of stage s's landed barrier
    Walk::follow(sp, sm, [&](int t) __attribute__((always_inline)) {
      const Pipes pp = pipes(sm);
      asm volatile("" : "+r"(t));  // opaque: nothing shared with the TMA thread's registers
      const WorkTile w = Sched::decode(sp, t);
      const int m0 = w.m_block * bm;
      const Seq<int> seq = seq_of_tile(p, w);
      if (past_end(seq, m0)) return;
      const KeyTiles kt = key_tiles(p, seq, m0, bm);
      const int n_checked = checked_uses(kt);
      const int slot0 = kTracked ? (nt & 1) * C::kTileSlots : 0;
      if constexpr (kTracked) pp.records.acquire(nt);
      for (int u = 0; u < n_checked; ++u) {
        const PipelineState<S> use{it + u};
        const int s = use.stage();
        pp.v.wait_landed(use, landed);
        const uint32_t tile = v16 + uint32_t(s * BN * D * sizeof(PV));
        // Rows past the sequence's keys (packed K/V: the next sequence's) are zeroed unrecorded.
        const int real_keys = seq.seq_k - key_tile(u, kt) * BN;
        const bool any = settle_nonfinite<C, kBand>(
            sm, s, slot0 + u, scan_nonfinite<PV, BN, D>(tile, ct, C::kConverters), ct,
            kCheckBarrier, real_keys);
        if (any) cutlass::arch::fence_view_async_shared();  // the zeros, for the wgmmas
        pp.v.commit_checked(use);
      }
      if constexpr (kTracked) pp.records.commit(nt);
      it += kt.n_tiles;
      ++nt;
    });
  }

  // E4M3: q·k's dequantization scales folded into the softmax scale, v's into the output factor.
  __device__ __forceinline__ static void scales(const Params& p, const WorkTile& w, float& sl2,
                                                float& o_scale) {
    sl2 = p.scale_log2;
    o_scale = 1.f;
    if constexpr (E::kFp8) dequant_scales(p, w.b, w.h, sl2, o_scale);
  }

  // Band: the score mods of work tile w (slope of its (batch, head)). Made where they are used,
  // from the parameters (constant memory) rather than held in registers across the main loop.
  __device__ __forceinline__ static ScoreMods mods(const Params& p, const WorkTile& w,
                                                   const Mask& mask, float sl2) {
    ScoreMods m{false, sl2, 0.f, false, 0.f, mask.seq_k - mask.seq_q};
    if constexpr (kBand) {
      m.cap2 = p.cap2;
      m.alibi = p.alibi != nullptr;
      if (m.alibi) m.slope2 = __ldg(p.alibi + w.b * p.alibi_bstride + w.h) * 1.4426950408889634f;
      m.on = m.cap2 > 0.f || m.alibi;
    }
    return m;
  }

  // The scale the softmax steps take: 1 where the band's mods turned the scores into log2-domain
  // logits (ALiBi), the cap where they turned them into tanh values (softcap alone), else the
  // softmax scale.
  __device__ __forceinline__ static float step_scale(const Params& p, float sl2) {
    if constexpr (kBand)
      return p.alibi != nullptr ? 1.f : p.cap2 > 0.f ? p.cap2 : sl2;
    else
      return sl2;
  }

  // A consumer thread's wgmma operands in shared memory (descriptors of Q, K and V over the
  // stages) and its S elements' (row, col) coordinates: made once per CTA, before the tile loop.
  __device__ __forceinline__ static auto consumer_operands(typename C::Smem& sm, int ctid) {
    Tensor sQ = make_tensor(make_smem_ptr(sm.q), typename C::LayoutQ{});    // (BM, D)
    Tensor sK = make_tensor(make_smem_ptr(sm.k), typename C::LayoutK{});    // (BN, D, stage)
    Tensor sVt = make_tensor(make_smem_ptr(sm.v), typename C::LayoutVt{});  // (D, BN, stage)
    typename C::MmaQK mma_qk;
    typename C::MmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(ctid);
    Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));
    return ConsumerOperands{thr_qk.partition_fragment_A(sQ),  // (MMA, MMA_M, MMA_K)
                            thr_qk.partition_fragment_B(sK),  // (MMA, MMA_N, MMA_K, stage)
                            mma_pv.get_thread_slice(ctid).partition_fragment_B(sVt),
                            make_tensor(cS.data(), rowcol(cS.layout()))};
  }

  // One work tile of consumer warpgroup wg: O (tOrO,
  // zeroed by the caller) and the softmax state over the tile's kt.n_tiles key tiles, which are
  // ring uses it, it + 1, ...; `it` is advanced past them. Issue rounds, N = n_tiles:
  //   round 0:            S_0
  //   round n (1..N-1):   S_n, then O += P_{n-1}·V_{n-1}: two commit groups
  //   round N:            O += P_{N-1}·V_{N-1}
  // Once S_n is done its K stage is released (after the last S, Q too) and the softmax turns it
  // into exp2 scores; once P·V is done its V stage is released and P_n is written over P_{n-1}.
  // Every wgmma sits on an unconditional path of its round: wgmmas under a branch make ptxas
  // serialize them. With turns, each warpgroup waits for its turn barrier before a round's
  // wgmmas and hands the turn over after issuing them; warpgroup 0 goes first, warpgroup 1
  // pre-arrives once per tile and skips its very last hand-over, so both barriers see matched
  // counts.
  template <class Ops, class TO, class Softmax>
  __device__ __forceinline__ static void mma(const Params& p, typename C::Smem& sm, const Ops& ops,
                                             int m0, const KeyTiles& kt, int& it, int qi, TO& tOrO,
                                             Softmax& softmax, const WorkTile& w, float sl2_raw,
                                             int wg, PhaseBits& v_phase) {
    const float sl2 = step_scale(p, sl2_raw);
    const int n_tiles = kt.n_tiles;
    const bool turns = C::kPingPong && p.turns;
    const auto turn_sync = [&](int w) {
      if (turns) named_sync(kTurnBarrier + w, 256);
    };
    const auto turn_arrive = [&](int w) {
      if (turns) named_arrive(kTurnBarrier + w, 256);
    };
    const Pipes pp = pipes(sm);
    if (n_tiles == 0) {
      pp.q.wait(qi);  // every loaded Q is waited for before it is freed
      if constexpr (!C::kAliasO) pp.q.release(qi);
      return;
    }

    typename C::MmaQK mma_qk;
    typename C::MmaPV mma_pv;
    auto& tSrQ = ops.q;
    auto& tSrK = ops.k;
    auto& tOrV = ops.v;
    auto& cSrc = ops.coords;
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<BM>, Int<BN>>{});
    Tensor rP = make_tensor<PV>(typename C::LayoutP{});
    // Fast mode: each tile's P·V into a fresh accumulator, added into O once done (two-level
    // accumulation). The e4m3 wgmma adds its products into the accumulator at reduced precision
    // and truncating: over thousands of keys whose V has a non-zero mean, O drifts by tens of
    // percent; over one tile's 128 it does not.
    Tensor tOrOt = partition_fragment_C(mma_pv, Shape<Int<BM>, Int<D>>{});
    const auto fence_pv_acc = [&]() {
      if constexpr (E::kFp8PV)
        warpgroup_fence_operand(tOrOt);
      else
        warpgroup_fence_operand(tOrO);
    };
    const auto issue_pv = [&](int sv) {
      if constexpr (E::kFp8PV) {
        mma_pv.accumulate_ = GMMA::ScaleOut::Zero;
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(rP); ++kb) {
          cute::gemm(mma_pv, rP(_, _, kb), tOrV(_, _, kb, sv), tOrOt);
          mma_pv.accumulate_ = GMMA::ScaleOut::One;
        }
      } else {
        cute::gemm(mma_pv, rP, tOrV(_, _, _, sv), tOrO);
      }
    };
    const auto add_pv = [&]() {
      if constexpr (E::kFp8PV) {
        CUTE_UNROLL
        for (int i = 0; i < size(tOrO); ++i) tOrO(i) += tOrOt(i);
      }
    };
    Tensor O = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
    Tensor Srow = make_tensor(tSrS.data(), rowcol(tSrS.layout()));

    const auto issue_s = [&](int sk) {
      // Q's descriptors re-derived from an opaque base each round: held across the loop, the
      // compiler keeps all of them in ordinary registers and moves each to a uniform register
      // (R2UR) before its wgmma; from the base, each is one uniform add.
      GMMA::DescriptorIterator q_base = tSrQ.data();
      asm volatile("" : "+r"(q_base.desc_.reg32_[0]));
      q_base.desc_.reg32_[0] = __shfl_sync(0xffffffffu, q_base.desc_.reg32_[0], 0);
      Tensor tSrQ_round = make_tensor(q_base, tSrQ.layout());
      mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tSrQ); ++kb) {
        cute::gemm(mma_qk, tSrQ_round(_, _, kb), tSrK(_, _, kb, sk), tSrS);
        mma_qk.accumulate_ = GMMA::ScaleOut::One;
      }
    };
    const auto fence_all = [&]() {
      warpgroup_fence_operand(tSrS);
      fence_pv_acc();
      warpgroup_fence_operand(rP);
    };
    const auto softmax_step = [&](int n) {
      // The mask (and a band's mods) from the parameters, not held across the loop.
      const Mask mask = mask_of(p, seq_of_tile(p, w));
      if constexpr (kBand)
        apply_band(Srow, cSrc, mask, mods(p, w, mask, sl2_raw), m0, BM, key_tile(n, kt) * BN, BN);
      else
        apply_mask(Srow, cSrc, mask, m0, key_tile(n, kt) * BN, BN);
      softmax.step(Srow, sl2);
    };
    // V of the tile's i-th ring use: landed, and checked if partly masked (the n_cross partly
    // masked tiles are a tile's first uses: key_tile).
    const auto wait_v = [&](int i, const PipelineState<S>& use) {
      pp.v.wait(i, use, checked_uses(kt), v_phase);
    };

    if (wg == 1) turn_arrive(0);
    pp.q.wait(qi);

    // Round 0.
    {
      const PipelineState<S> k{it};
      pp.k.wait(k);
      turn_sync(wg);
      fence_all();
      warpgroup_arrive();
      issue_s(k.stage());
      warpgroup_commit_batch();
      turn_arrive(wg ^ 1);
      warpgroup_wait<0>();
      fence_all();
      pp.k.release(k);
      if (!C::kAliasO && n_tiles == 1) pp.q.release(qi);
      softmax_step(0);
      convert_p(rP, tSrS);  // O is still zero: no rescale
    }

    for (int n = 1; n < n_tiles; ++n) {
      const PipelineState<S> k{it + n}, v{it + n - 1};  // ring uses of K_n and V_{n-1}
      pp.k.wait(k);
      wait_v(n - 1, v);
      turn_sync(wg);
      fence_all();
      warpgroup_arrive();
      issue_s(k.stage());
      warpgroup_commit_batch();
      // O was last written by P_{n-2}·V_{n-2} (done); rescale it by softmax n-1's factor while
      // S_n runs (O is still zero at n = 1).
      if (n > 1) softmax.rescale_o(O);
      fence_pv_acc();
      warpgroup_arrive();
      issue_pv(v.stage());
      warpgroup_commit_batch();
      turn_arrive(wg ^ 1);
      warpgroup_wait<1>();  // S_n done; P_{n-1}·V_{n-1} may still run
      warpgroup_fence_operand(tSrS);
      pp.k.release(k);
      if (!C::kAliasO && n == n_tiles - 1) pp.q.release(qi);
      softmax_step(n);
      warpgroup_wait<0>();
      fence_all();
      pp.v.ring.release(v);
      add_pv();
      convert_p(rP, tSrS);
    }

    // Round N.
    {
      const PipelineState<S> v{it + n_tiles - 1};
      wait_v(n_tiles - 1, v);
      turn_sync(wg);
      if (n_tiles > 1) softmax.rescale_o(O);
      fence_all();
      warpgroup_arrive();
      issue_pv(v.stage());
      warpgroup_commit_batch();
      if (wg == 0) turn_arrive(1);
      warpgroup_wait<0>();
      fence_all();
      pp.v.ring.release(v);
      add_pv();
    }
    it += n_tiles;
  }

  // A consumer thread's O elements' (row, col) in the row/col view, from an opaque copy of its
  // index: made where the rare path needs them, not held across the main loop.
  __device__ __forceinline__ static auto o_coords(int ctid) {
    int etid = ctid;
    asm volatile("" : "+r"(etid));
    typename C::MmaPV mma_pv;
    Tensor cO =
        mma_pv.get_thread_slice(etid).partition_C(make_identity_tensor(Shape<Int<BM>, Int<D>>{}));
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
                                 m0, key_tile(u, kt) * BN);
      }
    } else if constexpr (Mask::kMasksKeys) {
      Tensor O = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
      for (int j = kt.n_first; j < kt.n_tiles; ++j) {
        // Check slot: slot0 + the tile's ring use (key_tile is an involution here).
        const int sv = slot0 + key_tile(j, kt);
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

  // The parameters: a TMA descriptor per operand (make_tma_copy encodes it on the host; it
  // travels in the __grid_constant__ parameter block) and the scalars. E4M3 with the pre-pass: V
  // is the pre-pass's f16 copy `v` with strides `vs`.
  static Params make(const FwdArgs& a, const void* v, const Strides& vs, bool turns) {
    // Packed and paged tensors (batch stride 0) are one batch entry of all their rows; the
    // batch stride of a one-entry mode is never used, and TMA wants it a 16-byte multiple.
    const auto gmem = [&](auto const* ptr, int64_t rows, int64_t heads, int64_t batch,
                          const Strides& st) {
      const int64_t bs = batch == 1 && st.batch == 0 ? rows * st.seq : st.batch;
      return make_tensor(make_gmem_ptr(ptr),
                         make_shape(int(rows), Int<D>{}, int(heads), int(batch)),
                         make_stride(st.seq, _1{}, st.head, bs));
    };
    const int64_t q_rows = a.total_q > 0 ? a.total_q : a.seq_q;
    const int64_t q_batch = a.total_q > 0 ? 1 : a.batch;
    const int64_t kv_rows = a.kv_rows > 0 ? a.kv_rows : a.seq_k;
    const int64_t kv_batch = a.kv_rows > 0 ? 1 : a.batch;
    Params p{};
    p.tma_q = make_tma_copy(SM90_TMA_LOAD{},
                            gmem(static_cast<const QK*>(a.q), q_rows, a.heads, q_batch, a.q_stride),
                            typename C::LayoutQ{}, Shape<Int<BM>, Int<D>>{}, _1{});
    p.tma_k =
        make_tma_copy(SM90_TMA_LOAD{},
                      gmem(static_cast<const QK*>(a.k), kv_rows, a.kv_heads, kv_batch, a.k_stride),
                      take<0, 2>(typename C::LayoutK{}), Shape<Int<BN>, Int<D>>{}, _1{});
    if constexpr (E::kConvertV) {
      p.tma_v = make_tma_copy(SM90_TMA_LOAD{},
                              gmem(static_cast<const QK*>(v), kv_rows, a.kv_heads, kv_batch, vs),
                              take<0, 2>(typename C::LayoutV8{}), Shape<Int<BN>, Int<D>>{}, _1{});
    } else if constexpr (E::kFp8PV) {
      // The pre-pass's V^T in the workspace `v`, [batch][kv_head][D][keys_t]; after it, the
      // masked kernels' NaN table.
      const int64_t keys = transposed_keys(a);
      p.keys_t = int(keys);
      p.tma_v =
          make_tma_copy(SM90_TMA_LOAD{},
                        make_tensor(make_gmem_ptr(static_cast<const PV*>(v)),
                                    make_shape(Int<D>{}, int(keys), int(a.kv_heads), int(a.batch)),
                                    make_stride(keys, _1{}, D * keys, a.kv_heads * D * keys)),
                        take<0, 2>(typename C::LayoutVt{}), Shape<Int<D>, Int<BN>>{}, _1{});
      if (nan_table_bytes(a) > 0)
        p.nan_first = reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(v) +
                                                        transposed_v_bytes(a));
    } else {
      p.tma_v = make_tma_copy(SM90_TMA_LOAD{},
                              gmem(static_cast<const PV*>(v), kv_rows, a.kv_heads, kv_batch, vs),
                              take<0, 2>(typename C::LayoutV{}), Shape<Int<BN>, Int<D>>{}, _1{});
    }
    fill_sizes(p, a);
    p.turns = turns ? 1 : 0;
    p.q_scale = a.q_scale;
    p.k_scale = a.k_scale;
    p.v_scale = a.v_scale;
    p.per_head = a.per_head_scales ? 1 : 0;
    if constexpr (kBand) {
      const mask::Band<int> band = mask::band_of<int>(a);
      p.diag = band.diag;
      p.left = band.left;
      p.right = band.right;
      p.top_left = band.top_left ? 1 : 0;
      p.cap2 = a.softcap > 0.f ? a.softcap * 1.4426950408889634f : 0.f;
      p.alibi = a.alibi ? a.alibi_slopes : nullptr;
      p.alibi_bstride = int(a.alibi_batch_stride);
      p.seqs = SeqParams::of(a);
    }
    return p;
  }
};

}  // namespace sdpa::cutlass_sm90
