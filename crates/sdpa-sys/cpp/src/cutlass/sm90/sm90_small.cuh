// Small-problem path of the sm_90a backend: the keys split across a thread-block cluster, one
// pass per CTA, the partial results merged through distributed shared memory. Same assumptions
// as sm90_fwd.cuh (validated arguments, 16-byte aligned rows and strides).
//
// Where the main kernel's grid leaves most SMs idle (B=2, H=8, S=256 at D=64: 64 CTAs of 64
// query rows, each walking 2 key tiles in turn), its time is latency: the first loads, a chain
// of wgmma/softmax rounds, the epilogue. Here a CTA of one warpgroup (128 threads) takes 64
// query rows and one slice of KN keys; the C = ceil(seq_k / KN) slices of a query tile are the
// C CTAs of one cluster (grid C x query tiles x batch·heads), so the grid is C times larger and
// each CTA loads 1/C of the K/V bytes. Per CTA:
//   load      Q [64][D], K and V [KN][D] at once by TMA (zero fill past the sequences) into
//             128-byte-swizzled smem;
//   S = Q·Kᵀ  one wgmma SS chain; mask; softmax of the whole slice in registers (f32, log2
//             domain); O = P·V one wgmma RS chain (P from the S registers, as in sm90_fwd.cuh);
//   exchange  O (unnormalized, f32), the row max m and row sum l are staged in smem (over the
//             dead Q/K/V) as 64 rows; rank r of the cluster owns rows [rR, rR + R), R =
//             ceil(64 / C), and every CTA sends each peer that peer's rows with one bulk copy
//             into the peer's smem (cp.async.bulk shared::cta -> shared::cluster, counted by the
//             peer's mbarrier);
//   merge     each CTA combines the C partials of its own rows, O = Σ 2^(m_j - M) O_j /
//             Σ 2^(m_j - M) l_j, and writes them with 16-byte stores.
// Causal slices that no row of the tile sees load nothing and send empty partials (m = -inf,
// l = 0, O = 0). No second launch and no global workspace. E4m3 inputs (accurate mode): S on the
// e4m3 wgmma, V's codes landed apart and converted to f16 in shared memory while S runs, P·V in
// f16; q·k's scales folded into the softmax scale, v's into the merge's normalization.
//
// The partials travel as one bulk copy per peer, the cheapest exchange of those tried (8-byte
// st.shared::cluster stores and a cluster barrier, remote loads of the peers' stages, 8-byte
// st.async stores each counted by the owner's mbarrier). Timed stage by stage (empty cluster
// launch, loads and stores alone, plus the compute, plus the exchange), the exchange and the
// chain of waits, not bandwidth, dominate the time (measured: docs/log/2026-11-notebook.md,
// "mission problem: small-problem path for sm90").
//
// Built from the main kernel's pieces where the two do the same thing: the online softmax and
// the score tile (softmax.cuh), the mask applying itself (common/mask.cuh), the non-finite V
// check (nonfinite_v.cuh), e4m3 V's conversion (convert_e4m3_tile), the hand-overs
// (pipeline.cuh) and the operands' TMA tensors (operand_tensor). Its tile shapes (one warpgroup,
// one key slice, no stages: SmallCfg) and its parameters (the merge's) are its own.
#pragma once

#include "common/attributes.cuh"
#include "common/cluster.cuh"
#include "common/launch.cuh"
#include "cutlass/sm90/sm90_fwd.cuh"

namespace sdpa::cutlass_sm90 {

// `bytes` (a multiple of 16) of this CTA's smem at `src` to cluster smem `dst`; the mbarrier
// `bar` (of dst's CTA) counts them.
__device__ __forceinline__ void bulk_to_peer(uint32_t dst, uint32_t src, uint32_t bytes,
                                             uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, "
      "[%3];" ::"r"(dst),
      "r"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// E: the element types (tile_config.cuh's Elems): 16-bit Same<T>, or e4m3 accurate mode (QK
// e4m3, PV f16, Out f16 or bf16).
template <class E, int D, int KN>
struct SmallCfg {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static_assert(KN == 64 || KN == 128, "key slice of 64 or 128");
  static_assert(!E::kFp8PV && !E::kF32Out, "P·V in 16 bit, O in a 16-bit type");
  using QK = typename E::QK;
  using PV = typename E::PV;
  using Out = typename E::Out;
  static constexpr int kThreads = 128;   // one warpgroup: one wgmma M = 64 query rows
  static constexpr int kMaxCluster = 8;  // the portable cluster size limit
  using HD = Int<D>;
  using KNt = Int<KN>;

  using MmaQK =
      decltype(make_tiled_mma(SM90::GMMA::ss_op_selector<QK, QK, float, Shape<_64, KNt, HD>,
                                                         GMMA::Major::K, GMMA::Major::K>()));
  using MmaPV =
      decltype(make_tiled_mma(SM90::GMMA::rs_op_selector<PV, PV, float, Shape<_64, HD, KNt>,
                                                         GMMA::Major::K, GMMA::Major::MN>()));
  using LayoutQ = decltype(tile_to_shape(KAtom<QK, D>{}, Shape<_64, HD>{}));
  using LayoutK = decltype(tile_to_shape(KAtom<QK, D>{}, Shape<KNt, HD>{}));
  using LayoutVt =
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<PV>{}, Shape<HD, KNt>{}, Step<_2, _1>{}));
  using LayoutV =
      decltype(composition(LayoutVt{}, make_layout(Shape<KNt, HD>{}, Stride<HD, _1>{})));
  // E4m3 V's codes as TMA lands them, unswizzled rows of D bytes, for the conversion to read.
  using LayoutV8 = Layout<Shape<KNt, HD>, Stride<HD, _1>>;
  // P over the S registers as the A operand of P·V (see TileConfig::LayoutP).
  using LayoutP =
      Layout<Shape<Shape<_2, _2, _2>, _1, Int<KN / 16>>, Stride<Stride<_1, _2, _4>, _0, _8>>;

  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorOf<QK, D>>(), LayoutQ{},
                                      Shape<_64, HD>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorOf<QK, D>>(), LayoutK{},
                                      Shape<KNt, HD>{}, _1{}));
  using TmaV =
      std::conditional_t<E::kFp8,
                         decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorOf<QK, D>>(),
                                                LayoutV8{}, Shape<KNt, HD>{}, _1{})),
                         decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorOf<PV, D>>(),
                                                LayoutV{}, Shape<KNt, HD>{}, _1{}))>;

  // A partial row: D floats of O, then m and l, padded to D + 8 floats. The padding keeps the
  // rows 16-byte multiples (bulk copies) and shifts consecutive rows by 8 banks, so a warp's
  // quad-strided float2 stores fill two wavefronts, not eight.
  static constexpr int kRow = D + 8;
  struct Smem {
    union {
      struct {
        alignas(1024) QK q[64 * D];
        alignas(1024) QK k[KN * D];
        alignas(1024) PV v[KN * D];
        alignas(128) QK v8[E::kFp8 ? KN * D : 16];  // e4m3 V's codes (LayoutV8)
      } in;
      alignas(16) float stage[64 * kRow];  // this CTA's partials, once Q, K, V are dead
    };
    // Peers' partials of this CTA's rows: slot j * R + r for rank j, row r (own slots unused).
    alignas(16) float recv[(64 + kMaxCluster) * kRow];
    alignas(8) uint64_t bar_qk, bar_v;
    uint64_t bar_x;       // completes once every peer's partials of this CTA's rows have arrived
    NonFiniteCols<D> nf;  // the non-finite V check's records (nonfinite_v.cuh), when V has any
  };
  static constexpr int kSmemBytes = int(sizeof(Smem)) + 1024;  // + the 1024-byte alignment
};

template <class E, int D, int KN>
struct SmallParams {
  using C = SmallCfg<E, D, KN>;
  typename C::TmaQ tma_q;
  typename C::TmaK tma_k;
  typename C::TmaV tma_v;
  typename C::Out* o;
  Strides os;
  int seq_q, seq_k, heads, kv_heads, batch;
  float scale_log2;
  int rows;  // R = ceil(64 / C): query rows of the tile each cluster rank merges and writes
  FastDiv div_heads, div_group;
  // E4M3 only: dequantization scales, one per tensor or one per (batch, head) (per_head).
  const float *q_scale, *k_scale, *v_scale;
  int per_head;
};

// E4m3: V's codes as they landed (LayoutV8, on bar_v) into the f16 V tile P·V reads (LayoutV),
// exactly, as the main kernel's converting warps do (convert_e4m3_tile); no NaN check (the
// non-finite V check scans the f16 tile). Then visible to every warp and to the wgmmas.
template <class C>
__device__ __forceinline__ void convert_v_slice(typename C::Smem& sm, int tid) {
  constexpr int D = C::HD::value, KN = C::KNt::value;
  constexpr auto kSwizzle = get_swizzle_portion(typename C::LayoutV{});
  constexpr auto kFlatV = get_nonswizzle_portion(typename C::LayoutV{});
  const uint32_t v8 = uint32_t(__cvta_generic_to_shared(sm.in.v8));
  const uint32_t v16 = uint32_t(__cvta_generic_to_shared(sm.in.v));
  Handoff<1>{&sm.bar_v, nullptr}.wait(0);
  convert_e4m3_tile<KN, D, C::kThreads, true, false>(
      v8, tid, [&](int key, int d) __attribute__((always_inline)) {
        return kSwizzle(v16 + uint32_t(kFlatV(key, d) * sizeof(typename C::PV)));
      });
  cutlass::arch::fence_view_async_shared();
  __syncthreads();
}

template <class E, int D, int KN, class Mask>
__global__ void __launch_bounds__(128, 1)
    small_kernel(const __grid_constant__ SmallParams<E, D, KN> p) {
#ifdef SDPA_SM90_DEVICE
  using C = SmallCfg<E, D, KN>;
  using QK = typename C::QK;
  using PV = typename C::PV;
  using Out = typename C::Out;
  constexpr int kRow = C::kRow;
  auto& sm = smem_storage<typename C::Smem>();
  // One hand-over each (pipeline.cuh), none reused: Q and K, V, and the peers' partials.
  const Handoff<1> qk_slot{&sm.bar_qk, nullptr}, v_slot{&sm.bar_v, nullptr},
      partials{&sm.bar_x, nullptr};
  const int tid = threadIdx.x;
  const int rank = blockIdx.x, nrank = gridDim.x;  // the cluster spans grid x
  const int R = p.rows;
  const auto rows_of = [&](int r) { return min(R, 64 - r * R); };  // rows rank r merges
  const int mine = rows_of(rank);
  if (tid == 0) {
    prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    mbar_init(&sm.bar_qk, 1);
    mbar_init(&sm.bar_v, 1);
    mbar_init(&sm.bar_x, 1);
    partials.expect(0, uint32_t((nrank - 1) * mine * kRow * 4));
    cutlass::arch::fence_barrier_init();
  }
  // Phase 1 of the cluster barrier: peers copy into this CTA only once it has initialized bar_x
  // (they wait for this phase just before their copies, by when it is long complete).
  cluster_arrive_relaxed();
  __syncthreads();  // the load barriers are initialized
  pdl_wait();       // programmatic launch (small_launch): no global access before this
  pdl_launch_dependents();

  const int m0 = blockIdx.y * 64;
  const int bh = blockIdx.z;
  const int b = p.div_heads.div(bh), h = bh - b * p.heads;
  const Mask mask{p.seq_q, p.seq_k};
  const int k0 = rank * KN;
  // The softmax scale (e4m3: with q·k's dequantization folded in) and O's factor (v's).
  float sl2 = p.scale_log2, o_scale = 1.f;
  if constexpr (E::kFp8) dequant_scales(p, b, h, sl2, o_scale);
  // Whether some row of the tile sees a key of this slice [k0, k0 + KN).
  const bool active = k0 < mask.key_end(m0, 64);

  Tensor sQ = make_tensor(make_smem_ptr(sm.in.q), typename C::LayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(sm.in.k), typename C::LayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(sm.in.v), typename C::LayoutV{});
  Tensor sVt = make_tensor(make_smem_ptr(sm.in.v), typename C::LayoutVt{});

  if (tid == 0 && active) {
    const int hk = p.div_group.div(h);
    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.seq_q, Int<D>{}, p.heads, p.batch));
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seq_k, Int<D>{}, p.kv_heads, p.batch));
    Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.seq_k, Int<D>{}, p.kv_heads, p.batch));
    Tensor gQ = local_tile(mQ(_, _, h, b), Shape<_64, Int<D>>{}, make_coord(blockIdx.y, _0{}));
    Tensor gK = local_tile(mK(_, _, hk, b), Shape<Int<KN>, Int<D>>{}, make_coord(rank, _0{}));
    Tensor gV = local_tile(mV(_, _, hk, b), Shape<Int<KN>, Int<D>>{}, make_coord(rank, _0{}));
    auto tQ = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                            group_modes<0, 2>(gQ));
    auto tK = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK),
                            group_modes<0, 2>(gK));
    auto tV = [&]() {
      if constexpr (E::kFp8) {
        Tensor sV8 = make_tensor(make_smem_ptr(sm.in.v8), typename C::LayoutV8{});
        return tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV8),
                             group_modes<0, 2>(gV));
      } else {
        return tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV),
                             group_modes<0, 2>(gV));
      }
    }();
    // The copy engine counts the zero-filled bytes of partial boxes too.
    uint64_t& qk_full = qk_slot.expect(0, uint32_t((64 + KN) * D * sizeof(QK)));
    copy(p.tma_q.with(qk_full), get<0>(tQ), get<1>(tQ));
    copy(p.tma_k.with(qk_full), get<0>(tK), get<1>(tK));
    uint64_t& v_full = v_slot.expect(0, uint32_t(KN * D * (E::kFp8 ? sizeof(QK) : sizeof(PV))));
    copy(p.tma_v.with(v_full), get<0>(tV), get<1>(tV));
  }

  typename C::MmaQK mma_qk;
  typename C::MmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<_64, Int<D>>{});
  Tensor O = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
  Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<_64, Int<D>>{}));
  Tensor cOrc = make_tensor(cO.data(), rowcol(cO.layout()));
  constexpr int kRows = decltype(size<0>(O))::value;
  static_assert(kRows == 2);
  // One step of the online softmax over the whole slice; its max and sum are the partial's.
  OnlineSoftmax<kRows, false> softmax;

  if (active) {
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);
    Tensor tSrK = thr_qk.partition_fragment_B(sK);
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<_64, Int<KN>>{});
    Tensor rP = make_tensor<PV>(typename C::LayoutP{});
    Tensor S = make_tensor(tSrS.data(), rowcol(tSrS.layout()));
    Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<_64, Int<KN>>{}));
    Tensor cSrc = make_tensor(cS.data(), rowcol(cS.layout()));

    qk_slot.wait(0);
    warpgroup_fence_operand(tSrS);
    warpgroup_arrive();
    mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tSrQ); ++kb) {
      cute::gemm(mma_qk, tSrQ(_, _, kb), tSrK(_, _, kb), tSrS);
      mma_qk.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    if constexpr (E::kFp8) convert_v_slice<C>(sm, tid);  // while S runs
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);

    mask.apply(score_tile(S, cSrc), m0, 64, k0, KN);
    softmax.step(S, sl2);
    convert_p(rP, tSrS);

    if constexpr (!E::kFp8) v_slot.wait(0);
    const auto pv = [&] {
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(rP);
      warpgroup_arrive();
      mma_pv.accumulate_ = GMMA::ScaleOut::Zero;
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(rP); ++kb) {
        cute::gemm(mma_pv, rP(_, _, kb), tOrV(_, _, kb), tOrO);
        mma_pv.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
    };
    const auto pv_wait = [&] {
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(rP);
    };
    pv();
    // Non-finite V check: V of a slice partly masked for the tile is checked for non-finite values
    // while P·V runs (both only read it). In the rare case it has any, they are recorded and zeroed
    // and P·V runs again. (Checking before P·V, or before the softmax with the V wait moved ahead
    // of it, puts the check on the critical path; measured: docs/log/2026-11-notebook.md, "Figures
    // that lived in code comments".)
    const uint32_t v = uint32_t(__cvta_generic_to_shared(sm.in.v));
    bool nonfinite = false;
    if (Mask::kMasksKeys && mask.first_partial_tile(m0, KN, nrank) <= rank) {
      nonfinite =
          __syncthreads_or(scan_nonfinite<PV, KN, D, KN * D * 2 / (16 * 128)>(v, tid, 128)) != 0;
    }
    pv_wait();
    if (nonfinite) {
      constexpr auto kSwizzle = get_swizzle_portion(typename C::LayoutV{});
      constexpr auto kFlatV = get_nonswizzle_portion(typename C::LayoutV{});
      __syncthreads();  // every warp's part of P·V is done reading V
      record_nonfinite_cols<PV, KN, D>(
          uint32_t(__cvta_generic_to_shared(&sm.nf)), 0u,
          [&](int key, int col) { return kSwizzle(v + uint32_t(kFlatV(key, col) * sizeof(PV))); },
          tid, 128);
      cutlass::arch::fence_view_async_shared();  // the zeros, before P·V's wgmmas read V
      __syncthreads();
      pv();
      pv_wait();
      add_nonfinite_terms(O, cOrc, sm.nf, mask, m0, k0);
    }
  } else {
    clear(tOrO);  // an empty partial: m = -inf, l = 0 (the softmax's initial state)
  }

  const uint32_t stage_s = uint32_t(__cvta_generic_to_shared(sm.stage));
  const uint32_t recv_s = uint32_t(__cvta_generic_to_shared(sm.recv));
  // Stage the partials over Q/K/V once every warp's wgmmas that read them are complete; the
  // proxy fences order those async-proxy reads before these writes, and these writes before the
  // bulk copies.
  fence_proxy_async();
  __syncthreads();
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const uint32_t st = stage_s + uint32_t(get<0>(cOrc(r, 0)) * kRow * 4);
    CUTE_UNROLL
    for (int c = 0; c < size<1>(O); c += 2)
      st_shared2(st + uint32_t(get<1>(cOrc(r, c))) * 4u, O(r, c), O(r, c + 1));
    const float l = softmax.row_sum(r);
    if ((tid & 3) == 0) st_shared2(st + D * 4u, softmax.m[r], l);
  }
  fence_proxy_async();
  __syncthreads();
  cluster_wait();                    // phase 1: every CTA of the cluster has initialized its bar_x
  if (tid < nrank && tid != rank) {  // one thread per peer: its rows, into its slots for us
    const uint32_t bar_s = uint32_t(__cvta_generic_to_shared(&sm.bar_x));
    bulk_to_peer(map_rank(recv_s + uint32_t(rank * R * kRow * 4), tid),
                 stage_s + uint32_t(tid * R * kRow * 4), uint32_t(rows_of(tid) * kRow * 4),
                 map_rank(bar_s, tid));
  }
  partials.wait(0);
  // Phase 2: once every CTA has arrived, every copy out of this CTA's stage has landed, so it
  // may exit (its smem must outlive the copies that read it).
  cluster_arrive_relaxed();

  // Merge this rank's rows: 8 columns (one 16-byte store) per item, all C partials' loads
  // issued before any is used.
  constexpr int CH = D / 8;
  Out* ob = p.o + int64_t(b) * p.os.batch + int64_t(h) * p.os.head;
  for (int i = tid; i < mine * CH; i += 128) {
    const int lr = i / CH, c = (i % CH) * 8;
    const int row = m0 + rank * R + lr;
    if (row >= p.seq_q) continue;
    float2 ml[C::kMaxCluster];
    float4 x0[C::kMaxCluster], x1[C::kMaxCluster];
    CUTE_UNROLL
    for (int j = 0; j < C::kMaxCluster; ++j) {
      if (j < nrank) {
        // Rank j's partial of this row: this CTA's own in its stage, the peers' in recv.
        const uint32_t src = j == rank ? stage_s + uint32_t((rank * R + lr) * kRow * 4)
                                       : recv_s + uint32_t((j * R + lr) * kRow * 4);
        ml[j] = ld_shared2(src + D * 4u);
        x0[j] = ld_shared4(src + c * 4u);
        x1[j] = ld_shared4(src + c * 4u + 16u);
      }
    }
    float mx = -INFINITY;
    CUTE_UNROLL
    for (int j = 0; j < C::kMaxCluster; ++j)
      if (j < nrank) mx = fmaxf(mx, ml[j].x);
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float l = 0.f;
    const float top = scaled_base(mx, sl2);
    if (mx != -INFINITY) {
      CUTE_UNROLL
      for (int j = 0; j < C::kMaxCluster; ++j) {
        if (j < nrank) {
          // The ratio of the bases each partial was computed against;
          // 0 for an empty partial (m = -inf).
          const float w = ex2(__fmul_rn(ml[j].x, sl2) - top);
          l += w * ml[j].y;
          acc[0] += w * x0[j].x;
          acc[1] += w * x0[j].y;
          acc[2] += w * x0[j].z;
          acc[3] += w * x0[j].w;
          acc[4] += w * x1[j].x;
          acc[5] += w * x1[j].y;
          acc[6] += w * x1[j].z;
          acc[7] += w * x1[j].w;
        }
      }
    }
    // l >= 1 when any key is visible (the max element contributes 2^0); a row that sees no key
    // writes zeros.
    const float inv = l > 0.f ? __fdividef(o_scale, l) : 0.f;
    uint4 out;
    out.x = pack2<Out>(acc[0] * inv, acc[1] * inv);
    out.y = pack2<Out>(acc[2] * inv, acc[3] * inv);
    out.z = pack2<Out>(acc[4] * inv, acc[5] * inv);
    out.w = pack2<Out>(acc[6] * inv, acc[7] * inv);
    st_global_128(ob + int64_t(row) * p.os.seq + c, out);
  }
  cluster_wait();  // phase 2
#endif
}

// Host side ----------------------------------------------------------------------------------

template <class E, int D, int KN>
SmallParams<E, D, KN> make_small_params(const FwdArgs& a, int cluster) {
  using C = SmallCfg<E, D, KN>;
  const auto gmem = [&](auto const* ptr, int64_t seq, int64_t heads, const Strides& st) {
    return operand_tensor(ptr, seq, D, heads, a.dims.batch, st);
  };
  using QK = typename C::QK;
  using VIn = std::conditional_t<E::kFp8, QK, typename C::PV>;  // V as the call holds it
  using VLayout = std::conditional_t<E::kFp8, typename C::LayoutV8, typename C::LayoutV>;
  SmallParams<E, D, KN> p{};
  p.tma_q =
      make_tma_copy(SM90_TMA_LOAD{},
                    gmem(device_ptr<const QK>(a.ops.q), a.dims.seq_q, a.dims.heads, a.ops.q_stride),
                    typename C::LayoutQ{}, Shape<_64, Int<D>>{}, _1{});
  p.tma_k = make_tma_copy(
      SM90_TMA_LOAD{},
      gmem(device_ptr<const QK>(a.ops.k), a.dims.seq_k, a.dims.kv_heads, a.ops.k_stride),
      typename C::LayoutK{}, Shape<Int<KN>, Int<D>>{}, _1{});
  p.tma_v = make_tma_copy(
      SM90_TMA_LOAD{},
      gmem(device_ptr<const VIn>(a.ops.v), a.dims.seq_k, a.dims.kv_heads, a.ops.v_stride),
      VLayout{}, Shape<Int<KN>, Int<D>>{}, _1{});
  p.o = device_ptr<typename C::Out>(a.ops.o);
  p.os = a.ops.o_stride;
  fill_sizes(p, a);
  p.rows = (64 + cluster - 1) / cluster;
  p.div_heads = FastDiv(p.heads);
  p.q_scale = device_ptr<const float>(a.fp8.q_scale);
  p.k_scale = device_ptr<const float>(a.fp8.k_scale);
  p.v_scale = device_ptr<const float>(a.fp8.v_scale);
  p.per_head = a.fp8.per_head_scales ? 1 : 0;
  return p;
}

// Launches the small kernel with KN-key slices; false (nothing launched) where it does not
// apply: more than kMaxCluster slices, or a grid over the hardware's y/z limits.
template <class E, int D, int KN, class Mask>
bool small_launch(const FwdArgs& a, cudaStream_t stream) {
  using C = SmallCfg<E, D, KN>;
  const int64_t cluster = (a.dims.seq_k + KN - 1) / KN;
  const int64_t m_blocks = (a.dims.seq_q + 63) / 64, bh = a.dims.batch * a.dims.heads;
  if (cluster > C::kMaxCluster || m_blocks > 65535 || bh > 65535) return false;
  const auto kernel = small_kernel<E, D, KN, Mask>;
  static std::atomic<uint64_t> configured{0};
  opt_in_smem(reinterpret_cast<const void*>(kernel), C::kSmemBytes, configured);
  const SmallParams<E, D, KN> p = make_small_params<E, D, KN>(a, int(cluster));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(cluster), unsigned(m_blocks), unsigned(bh));
  cfg.blockDim = dim3(C::kThreads, 1, 1);
  cfg.dynamicSmemBytes = C::kSmemBytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  add_pdl(cfg, attr);
  SDPA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
  return true;
}

// 128-key slices: 64-key slices make twice the CTAs (on the mission problem 256, two to an SM) and
// send 3 of 4 partials instead of 1 of 2, more exchange than the extra CTAs return, here and on
// B1 H8 S512 (measured: docs/log/2026-11-notebook.md, "Figures that lived in code comments").
constexpr int kSmallKeys = 128;

// The small path runs at D = 64 where it beats the main kernel: B2 H8 S256 (f16, bf16, causal or
// not), B1 H8 S512 and B1 H4 S1024 (causal or not). That is: grids the main kernel would leave
// more than half empty (it then runs 64-row tiles, one per CTA: make_params) and 2 to 8 key
// slices. A single slice (S <= 128) has nothing to split, and at D = 128 (S256) the two kernels
// are even, so both stay on the main kernel (measured: docs/log/2026-11-notebook.md, "mission
// problem: small-problem path for sm90" and "Figures that lived in code comments"). can_implement
// states the main kernel's needs; the small kernel is taken only where its shared memory fits as
// well.
template <class E, int D>
bool small_forward(const FwdArgs& a, const DeviceInfo& dev, cudaStream_t stream) {
  static_assert(D == 64, "the small path is built for head_dim 64 only");
  const int64_t tiles128 = (a.dims.seq_q + 127) / 128 * a.dims.batch * a.dims.heads;
  if (a.dims.seq_k <= kSmallKeys || 2 * tiles128 > dev.sms) return false;
  // The main kernel's general path; it also folds the sinks in.
  if (mask::needs_band(a) || mask::narrowed(a, D) || a.out.has_lse || a.mods.sinks) return false;
  if (SmallCfg<E, D, kSmallKeys>::kSmemBytes > dev.smem_optin_per_block) return false;
  return mask::dispatch_mask(a.mask.kind, int(a.dims.seq_q), int(a.dims.seq_k), [&](auto m) {
    return small_launch<E, D, kSmallKeys, decltype(m)>(a, stream);
  });
}

template <class E, int D>
void small_attributes(std::vector<KernelAttr>& out, const char* name) {
  const void* const fns[2] = {
      reinterpret_cast<const void*>(small_kernel<E, D, kSmallKeys, mask::NoMask<int>>),
      reinterpret_cast<const void*>(small_kernel<E, D, kSmallKeys, mask::CausalBottomRight<int>>)};
  push_attributes(out, "cutlass-sm90-small", name, D, fns, SmallCfg<E, D, kSmallKeys>::kSmemBytes);
}

}  // namespace sdpa::cutlass_sm90
