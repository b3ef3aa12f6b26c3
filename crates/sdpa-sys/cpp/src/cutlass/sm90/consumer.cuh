// The sm_90a kernel's consumers: each warpgroup's wgmma rounds over the K/V ring, S = Q·Kᵀ, the
// online softmax with the mask and score mods in between, and O += P·V.
#pragma once

#include "cutlass/sm90/kernel_traits.cuh"
#include "cutlass/sm90/softmax.cuh"
#include "cutlass/sm90/tile_keys.cuh"

namespace sdpa::cutlass_sm90 {

// A consumer thread's view of its operands: the wgmma descriptors of Q, K and V in shared memory
// and the (row, col) of each S element it holds (Consumer::consumer_operands makes it).
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
struct Consumer {
  using T = KernelTraits<E, D, Mask>;
  using K = TileKeys<E, D, Mask>;
  using C = typename T::C;
  using PV = typename E::PV;
  using Params = typename T::Params;
  using Mods = typename T::Mods;
  static constexpr int BM = T::BM, BN = T::BN, S = T::S;

  // E4M3: q·k's dequantization scales folded into the softmax scale, v's into the output factor.
  __device__ __forceinline__ static void scales(const Params& p, const WorkTile& w, float& sl2,
                                                float& o_scale) {
    sl2 = p.scale_log2;
    o_scale = 1.f;
    if constexpr (E::kFp8) dequant_scales(p, w.b, w.h, sl2, o_scale);
  }

  // The scale the softmax steps take (the score mods').
  __device__ __forceinline__ static float step_scale(const Params& p, float sl2) {
    return Mods::step_scale(p, sl2);
  }

  // A consumer thread's wgmma operands in shared memory (descriptors of Q, K and V over the
  // stages) and its S elements' (row, col) coordinates: made once per CTA, before the tile loop.
  __device__ __forceinline__ static auto consumer_operands(typename C::Smem& sm, int ctid) {
    Tensor sQ = make_tensor(make_smem_ptr(sm.q), typename C::LayoutQ{});    // (BM, D)
    Tensor sK = make_tensor(make_smem_ptr(sm.k), typename C::LayoutK{});    // (BN, D, stage)
    Tensor sVt = make_tensor(make_smem_ptr(sm.v), typename C::LayoutVt{});  // (DV, BN, stage)
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
  // ring uses it, it + 1, ...; `it` is advanced past them. `at`: the tile's record on the feed
  // (TileKeys::seq). Issue rounds, N = n_tiles:
  //   round 0:            S_0
  //   round n (1..N-1):   S_n, then O += P_{n-1}·V_{n-1}: two commit groups
  //   round N:            O += P_{N-1}·V_{N-1}
  // Once S_n is done its K stage is released (after the last S, Q too) and the softmax turns it
  // into exp2 scores; once P·V is done its V stage is released and P_n is written over P_{n-1}.
  // Every wgmma sits on an unconditional path of its round: wgmmas under a branch make ptxas
  // serialize them. With turns, each warpgroup waits for its turn barrier before a round's
  // wgmmas and hands the turn to the next (a ring: 0, 1, 0, ... or 0, 1, 2, 0, ...) after issuing
  // them; warpgroup 0 goes first, the last warpgroup pre-arrives on 0's barrier once per tile and
  // skips its very last hand-over, so every barrier sees matched counts.
  template <class Ops, class TO, class Softmax>
  __device__ __forceinline__ static void mma(const Params& p, typename C::Smem& sm, const Ops& ops,
                                             int m0, const KeyTiles& kt, int& it, int qi, TO& tOrO,
                                             Softmax& softmax, const WorkTile& w, uint32_t at,
                                             float sl2_raw, int wg, PhaseBits& v_phase) {
    const float sl2 = step_scale(p, sl2_raw);
    const int n_tiles = kt.n_tiles;
    const bool turns = T::kTurns && p.turns;
    const auto turn_sync = [&](int w) {
      if (turns) named_sync(kTurnBarrier + w, 256);
    };
    const auto turn_arrive = [&](int w) {
      if (turns) named_arrive(kTurnBarrier + w, 256);
    };
    if (n_tiles == 0) {
      T::q_slot(sm).wait(qi);  // every loaded Q is waited for before it is freed
      if constexpr (!C::kAliasO) T::q_slot(sm).release(qi);
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
    Tensor tOrOt = partition_fragment_C(mma_pv, Shape<Int<BM>, Int<C::kDV>>{});
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
      // The mask and the score mods from the parameters, not held across the loop; the mods
      // first, then the mask. A band's tiles that hide nothing skip both where there are no
      // mods: the sequence's lengths (packed: read from global memory) are not looked up.
      // (The mods are made before the key tile's place is computed: the other way round, the
      // compiler computes the mods' branches on every tile.)
      if (!K::unmasked_use(n, kt) || Mods::on(p)) {
        const Mask mask = K::mask_of(p, K::seq(p, w, at));
        const Mods mods = Mods::of(p, w, mask.seq_k - mask.seq_q, sl2_raw);
        const int n0 = K::key_tile(n, kt) * BN;
        const auto tile = score_tile<!E::kFp8PV>(Srow, cSrc);
        mods.apply(tile, m0, n0);
        mask.apply(tile, m0, BM, n0, BN);
      }
      softmax.step(Srow, sl2);
    };
    // V of the tile's i-th ring use: landed, and checked if partly masked (the n_cross partly
    // masked tiles are a tile's first uses: key_tile).
    const auto wait_v = [&](int i, const PipelineState<S>& use) {
      T::v_ring(sm).wait(i, use, K::checked_uses(kt), v_phase);
    };

    constexpr int kLast = C::kWG - 1;
    const int next = wg == kLast ? 0 : wg + 1;  // whose turn follows this warpgroup's
    if (wg == kLast) turn_arrive(0);
    T::q_slot(sm).wait(qi);

    // Round 0.
    {
      const PipelineState<S> k{it};
      T::k_ring(sm).wait(k);
      turn_sync(wg);
      fence_all();
      warpgroup_arrive();
      issue_s(k.stage());
      warpgroup_commit_batch();
      turn_arrive(next);
      warpgroup_wait<0>();
      fence_all();
      T::k_ring(sm).release(k);
      if (!C::kAliasO && n_tiles == 1) T::q_slot(sm).release(qi);
      softmax_step(0);
      convert_p(rP, tSrS);  // O is still zero: no rescale
    }

    for (int n = 1; n < n_tiles; ++n) {
      const PipelineState<S> k{it + n}, v{it + n - 1};  // ring uses of K_n and V_{n-1}
      T::k_ring(sm).wait(k);
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
      turn_arrive(next);
      warpgroup_wait<1>();  // S_n done; P_{n-1}·V_{n-1} may still run
      warpgroup_fence_operand(tSrS);
      T::k_ring(sm).release(k);
      if (!C::kAliasO && n == n_tiles - 1) T::q_slot(sm).release(qi);
      softmax_step(n);
      warpgroup_wait<0>();
      fence_all();
      T::v_ring(sm).ring.release(v);
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
      if (wg != kLast) turn_arrive(next);
      warpgroup_wait<0>();
      fence_all();
      T::v_ring(sm).ring.release(v);
      add_pv();
    }
    it += n_tiles;
  }
};

}  // namespace sdpa::cutlass_sm90
