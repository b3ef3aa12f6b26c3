// cutlass's backward on sm_90a: the dK/dV pass, with dQ's products, on wgmma, inside the
// scalar backward's launches (scalar/scalar_bwd.cuh, run_backward: the D pre-pass, the dQ
// accumulator's conversion, the sinks' gradient), on the same Params and workspace, as
// cutlass-sm80's backward is. Head dims 64 and 128 (head_dim = head_dim_v = D; kernels.txt's
// `bwd` lines); can_implement (below) sends the others on.
//
// A CTA takes kBN = 128 keys of one K/V head, 64 a consumer warpgroup; K and V stay in shared
// memory while it walks the 64-row query tiles of its group's heads that see them (the scalar
// kernel's tile tests). Q, dO and the rows' LSE and D stream in by cp.async, two stages: the
// next tile's copies are issued under this one's first products. Per query tile:
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ    wgmma SS, each warpgroup its 64 keys (M) by the tile's 64 rows;
//   Pᵀ, dSᵀ                  per element (scalar::bwd::score_grad), then to 16 bit in the
//                            registers they were computed in: Sᵀ's accumulator layout is the
//                            A operand's of a product whose M is the keys and whose K is the
//                            rows; dSᵀ also stored to shared memory [key][row] (rows
//                            contiguous);
//   dV += Pᵀ·dO              wgmma RS, under dSᵀ's store; dO read as [d][row] (an MN-major
//                            view of the same shared memory);
//   dQ = dS·K                wgmma SS: dSᵀ's bytes read as dS (row contiguous, MN-major) with
//                            K as [d][key], the warpgroups splitting the head dim;
//   dK += dSᵀ·Q              wgmma RS, Q read as [d][row];
//   dQ's f32 tile            staged in shared memory while dK runs, and added to the
//                            accumulator a row at a time by bulk reductions
//                            (cp.reduce.async.bulk), which the next step's work overlaps.
// dK and dV accumulate in registers over every tile. Keeping Pᵀ and dSᵀ in registers for dV and
// dK spares shared memory Pᵀ's stores and a third of those products' reads.
//
// The deterministic mode (kOrdered) is the same pass with the additions into each query tile
// ordered: a counter per tile (Params::dq_order, zeroed by the D pre-pass) says how many of the
// key blocks that see it have added; a block waits for its turn before its reductions and passes
// the turn on once they are complete. Turns run from the last key block that sees the tile down
// to the first: under a causal or band mask the later blocks start nearer the tile and reach it
// first (the other order made every block keep the pace of block 0: s16k-d128-causal 1.76x the
// atomic mode's time). The grid launches the key blocks in that order too (blockIdx.x counts
// down from the last), so a block waits only on blocks launched before it and the waits cannot
// close a cycle.
//
// This is FlashAttention-2's order on Hopper's instructions: no warp specialization and no TMA
// loads yet (FlashAttention-3's structure is the step after; docs/design.md, "The backward").
// As in cutlass-sm80's backward, a value a row does not see is zeroed in P and dS but the
// products still multiply it by the other operand: a non-finite input at a position some row
// does not see reaches gradients the reference keeps finite.
#pragma once

#include <string>
#include <vector>

#include "common/turns.cuh"
#include "cutlass/dtype.cuh"
#include "cutlass/sm90/primitives.cuh"
#include "cutlass/sm90/softmax.cuh"
#include "cutlass/sm90/tile_config.cuh"
#include "scalar/scalar_bwd.cuh"

namespace sdpa::cutlass_sm90::bwd {

constexpr int kWG = 2;  // consumer warpgroups, 64 keys each
constexpr int kThreads = 128 * kWG;
constexpr int kBN = 64 * kWG;  // keys a CTA
constexpr int kBM = 64;        // query rows a step
constexpr int kStages = 2;     // Q, dO and row statistics in flight

// A row of the dQ tile in shared memory: D floats and 16 bytes, so that the 8-byte stores of a
// warp's accumulator pairs (8 rows, 4 column pairs) take the two wavefronts they must.
template <int D>
constexpr int kDqRow = D + 4;

using scalar::bwd::Params;

template <typename T, int D>
struct Cfg {
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
  // dQ = dS·K: dS (rows, keys) row-contiguous, K as [d][key]; the warpgroups tile the head dim.
  using MmaDQ =
      decltype(make_tiled_mma(SM90::GMMA::ss_op_selector<T, T, float, Shape<BM, Int<D / kWG>, BN>,
                                                         GMMA::Major::MN, GMMA::Major::MN>(),
                              Layout<Shape<_1, Int<kWG>, _1>>{}));

  // Q and dO (rows, d, stage), K and V (keys, d): rows of D in K-major swizzle atoms; the
  // transposed views (…t) are the same bytes as the MN-major B operands of dK/dV and dQ.
  using LayoutQ = decltype(tile_to_shape(KAtom<T, D>{}, Shape<BM, HD, Stages>{}));
  using LayoutQt = decltype(composition(
      LayoutQ{}, make_layout(Shape<HD, BM, Stages>{}, Stride<BM, _1, Int<kBM * D>>{})));
  using LayoutK = decltype(tile_to_shape(KAtom<T, D>{}, Shape<BN, HD>{}));
  using LayoutKt = decltype(composition(LayoutK{}, make_layout(Shape<HD, BN>{}, Stride<BN, _1>{})));
  // dSᵀ (keys, rows), rows contiguous, as the products' C partition stores it; dS (rows, keys)
  // is the same bytes as the MN-major A operand of dQ.
  using LayoutPt = decltype(tile_to_shape(KAtom<T, kBM>{}, Shape<BN, BM>{}));
  using LayoutDS =
      decltype(composition(LayoutPt{}, make_layout(Shape<BM, BN>{}, Stride<BN, _1>{})));

  struct Smem {
    alignas(1024) T q[kStages * kBM * D];
    alignas(1024) T d_o[kStages * kBM * D];
    alignas(1024) T k[kBN * D];
    alignas(1024) T v[kBN * D];
    alignas(1024) T dst[kBN * kBM];
    alignas(128) float dq[kBM * kDqRow<D>];  // a tile of dQ, rows padded (kDqRow)
    float lse[kStages][kBM];                 // natural log, as the forward returns it
    float delta[kStages][kBM];
  };
  // +1 KB: the kernel aligns the dynamic smem base up to 1024 bytes (128-byte swizzle atoms).
  static constexpr int kSmemBytes = int(sizeof(Smem)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory over the sm_90 per-CTA limit");
};

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
// tile `tile` (coordinates (row, col)) by cp.async; rows at or past `rows` as zeros.
template <int R, int D, class Tile, typename T>
__device__ __forceinline__ void load_rows(Tile&& tile, const T* base, int64_t rs, int64_t rows) {
  constexpr int CH = D / 8;
  for (int c = threadIdx.x; c < R * CH; c += kThreads) {
    const int r = c / CH, ch = c % CH;
    const bool in = r < rows;
    cp_async_16(smem_addr(&tile(r, ch * 8)), base + (in ? r * rs + ch * 8 : 0), in);
  }
}

template <typename T, int D, bool kOrdered>
__global__ void __launch_bounds__(kThreads, 1)
    wgmma_dkdv_kernel(const __grid_constant__ Params pm) {
#ifdef SDPA_SM90_DEVICE
  using C = Cfg<T, D>;
  const KernelParams& p = pm.base;
  auto& sm = smem_storage<typename C::Smem>();
  const int tid = threadIdx.x;
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
  Tensor sQt = make_tensor(make_smem_ptr(sm.q), typename C::LayoutQt{});
  Tensor sdO = make_tensor(make_smem_ptr(sm.d_o), typename C::LayoutQ{});
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
  load_rows<kBN, D>(sK, kb, p.ks.seq, seq_k - n0);
  load_rows<kBN, D>(sV, vb, p.vs.seq, seq_k - n0);

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
  // Q, dO, LSE and D of a step's rows into stage `st`.
  const auto issue = [&](const Step& t, int st) {
    const int64_t h = int64_t(hk) * group + t.gi;
    const T* qb = reinterpret_cast<const T*>(p.q) +
                  (b * p.qs.batch + h * p.qs.head + (s.seq.q0 + t.m0) * p.qs.seq);
    const T* gb = reinterpret_cast<const T*>(pm.d_o) +
                  (b * pm.dos.batch + h * pm.dos.head + (s.seq.q0 + t.m0) * pm.dos.seq);
    load_rows<kBM, D>(sQ(_, _, st), qb, p.qs.seq, seq_q - t.m0);
    load_rows<kBM, D>(sdO(_, _, st), gb, pm.dos.seq, seq_q - t.m0);
    for (int r = tid; r < kBM; r += kThreads) {
      const bool in = t.m0 + r < seq_q;
      const int64_t at =
          in ? lse_index(pm.seqs, s.seq, b, h, p.heads, p.seq_q, int64_t(t.m0 + r)) : int64_t(0);
      cp_async_4(smem_addr(&sm.lse[st][r]), pm.lse + at, in);
      cp_async_4(smem_addr(&sm.delta[st][r]), pm.delta + at, in);
    }
  };

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

  int* turn = nullptr;  // kOrdered: the counter of the last step's query tile
  Step cur = next_step(0, 0);
  if (cur.gi < group) issue(cur, 0);
  cute::cp_async_fence();
  for (int st = 0; cur.gi < group; st ^= 1) {
    const int h = hk * group + cur.gi;
    cute::cp_async_wait<0>();
    fence_proxy_async();                   // cp.async's writes, for wgmma's reads
    if (tid < kBM) bulk_wait<kOrdered>();  // the last step's dQ rows read (kOrdered: added)
    // Stage st landed for every thread; the last step's reads of stage st ^ 1, of dSᵀ and of
    // the dQ tile are done.
    __syncthreads();

    // The products first: the next step's copies and the turn's release are issued under them.
    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBN>, Int<kBM>>{});
    Tensor tSrdP = partition_fragment_C(mma_sdp, Shape<Int<kBN>, Int<kBM>>{});
    wg_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, st), tSrS);
    wg_gemm<true, -1>(mma_sdp, tSrV, tSrdO(_, _, _, st), tSrdP);
    if (kOrdered && tid == 0 && turn != nullptr) pass_the_turn(turn);
    const Step nxt = next_step(cur.gi, cur.m0 + kBM);
    if (nxt.gi < group) issue(nxt, st ^ 1);
    cute::cp_async_fence();

    // Pᵀ into tSrS, scale · dSᵀ into tSrdP; each to 16 bit in registers (rP, rdS) for dV's and
    // dK's products, and dSᵀ to shared memory for dQ's. A plain tile (every pair visible, no
    // score mods) takes one FMA and one MUFU a score; any other tile goes through score_grad.
    Tensor rP = make_tensor<T>(typename C::LayoutPA{});
    Tensor rdSc = make_tensor_like<T>(tSrdP);  // dSᵀ in 16 bit, in the accumulator's layout
    Tensor rdS = make_tensor(rdSc.data(), typename C::LayoutPA{});
    const auto issue_dv = [&]() {
      convert_p(rP, tSrS);
      warpgroup_fence_operand(rP);
      wg_gemm<false, -1>(mma_dkv, rP, tKVrdOt(_, _, _, st), tdVrdV);
    };
    const bool masked = mask.tile_masked(cur.m0, kBM, n0, kBN);
    const int rows_left = seq_q - cur.m0, keys_left = seq_k - n0;
    const bool plain =
        !masked && rows_left >= kBM && keys_left >= kBN && pm.cap2 == 0.f && pm.alibi == nullptr;
    // A row's LSE and D: a thread's elements come in pairs of adjacent rows (e, e + 1).
    const uint32_t lse_at = smem_addr(&sm.lse[st][0]), delta_at = smem_addr(&sm.delta[st][0]);
    const auto row_pair = [&](uint32_t at, int e) { return ld_shared2(at + 4 * get<1>(cS(e))); };
    warpgroup_wait<1>();  // Sᵀ
    warpgroup_fence_operand(tSrS);
    if (plain) {
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
          const bool visible =
              qi < rows_left && kj < keys_left && (!masked || mask.sees(cur.m0 + qi, n0 + kj));
          const scalar::bwd::ScoreGrad g =
              scalar::bwd::score_grad(pm, tSrS(e + i), tSrdP(e + i), (i ? lse.y : lse.x) * kLog2e,
                                      i ? delta.y : delta.x, slope2, abs(qi + diag - kj), visible);
          tSrS(e + i) = g.p;
          tSrdP(e + i) = g.ds;
        }
      }
    }
    issue_dv();
    convert_p(rdS, tSrdP);
    warpgroup_fence_operand(rdS);
    cute::copy(copy_dst, thr_copy_dst.retile_S(rdSc), tdSsdSt);
    fence_proxy_async();
    named_sync(1, kThreads);  // both warpgroups' keys stored (dQ reads all of dS)

    // dQ = dS·K, then dK += dSᵀ·Q, which runs while dQ's tile is staged in shared memory and
    // each of its rows added to the f32 accumulator by one bulk reduction (kOrdered: after the
    // key blocks before this one have added theirs).
    Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBM>, Int<D>>{});
    wg_gemm<true, -1>(mma_dq, tQrdS, tQrKt, tdQrdQ);
    wg_gemm<false, -1>(mma_dkv, rdS, tKVrQt(_, _, _, st), tdKrdK);
    warpgroup_wait<1>();  // dV and dQ
    warpgroup_fence_operand(rP);
    warpgroup_fence_operand(tdQrdQ);
    CUTE_UNROLL
    for (int e = 0; e < size(tdQrdQ); e += 2)
      st_shared2(smem_addr(&sm.dq[get<0>(cdQ(e)) * kDqRow<D> + get<1>(cdQ(e))]), tdQrdQ(e),
                 tdQrdQ(e + 1));
    fence_proxy_async();
    if constexpr (kOrdered) {
      turn = pm.dq_order + (int64_t(b) * p.heads + h) * pm.order_tiles + cur.m0 / kBM;
      if (tid == 0) wait_for_turn(turn, (mask.key_end(cur.m0, kBM) - 1) / kBN - nb);
    }
    named_sync(1, kThreads);  // the tile stored (and kOrdered: this block's turn)
    if (tid < min(rows_left, kBM)) {
      float* row =
          pm.dq_acc + lse_index(pm.seqs, s.seq, b, h, p.heads, p.seq_q, int64_t(cur.m0 + tid)) * D;
      bulk_add_f32(row, smem_addr(&sm.dq[tid * kDqRow<D>]), D * 4);
      bulk_commit();
    }
    warpgroup_wait<0>();  // dK: its operands may be overwritten next step
    warpgroup_fence_operand(rdS);
    warpgroup_fence_operand(tdVrdV);
    warpgroup_fence_operand(tdKrdK);
    cur = nxt;
  }
  cute::cp_async_wait<0>();  // K and V's copies, where no query tile saw the keys
  if (tid < kBM) bulk_wait<kOrdered>();
  if constexpr (kOrdered) {
    __syncthreads();
    if (tid == 0 && turn != nullptr) pass_the_turn(turn);
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
                        limits::smem_per_block(dev, Cfg<T, D>::kSmemBytes)});
}

// The workspace: the scalar backward's, with the ordered mode's accumulator and counters.
inline int64_t workspace_bytes(const BwdArgs& a) { return scalar::bwd::workspace_bytes(a, kBM); }

template <typename T, int D>
void backward(const BwdArgs& a, const DeviceInfo&, cudaStream_t stream) {
  const FwdArgs& f = a.fwd;
  const dim3 grid(unsigned((f.dims.seq_k + kBN - 1) / kBN), unsigned(f.dims.kv_heads),
                  unsigned(f.dims.batch));
  constexpr int kSmem = Cfg<T, D>::kSmemBytes;
  scalar::bwd::run_backward<native_t<T>, D, kBM>(a, stream, "cutlass", [&](const Params& pm) {
    if (pm.dq_order != nullptr)
      scalar::bwd::launch<wgmma_dkdv_kernel<T, D, true>, kSmem>(grid, kThreads, stream, pm);
    else
      scalar::bwd::launch<wgmma_dkdv_kernel<T, D, false>, kSmem>(grid, kThreads, stream, pm);
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
