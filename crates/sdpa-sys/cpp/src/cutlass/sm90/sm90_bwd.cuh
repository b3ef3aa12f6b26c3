// cutlass's backward on sm_90a: the dK/dV pass, with dQ's products, on wgmma, inside the
// scalar backward's launches (scalar/scalar_bwd.cuh, run_backward: the D pre-pass, the dQ
// accumulator's conversion, the sinks' gradient), on the same Params and workspace, as
// cutlass-sm80's backward is. Head dims 64 and 128 (head_dim = head_dim_v = D; kernels.txt's
// `bwd` lines); can_implement (below) sends the others on.
//
// A CTA takes kBN = 128 keys of one K/V head, 64 a consumer warpgroup; K and V stay in shared
// memory while it walks the query tiles (kBM rows: 128 at D = 64, 64 at D = 128) of its group's
// heads that see them (the scalar kernel's tile tests). A producer warp streams each tile's Q
// and dO (TMA) and its rows' LSE and D (cp.async, a lane every 32nd row) into two stages, as
// FlashAttention-3's backward does; the consumers release a stage once its last product has
// read it, and issue no load but K's and V's, once (cp.async, zeros past the keys). Per query
// tile:
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ    wgmma SS, each warpgroup its 64 keys (M) by the tile's rows;
//   Pᵀ, dSᵀ                  per element (with softcap or ALiBi scalar::bwd::score_grad),
//                            then to 16 bit in the registers they were computed in: Sᵀ's
//                            accumulator layout is the A operand's of a product whose M is
//                            the keys and whose K is the rows; dSᵀ also stored to shared
//                            memory [key][row] (rows contiguous; at D = 128 two buffers, so
//                            the warpgroups meet once a step, when both have stored theirs);
//   dV += Pᵀ·dO              wgmma RS, under dSᵀ's store; dO read as [d][row] (an MN-major
//                            view of the same shared memory);
//   dQ = dS·K                wgmma SS: dSᵀ's bytes read as dS (row contiguous, MN-major) with
//                            K as [d][key], the warpgroups splitting the rows (128) or the
//                            head dim (64 rows);
//   dK += dSᵀ·Q              wgmma RS, Q read as [d][row];
//   dQ's f32 tile            staged in shared memory (two buffers) while dK runs, its rows as
//                            the accumulator holds them (consecutive rows, each in
//                            scalar::bwd::dq_col's order); one thread of the producer
//                            warpgroup's second warp adds it to the accumulator with one bulk
//                            reduction (cp.reduce.async.bulk) while the consumers go on to the
//                            next steps.
// dK and dV accumulate in registers over every tile. Keeping Pᵀ and dSᵀ in registers for dV and
// dK spares shared memory Pᵀ's stores and a third of those products' reads.
//
// The deterministic mode (kOrdered) is the same pass with the additions into each query tile
// ordered: a counter per tile (Params::dq_order, zeroed by the D pre-pass) says how many of the
// key blocks that see it have added; a block's dQ thread waits for its turn before its reduction
// and passes the turn on once it is complete, off the consumers' path. Turns run from the last
// key block that sees the tile down to the first: under a causal or band mask the later blocks
// start nearer the tile and reach it first (the other order made every block keep the pace of block
// 0: s16k-d128-causal 1.76x the atomic mode's time). The grid launches the key blocks in that order
// too (blockIdx.x counts down from the last), so a block waits only on blocks launched before it
// and the waits cannot close a cycle.
//
// Rows past the sequence: TMA fills those past the tensor's end with zeros, but packed rows there
// are the next sequence's, so the consumers zero them in a tile the sequence ends inside (a
// non-finite value there would reach this sequence's dK and dV through the products' zeros).
// As in cutlass-sm80's backward, a value a row does not see is zeroed in P and dS but the
// products still multiply it by the other operand: a non-finite input at a position some row
// does not see reaches gradients the reference keeps finite.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include <string>
#include <vector>

#include "common/turns.cuh"
#include "cutlass/dtype.cuh"
#include "cutlass/sm90/mainloop_params.cuh"
#include "cutlass/sm90/pipeline.cuh"
#include "cutlass/sm90/primitives.cuh"
#include "cutlass/sm90/softmax.cuh"
#include "cutlass/sm90/tile_config.cuh"
#include "scalar/scalar_bwd.cuh"

namespace sdpa::cutlass_sm90::bwd {

constexpr int kWG = 2;  // consumer warpgroups, 64 keys each
constexpr int kConsumers = 128 * kWG;
// and the producer warpgroup: its warp 0 loads, a thread of its warp 1 adds dQ into the accumulator
constexpr int kThreads = kConsumers + 128;
// Registers a thread: the producer warpgroup gives up what the consumers take (setmaxnreg), 24
// and 240 of the 168 a launch of 384 threads allows.
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;
static_assert(kWG * (kConsumerRegs - 168) <= 168 - kProducerRegs, "setmaxnreg would wait forever");
constexpr int kBN = 64 * kWG;  // keys a CTA
constexpr int kStages = 2;     // Q, dO and row statistics in flight
// Query rows a step: 128 at head dim 64, where a step of 64 rows is too short for its
// elementwise work and barriers (FlashAttention-3's 128 x 128 there), 64 above.
constexpr int rows_a_step(int head_dim) { return head_dim == 64 ? 128 : 64; }

using scalar::bwd::Params;

template <typename T, int D>
struct Cfg {
  static_assert(D % 64 == 0, "dQ's staging takes the accumulator's column order (dq_col) whole");
  static constexpr int kBM = rows_a_step(D);
  // dSᵀ buffers: two, so that the warpgroups meet once a step, where shared memory has room for
  // them (not at D = 64's 128-row steps).
  static constexpr int kDsBufs = kBM == 64 ? 2 : 1;
  using BM = Int<kBM>;
  using BN = Int<kBN>;
  using HD = Int<D>;
  using Stages = Int<kStages>;
  // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: the warpgroups tile the keys (M).
  using MmaSdP = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<T, T, float, Shape<_64, BM, HD>, GMMA::Major::K, GMMA::Major::K>(),
      Layout<Shape<Int<kWG>, _1, _1>>{}));
  // dV += Pᵀ·dO and dK += dSᵀ·Q: Pᵀ and dSᵀ (keys, rows) from registers, dO and Q as [d][row].
  using MmaDKV =
      decltype(make_tiled_mma(SM90::GMMA::rs_op_selector<T, T, float, Shape<_64, HD, BM>,
                                                         GMMA::Major::K, GMMA::Major::MN>(),
                              Layout<Shape<Int<kWG>, _1, _1>>{}));
  // A thread's Pᵀ or dSᵀ in 16 bit over its Sᵀ registers, as the A operand of dV's and dK's
  // products: k-block kb (16 rows) is Sᵀ's column groups 2kb and 2kb + 1 (convert_p).
  using LayoutPA =
      Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBM / 16>>, Stride<Stride<_1, _2, _4>, _0, _8>>;
  // dQ = dS·K: dS (rows, keys) row-contiguous, K as [d][key]; the warpgroups tile the rows
  // where a step has 128 of them, else the head dim.
  static constexpr bool kDqSplitsRows = kBM == 64 * kWG;
  using MmaDQ = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<T, T, float, Shape<_64, Int<kDqSplitsRows ? D : D / kWG>, BN>,
                                 GMMA::Major::MN, GMMA::Major::MN>(),
      std::conditional_t<kDqSplitsRows, Layout<Shape<Int<kWG>, _1, _1>>,
                         Layout<Shape<_1, Int<kWG>, _1>>>{}));

  // Q and dO (rows, d, stage), K and V (keys, d): rows of D in K-major swizzle atoms; the
  // transposed views (…t) are the same bytes as the MN-major B operands of dK/dV and dQ.
  using LayoutQ = decltype(tile_to_shape(KAtom<T, D>{}, Shape<BM, HD, Stages>{}));
  using LayoutQt = decltype(composition(
      LayoutQ{}, make_layout(Shape<HD, BM, Stages>{}, Stride<BM, _1, Int<kBM * D>>{})));
  using LayoutK = decltype(tile_to_shape(KAtom<T, D>{}, Shape<BN, HD>{}));
  using LayoutKt = decltype(composition(LayoutK{}, make_layout(Shape<HD, BN>{}, Stride<BN, _1>{})));
  // dSᵀ (keys, rows, buffer), rows contiguous, as the products' C partition stores it; dS
  // (rows, keys, buffer) is the same bytes as the MN-major A operand of dQ. Step u uses buffer
  // u % kDsBufs: with two, a step's stores need not wait for the step before's dQ to read it.
  using LayoutPt = decltype(tile_to_shape(KAtom<T, kBM>{}, Shape<BN, BM, Int<kDsBufs>>{}));
  using LayoutDS = decltype(composition(
      LayoutPt{}, make_layout(Shape<BM, BN, Int<kDsBufs>>{}, Stride<BN, _1, Int<kBN * kBM>>{})));

  struct Smem {
    alignas(1024) T q[kStages * kBM * D];
    alignas(1024) T d_o[kStages * kBM * D];
    alignas(1024) T k[kBN * D];
    alignas(1024) T v[kBN * D];
    alignas(1024) T dst[kDsBufs * kBN * kBM];
    alignas(128) float dq[2][kBM * D];  // tiles of dQ (step u in u % 2), as the accumulator's rows
    float lse[kStages][kBM];            // natural log, as the forward returns it
    float delta[kStages][kBM];
    uint64_t full[kStages];   // a stage's Q, dO (TMA bytes), LSE and D (the lanes' copies) landed
    uint64_t empty[kStages];  // every consumer thread is done with the stage
    uint64_t dq_full[2];      // every consumer thread has stored its part of the dQ tile
    uint64_t dq_empty[2];     // the dQ thread's reduction has read the tile
  };
  // +1 KB: the kernel aligns the dynamic smem base up to 1024 bytes (128-byte swizzle atoms).
  static constexpr int kSmemBytes = int(sizeof(Smem)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory over the sm_90 per-CTA limit");

  // Q and dO tiles (kBM rows, D) by TMA, from (rows, d, head, batch) tensors.
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorOf<T, D>>(),
                                      take<0, 2>(LayoutQ{}), Shape<BM, HD>{}, _1{}));
};

// The producer's TMA descriptors, a kernel parameter of their own beside the scalar backward's
// Params (which every backend's kernels share).
template <typename T, int D>
struct Loads {
  typename Cfg<T, D>::TmaQ q, d_o;
};

// An mbarrier arrival once every cp.async this thread has issued so far has landed, counted
// among the arrivals the barrier was initialized to expect.
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar))
               : "memory");
}

// One round of wgmma over every k-block of A and B into C (zeroed first where kZero), committed
// as one group; waited for where kWait >= 0 (that many groups left in flight).
template <bool kZero, int kWait, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void wg_gemm(Mma& mma, const TA& a, const TB& b, TC& c) {
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZero) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(c);
}

// Rows [0, R) of a 16-bit tensor at `base` (row stride `rs` elements, D wide) into the swizzled
// tile `tile` (coordinates (row, col)) by cp.async, by consumer thread `tid`; rows at or past
// `rows` as zeros.
template <int R, int D, class Tile, typename T>
__device__ __forceinline__ void load_rows(Tile&& tile, const T* base, int64_t rs, int64_t rows,
                                          int tid) {
  constexpr int CH = D / 8;
  for (int c = tid; c < R * CH; c += kConsumers) {
    const int r = c / CH, ch = c % CH;
    const bool in = r < rows;
    cp_async_16(smem_addr(&tile(r, ch * 8)), base + (in ? r * rs + ch * 8 : 0), in);
  }
}

// Rows [r0, R) of stage st of the tiles Q and dO (R rows) as zeros, by consumer thread `tid`.
template <int R, int D, class Tile>
__device__ __forceinline__ void zero_rows(Tile&& q, Tile&& d_o, int r0, int tid) {
  constexpr int CH = D / 8;
  for (int c = r0 * CH + tid; c < R * CH; c += kConsumers) {
    const int r = c / CH, ch = c % CH;
    *reinterpret_cast<uint4*>(&q(r, ch * 8)) = make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(&d_o(r, ch * 8)) = make_uint4(0, 0, 0, 0);
  }
}

template <typename T, int D, bool kOrdered>
__global__ void __launch_bounds__(kThreads, 1)
    wgmma_dkdv_kernel(const __grid_constant__ Params pm, const __grid_constant__ Loads<T, D> tma) {
#ifdef SDPA_SM90_DEVICE
  using C = Cfg<T, D>;
  constexpr int kBM = C::kBM;
  const KernelParams& p = pm.base;
  auto& sm = smem_storage<typename C::Smem>();
  // Rows, keys and tile starts in 32-bit int (can_implement bounds them); addresses in 64-bit.
  // kOrdered: key blocks launch last first (see the turns below).
  const int nb = kOrdered ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int n0 = nb * kBN, hk = int(blockIdx.y), b = int(blockIdx.z);
  const scalar::bwd::SeqView s = scalar::bwd::seq_view(pm, b);
  const int seq_q = int(s.seq.seq_q), seq_k = int(s.seq.seq_k), group = int(p.group);
  const mask::Band<int> mask = s.mask.as<int>();
  const int key_rows = pm.seqs.cu_k != nullptr ? seq_k : int(p.seq_k);
  if (n0 >= key_rows) return;  // CTA-uniform, before any barrier

  Tensor sQ = make_tensor(make_smem_ptr(sm.q), typename C::LayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(sm.d_o), typename C::LayoutQ{});
  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(tma.q.get_tma_descriptor());
    prefetch_tma_descriptor(tma.d_o.get_tma_descriptor());
    for (int st = 0; st < kStages; ++st) {
      mbar_init(&sm.full[st], 1 + 32);  // the TMA thread's, and each lane's copies landed
      mbar_init(&sm.empty[st], kConsumers);
    }
    for (int i = 0; i < 2; ++i) {
      mbar_init(&sm.dq_full[i], kConsumers);
      mbar_init(&sm.dq_empty[i], 1);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();  // the last CTA-wide barrier: the roles part here

  // The query tiles that see the CTA's keys, in order: (head of the group, first row).
  struct Step {
    int gi, m0;
  };
  const auto next_step = [&](int gi, int m0) {
    for (; gi < group; ++gi, m0 = 0)
      for (; m0 < seq_q; m0 += kBM)
        if (mask.key_end(m0, kBM) > n0 && mask.key_begin(m0, kBM) < n0 + kBN) return Step{gi, m0};
    return Step{group, 0};
  };

  if (threadIdx.x < 128) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (threadIdx.x >= 64) return;
    const int lane = int(threadIdx.x) % 32;
    if (threadIdx.x >= 32) {
      // The dQ thread (the second warp's first): step u's tile of dQ, once stored, added into the
      // accumulator (kOrdered: in its turn, waited for while the consumers compute the tile, and
      // passed on once the addition is complete). A tile's rows are consecutive rows of the
      // accumulator (as of the LSE: lse_index), staged in its order: one reduction a tile.
      if (threadIdx.x != 32) return;
      int u = 0;
      for (Step t = next_step(0, 0); t.gi < group; t = next_step(t.gi, t.m0 + kBM), ++u) {
        const int slot = u % 2, h = hk * group + t.gi;
        float* const tile =
            pm.dq_acc + lse_index(pm.seqs, s.seq, b, h, p.heads, p.seq_q, int64_t(t.m0)) * D;
        int* turn = nullptr;
        if constexpr (kOrdered) {
          turn = pm.dq_order + (int64_t(b) * p.heads + h) * pm.order_tiles + t.m0 / kBM;
          wait_for_turn(turn, (mask.key_end(t.m0, kBM) - 1) / kBN - nb);
        }
        Bar::wait(&sm.dq_full[slot], (u / 2) & 1);
        bulk_add_f32(tile, smem_addr(sm.dq[slot]), min(seq_q - t.m0, kBM) * D * 4);
        bulk_commit();
        bulk_wait<false>();  // the tile read: its buffer is free
        Bar::arrive(&sm.dq_empty[slot]);
        if constexpr (kOrdered) {
          bulk_wait<true>();  // added
          pass_the_turn(turn);
        }
      }
      return;
    }
    // The loads: warp 0 fills stage u % kStages with step u's Q and dO (lane 0's TMA copies)
    // and its rows' LSE and D (each lane's cp.async), once the consumers have released the
    // stage's use before.
    const bool packed = pm.seqs.total_q > 0;
    Tensor mQ =
        tma.q.get_tma_tensor(make_shape(packed ? int(pm.seqs.total_q) : int(p.seq_q), Int<D>{},
                                        int(p.heads), packed ? 1 : int(pm.batch)));
    Tensor mdO = tma.d_o.get_tma_tensor(shape(mQ));
    const int qb = packed ? 0 : b;
    int u = 0;
    for (Step t = next_step(0, 0); t.gi < group; t = next_step(t.gi, t.m0 + kBM), ++u) {
      const int st = u % kStages;
      if (u >= kStages) Bar::wait(&sm.empty[st], ((u / kStages) - 1) & 1);
      const int h = hk * group + t.gi;
      if (lane == 0) {
        uint64_t& bar = sm.full[st];
        Bar::arrive_and_expect_tx(&bar, 2 * kBM * D * int(sizeof(T)));
        const auto rows = [&](auto& m) {
          return local_tile(domain_offset(make_coord(int(s.seq.q0) + t.m0, _0{}), m(_, _, h, qb)),
                            Shape<Int<kBM>, Int<D>>{}, make_coord(_0{}, _0{}));
        };
        auto tQ = tma_partition(tma.q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ(_, _, st)),
                                group_modes<0, 2>(rows(mQ)));
        auto tdO = tma_partition(tma.d_o, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO(_, _, st)),
                                 group_modes<0, 2>(rows(mdO)));
        copy(tma.q.with(bar), get<0>(tQ), get<1>(tQ));
        copy(tma.d_o.with(bar), get<0>(tdO), get<1>(tdO));
      }
      const int64_t row0 = lse_index(pm.seqs, s.seq, b, h, p.heads, p.seq_q, int64_t(t.m0));
#pragma unroll 1
      for (int r = lane; r < kBM; r += 32) {
        const bool in = t.m0 + r < seq_q;
        cp_async_4(smem_addr(&sm.lse[st][r]), pm.lse + (in ? row0 + r : 0), in);
        cp_async_4(smem_addr(&sm.delta[st][r]), pm.delta + (in ? row0 + r : 0), in);
      }
      cp_async_arrive(&sm.full[st]);
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
  const int tid = int(threadIdx.x) - 128;  // consumer thread: 0 .. kConsumers - 1
  Tensor sQt = make_tensor(make_smem_ptr(sm.q), typename C::LayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(sm.d_o), typename C::LayoutQt{});
  Tensor sK = make_tensor(make_smem_ptr(sm.k), typename C::LayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(sm.k), typename C::LayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(sm.v), typename C::LayoutK{});
  Tensor sdSt = make_tensor(make_smem_ptr(sm.dst), typename C::LayoutPt{});
  Tensor sdS = make_tensor(make_smem_ptr(sm.dst), typename C::LayoutDS{});

  const T* kb = reinterpret_cast<const T*>(p.k) +
                (b * p.ks.batch + hk * p.ks.head + (s.seq.k0 + n0) * p.ks.seq);
  const T* vb = reinterpret_cast<const T*>(p.v) +
                (b * p.vs.batch + hk * p.vs.head + (s.seq.k0 + n0) * p.vs.seq);
  load_rows<kBN, D>(sK, kb, p.ks.seq, seq_k - n0, tid);
  load_rows<kBN, D>(sV, vb, p.vs.seq, seq_k - n0, tid);
  cute::cp_async_fence();
  cute::cp_async_wait<0>();
  fence_proxy_async();        // cp.async's writes, for wgmma's reads
  named_sync(1, kConsumers);  // every consumer's rows of K and V in place

  typename C::MmaSdP mma_sdp;
  typename C::MmaDKV mma_dkv;
  typename C::MmaDQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);    // (MMA, MMA_M, MMA_K)
  Tensor tSrV = thr_sdp.partition_fragment_A(sV);    // (MMA, MMA_M, MMA_K)
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);    // (MMA, MMA_N, MMA_K, stage)
  Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tKVrQt = thr_dkv.partition_fragment_B(sQt);
  Tensor tKVrdOt = thr_dkv.partition_fragment_B(sdOt);
  Tensor tQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tQrKt = thr_dq.partition_fragment_B(sKt);
  // dSᵀ to shared memory by stmatrix: four 8x8 tiles an instruction, rows of keys.
  auto copy_dst = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, T>{}, mma_sdp);
  auto thr_copy_dst = copy_dst.get_thread_slice(tid);
  Tensor tdSsdSt = thr_copy_dst.partition_D(sdSt);
  // (key, row) of each Sᵀ element this thread holds, and (row, d) of each dQ element.
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBN>, Int<kBM>>{}));
  Tensor cdQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<D>>{}));

  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kBN>, Int<D>>{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBN>, Int<D>>{});
  clear(tdVrdV);
  clear(tdKrdK);

  Step cur = next_step(0, 0);
  for (int u = 0; cur.gi < group; ++u) {
    const int st = u % kStages;
    const int h = hk * group + cur.gi;
    const int rows_left = seq_q - cur.m0, keys_left = seq_k - n0;
    Bar::wait(&sm.full[st], (u / kStages) & 1);
    if (rows_left < kBM) {  // rows past the sequence: zeros, not the next sequence's rows
      zero_rows<kBM, D>(sQ(_, _, st), sdO(_, _, st), rows_left, tid);
      fence_proxy_async();
      named_sync(1, kConsumers);  // CTA-uniform: every consumer's zeros in place
    } else if constexpr (C::kDsBufs == 1) {
      named_sync(1, kConsumers);  // the step before's dQ has read dSᵀ (and the zeros' barrier)
    }

    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBN>, Int<kBM>>{});
    Tensor tSrdP = partition_fragment_C(mma_sdp, Shape<Int<kBN>, Int<kBM>>{});
    wg_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, st), tSrS);
    wg_gemm<true, -1>(mma_sdp, tSrV, tSrdO(_, _, _, st), tSrdP);
    const Step nxt = next_step(cur.gi, cur.m0 + kBM);

    // Pᵀ into tSrS, scale · dSᵀ into tSrdP; each to 16 bit in registers (rP, rdS) for dV's and
    // dK's products, and dSᵀ to shared memory for dQ's. Without score mods a score takes one
    // FMA and one MUFU (and a select where the tile hides pairs); with them, score_grad.
    Tensor rP = make_tensor<T>(typename C::LayoutPA{});
    Tensor rdSc = make_tensor_like<T>(tSrdP);  // dSᵀ in 16 bit, in the accumulator's layout
    Tensor rdS = make_tensor(rdSc.data(), typename C::LayoutPA{});
    const auto issue_dv = [&]() {
      convert_p(rP, tSrS);
      warpgroup_fence_operand(rP);
      wg_gemm<false, -1>(mma_dkv, rP, tKVrdOt(_, _, _, st), tdVrdV);
    };
    const bool masked = mask.tile_masked(cur.m0, kBM, n0, kBN);
    const bool whole = !masked && rows_left >= kBM && keys_left >= kBN;  // every pair visible
    // A row's LSE and D: a thread's elements come in pairs of adjacent rows (e, e + 1).
    const uint32_t lse_at = smem_addr(&sm.lse[st][0]), delta_at = smem_addr(&sm.delta[st][0]);
    const auto row_pair = [&](uint32_t at, int e) { return ld_shared2(at + 4 * get<1>(cS(e))); };
    const auto visible = [&](int e) {
      const int qi = get<1>(cS(e)), kj = get<0>(cS(e));
      return qi < rows_left && kj < keys_left && (!masked || mask.sees(cur.m0 + qi, n0 + kj));
    };
    warpgroup_wait<1>();  // Sᵀ
    warpgroup_fence_operand(tSrS);
    if (pm.cap2 == 0.f && pm.alibi == nullptr) {
      // No score mods: one FMA and one MUFU a score, then, on a tile some pair of which is not
      // visible, P and dS of those pairs zeroed (a select: whatever their scores were).
      CUTE_UNROLL
      for (int e = 0; e < size(tSrS); e += 2) {
        const float2 lse = row_pair(lse_at, e);
        tSrS(e) = ex2(fmaf(tSrS(e), p.scale_log2, -lse.x * kLog2e));
        tSrS(e + 1) = ex2(fmaf(tSrS(e + 1), p.scale_log2, -lse.y * kLog2e));
      }
      warpgroup_wait<0>();  // dPᵀ
      warpgroup_fence_operand(tSrdP);
      CUTE_UNROLL
      for (int e = 0; e < size(tSrS); e += 2) {
        const float2 delta = row_pair(delta_at, e);
        tSrdP(e) = tSrS(e) * (tSrdP(e) - delta.x) * pm.scale;
        tSrdP(e + 1) = tSrS(e + 1) * (tSrdP(e + 1) - delta.y) * pm.scale;
      }
      if (!whole) {
        CUTE_UNROLL
        for (int e = 0; e < size(tSrS); ++e) {
          const bool in = visible(e);
          tSrS(e) = in ? tSrS(e) : 0.f;
          tSrdP(e) = in ? tSrdP(e) : 0.f;
        }
      }
    } else {
      warpgroup_wait<0>();  // dPᵀ
      warpgroup_fence_operand(tSrdP);
      const float slope2 = scalar::bwd::slope2_of(pm, b, h);
      const int diag = cur.m0 + seq_k - seq_q - n0;  // key - row on the bottom-right diagonal
      CUTE_UNROLL
      for (int e = 0; e < size(tSrS); e += 2) {
        const float2 lse = row_pair(lse_at, e), delta = row_pair(delta_at, e);
        CUTE_UNROLL
        for (int i = 0; i < 2; ++i) {
          const int qi = get<1>(cS(e + i)), kj = get<0>(cS(e + i));
          const scalar::bwd::ScoreGrad g = scalar::bwd::score_grad(
              pm, tSrS(e + i), tSrdP(e + i), (i ? lse.y : lse.x) * kLog2e, i ? delta.y : delta.x,
              slope2, abs(qi + diag - kj), visible(e + i));
          tSrS(e + i) = g.p;
          tSrdP(e + i) = g.ds;
        }
      }
    }
    issue_dv();
    convert_p(rdS, tSrdP);
    warpgroup_fence_operand(rdS);
    // Two buffers: buffer u % 2 was last read by step u - 2's dQ, which both warpgroups waited
    // for before the barrier below in step u - 1. One: the barrier at the step's start.
    const int ds_slot = u % C::kDsBufs;
    cute::copy(copy_dst, thr_copy_dst.retile_S(rdSc), tdSsdSt(_, _, _, ds_slot));
    fence_proxy_async();
    named_sync(1, kConsumers);  // both warpgroups' keys stored (dQ reads all of dS)

    // dQ = dS·K, then dK += dSᵀ·Q, which runs while dQ's tile is staged in shared memory for
    // the dQ thread (its buffer free once that thread's reduction has read the tile of two steps
    // back).
    Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBM>, Int<D>>{});
    wg_gemm<true, -1>(mma_dq, tQrdS(_, _, _, ds_slot), tQrKt, tdQrdQ);
    wg_gemm<false, -1>(mma_dkv, rdS, tKVrQt(_, _, _, st), tdKrdK);
    warpgroup_wait<1>();  // dV and dQ
    warpgroup_fence_operand(rP);
    warpgroup_fence_operand(tdQrdQ);
    const int slot = u % 2;
    if (u >= 2) Bar::wait(&sm.dq_empty[slot], ((u / 2) - 1) & 1);
    // The accumulator's column order (scalar::bwd::dq_col) keyed by the row's index mod 8: the
    // thread's rows of the tile are 8 apart, so one key serves them all.
    const int64_t row0 = lse_index(pm.seqs, s.seq, b, h, p.heads, p.seq_q, int64_t(cur.m0));
    const int dq_key = int((row0 + get<0>(cdQ(0))) & 7) << 3;
    CUTE_UNROLL
    for (int e = 0; e < size(tdQrdQ); e += 2)
      st_shared2(smem_addr(&sm.dq[slot][get<0>(cdQ(e)) * D + (get<1>(cdQ(e)) ^ dq_key)]), tdQrdQ(e),
                 tdQrdQ(e + 1));
    fence_proxy_async();  // for the bulk reductions' reads
    Bar::arrive(&sm.dq_full[slot]);
    warpgroup_wait<0>();  // dK: its operands may be overwritten next step
    warpgroup_fence_operand(rdS);
    warpgroup_fence_operand(tdVrdV);
    warpgroup_fence_operand(tdKrdK);
    Bar::arrive(&sm.empty[st]);  // the stage's last reader
    cur = nxt;
  }
  warpgroup_fence_operand(tdVrdV);
  warpgroup_fence_operand(tdKrdK);

  // dK and dV rows of this thread's keys (zeros past the sequence's keys in dense K/V).
  Tensor cKV = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBN>, Int<D>>{}));
  CUTE_UNROLL
  for (int e = 0; e < size(tdVrdV); e += 2) {
    const int j = n0 + get<0>(cKV(e));
    if (j >= key_rows) continue;
    const int d = get<1>(cKV(e));
    T* dk_row = reinterpret_cast<T*>(pm.dk) +
                (b * pm.dks.batch + hk * pm.dks.head + (s.seq.k0 + j) * pm.dks.seq);
    T* dv_row = reinterpret_cast<T*>(pm.dv) +
                (b * pm.dvs.batch + hk * pm.dvs.head + (s.seq.k0 + j) * pm.dvs.seq);
    *reinterpret_cast<uint32_t*>(dk_row + d) = pack2<T>(tdKrdK(e), tdKrdK(e + 1));
    *reinterpret_cast<uint32_t*>(dv_row + d) = pack2<T>(tdVrdV(e), tdVrdV(e + 1));
  }
#endif
}

template <typename T, int D>
std::string can_implement(const BwdArgs& a, const DeviceInfo& dev) {
  const FwdArgs& f = a.fwd;
  if (f.dims.head_dim != D || f.dims.head_dim_v != D)
    return "cutlass's backward runs head_dim = head_dim_v = " + std::to_string(D) +
           " on this instance";
  // The band's indices reach 2 (seq_q + seq_k) past zero (mask::Band), held in int here.
  if (2 * (f.dims.seq_q + f.dims.seq_k) + kBN > limits::kIntMax)
    return "seq_q + seq_k = " + std::to_string(f.dims.seq_q + f.dims.seq_k) +
           " exceeds 2^30 - 64: cutlass's backward forms the mask's indices in 32-bit int";
  return limits::first({sm90_only(dev), limits::int_sequences(f, "cutlass backward", kBN),
                        scalar::bwd::can_implement<native_t<T>, D>(a, dev),
                        tma_operand(f.ops.q, f.ops.q_stride, "q", int(sizeof(T))),
                        tma_operand(a.grads.d_o, a.grads.do_stride, "dO", int(sizeof(T))),
                        limits::smem_per_block(dev, Cfg<T, D>::kSmemBytes)});
}

// The producer's TMA descriptors of Q and dO: (rows, d, head, batch), packed rows one batch
// entry (as the forward's, operand_tensor).
template <typename T, int D>
Loads<T, D> make_loads(const BwdArgs& a) {
  const FwdArgs& f = a.fwd;
  const bool packed = f.seqs.total_q > 0;
  const int64_t rows = packed ? f.seqs.total_q : f.dims.seq_q, batch = packed ? 1 : f.dims.batch;
  const auto tma = [&](uint64_t ptr, const Strides& st) {
    return make_tma_copy(
        SM90_TMA_LOAD{}, operand_tensor(device_ptr<const T>(ptr), rows, D, f.dims.heads, batch, st),
        take<0, 2>(typename Cfg<T, D>::LayoutQ{}), Shape<Int<Cfg<T, D>::kBM>, Int<D>>{}, _1{});
  };
  return {tma(f.ops.q, f.ops.q_stride), tma(a.grads.d_o, a.grads.do_stride)};
}

// The workspace: the scalar backward's, with the ordered mode's accumulator and counters.
inline int64_t workspace_bytes(const BwdArgs& a) {
  return scalar::bwd::workspace_bytes(a, rows_a_step(int(a.fwd.dims.head_dim)));
}

template <typename T, int D>
void backward(const BwdArgs& a, const DeviceInfo&, cudaStream_t stream) {
  const FwdArgs& f = a.fwd;
  const dim3 grid(unsigned((f.dims.seq_k + kBN - 1) / kBN), unsigned(f.dims.kv_heads),
                  unsigned(f.dims.batch));
  constexpr int kSmem = Cfg<T, D>::kSmemBytes;
  const Loads<T, D> loads = make_loads<T, D>(a);
  scalar::bwd::run_backward<native_t<T>, D, Cfg<T, D>::kBM>(
      a, stream, "cutlass", [&](const Params& pm) {
        if (pm.dq_order != nullptr)
          scalar::bwd::launch<wgmma_dkdv_kernel<T, D, true>, kSmem>(grid, kThreads, stream, pm,
                                                                    loads);
        else
          scalar::bwd::launch<wgmma_dkdv_kernel<T, D, false>, kSmem>(grid, kThreads, stream, pm,
                                                                     loads);
        SDPA_LAUNCH_CHECK("cutlass dkdv_kernel launch");
      });
}

template <typename T, int D>
void attributes(std::vector<KernelAttr>& out, const DeviceInfo&) {
  constexpr int32_t kSmem = Cfg<T, D>::kSmemBytes;
  scalar::bwd::push_kernels<T, D>(
      out, "cutlass",
      {{"bwd_dkdv_ordered_", scalar::bwd::kernel_ptr(wgmma_dkdv_kernel<T, D, true>), kSmem},
       {"bwd_dkdv_atomic_", scalar::bwd::kernel_ptr(wgmma_dkdv_kernel<T, D, false>), kSmem}});
}

}  // namespace sdpa::cutlass_sm90::bwd
