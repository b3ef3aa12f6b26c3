// The sm_90a kernel's producer: its TMA thread (producer warp 0, one thread) loads Q once per
// work tile and K and V tiles into the ring, in the order the consumers take them.
#pragma once

#include "common/launch.cuh"
#include "cutlass/sm90/kernel_traits.cuh"
#include "cutlass/sm90/tile_keys.cuh"

namespace sdpa::cutlass_sm90 {

template <class E, int D, class Mask>
struct Producer {
  using T = KernelTraits<E, D, Mask>;
  using K = TileKeys<E, D, Mask>;
  using C = typename T::C;
  using QK = typename E::QK;
  using PV = typename E::PV;
  using Sched = typename T::Sched;
  using Params = typename T::Params;
  using Walk = typename T::Walk;
  using Seqs = typename T::Seqs;
  static constexpr int BM = T::BM, BN = T::BN, S = T::S;
  static constexpr bool kBand = T::kBand, kFeed = T::kFeed, kOneTile = T::kOneTile;

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
    Tensor sV = make_tensor(make_smem_ptr(sm.v), typename C::LayoutV{});  // (BN, DV, stage)
    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.seq_q, Int<D>{}, p.heads, p.batch));
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seq_k, Int<D>{}, p.kv_heads, p.batch));
    // V, or fast mode's V^T (d, key, head, batch).
    Tensor mV = [&]() {
      if constexpr (E::kFp8PV)
        return p.tma_v.get_tma_tensor(make_shape(Int<D>{}, p.keys_t, p.kv_heads, p.batch));
      else
        return p.tma_v.get_tma_tensor(make_shape(p.seq_k, Int<C::kDV>{}, p.kv_heads, p.batch));
    }();
    constexpr uint32_t kQBytes = BM * D * sizeof(QK);
    constexpr uint32_t kKBytes = BN * D * sizeof(QK);
    constexpr uint32_t kVBytes = BN * C::kDV * (E::kConvertV ? sizeof(QK) : sizeof(PV));
    const int bm = 64 * sp.wgs;
    int it = 0, qi = 0;  // qi: the tiles with queries so far (Q loads)
    // Work tile t's loads.
    const auto make = [&](int t) { return K::record(p, sp, t); };
    Walk::template issue<E::kConvertV>(sp, sm, make, [&](const TileRecord& r, uint32_t /*at*/) {
      const WorkTile w = r.w;
      const int hk = p.div_group.div(w.h);
      const int m0 = w.m_block * bm;
      const Seq<int> seq = r.seq;
      const KeyTiles kt = r.kt;
      const int qb = Seqs::q_batch(p, w.b), kb = Seqs::kv_batch(p, w.b);
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
                            Shape<Int<BN>, Int<C::kDV>>{}, make_coord(_, _0{}));
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
        T::q_slot(sm).acquire(qi);
        uint64_t& full_q = T::q_slot(sm).expect(qi, kQBytes);
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
        T::k_ring(sm).acquire(use);
        uint64_t& full_k = T::k_ring(sm).expect(use, kKBytes);
        const int j = K::key_tile(n, kt), jt = Seqs::key_tile_at(p, w.b, j);
        copy(p.tma_k.with(full_k), get<0>(tK)(_, jt), get<1>(tK)(_, s));
        if (!q_first && n == 0) load_q();
        if constexpr (E::kConvertV) {
          const PipelineState<C::kV8Stages> use8{use.u};
          const int s8 = use8.stage();
          T::v8_ring(sm).acquire(use8);
          uint64_t& full_v8 = T::v8_ring(sm).expect(use8, kVBytes);
          copy(p.tma_v.with(full_v8), get<0>(tV)(_, jt), get<1>(tV)(_, s8));
        } else {
          if constexpr (E::kPrepass)
            if (use.u == 0) pdl_wait();  // V comes from convert_v
          T::v_ring(sm).ring.acquire(use);
          // Partly masked tiles take the check's detour: it waits for them.
          const bool checked = kBand ? n < kt.n_cross : j >= kt.n_first;
          uint64_t& full_v = T::v_ring(sm).expect(use, checked, kVBytes);
          copy(p.tma_v.with(full_v), get<0>(tV)(_, jt), get<1>(tV)(_, s));
        }
      }
      ++qi;
    });
  }
};

}  // namespace sdpa::cutlass_sm90
