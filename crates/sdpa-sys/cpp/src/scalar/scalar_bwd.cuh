// Scalar backend's backward: the gradients of attention (dQ, dK, dV and the sinks' logits') on
// CUDA cores only, in FlashAttention-2's structure; the GPU reference path of the backward, as
// the forward kernel is of the forward. It takes every mask, softcap, ALiBi, sinks, GQA and
// packed sequences, every head dim up to its instance's D (narrowed as the forward's Band path:
// columns past head_dim and head_dim_v read as zeros and are not stored). Arguments arrive
// validated (crates/sdpa/src/backward.rs); can_implement (below) states the rest.
//
// With s_ij the logits of row i (scale, softcap, ALiBi) and P_ij = exp(s_ij - lse_i), the
// forward's log-sum-exp lse_i (a sink's term included):
//   D_i = dO_i · O_i;  dP_ij = dO_i · V_j;  dS_ij = P_ij (dP_ij - D_i) (1 - tanh²) (softcap);
//   dV_j = Σ_i P_ij dO_i;  dK_j = scale Σ_i dS_ij Q_i;  dQ_i = scale Σ_j dS_ij K_j;
//   dsink_h = -Σ_i exp(sink_h - lse_i) D_i.
//
// Four launches, on the caller's stream:
// 1. delta_kernel, a warp a row: D_i into the workspace (and, in the atomic mode, the row's f32
//    dQ accumulator zeroed).
// 2. dkdv_kernel, a CTA per tile of kBN keys of one K/V head: K and V stay in shared memory
//    while it walks the query tiles of every query head of its group that see them, recomputing
//    P from Q and the LSE (no score matrix is stored); dK and dV accumulate in registers, one key
//    a lane, each warp an eighth of the columns, and are written once (so GQA's sum over the
//    group is the loop, not atomics). In the atomic mode it also adds each tile's dQ into the f32
//    accumulator with atomics (their order varies between runs).
// 3. Atomic mode: convert_kernel rounds the accumulator into dQ. Deterministic mode: dq_kernel, a
//    CTA per tile of kBM query rows, walks the keys its rows see as the forward does and sums dQ
//    in registers, in a fixed order.
// 4. With sinks: dsinks_kernel, a CTA per head, sums its rows' terms in a fixed order.
//
// The mask is the Band policy of common/mask.cuh for every mask (one instantiation, not three):
// the tile tests skip query tiles that see none of a CTA's keys, `sees` masks per score, and on
// partly masked tiles a hidden pair adds nothing (not 0 times its operand: 0 · Inf is NaN).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "common/attributes.cuh"
#include "common/check.cuh"
#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/limits.cuh"
#include "common/mask.cuh"
#include "common/seqs.cuh"
#include "common/sinks.cuh"

namespace sdpa::scalar::bwd {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kBM = 32;             // query rows of a step
constexpr int kBN = 32;             // keys of a tile: one a lane
constexpr int kRPW = kBM / kWarps;  // score rows a warp computes

using Band = mask::Band<int64_t>;

struct Params {
  KernelParams base;  // q, k, v, o (the forward's output, read here), their strides, scale_log2
  Band mask;
  float cap2, inv_cap2;  // the softcap in the log2 domain (cap2 = 0: none)
  float scale;           // d logit / d (q · k) before the softcap
  const float* alibi;    // null: none
  int64_t alibi_bstride;
  const float* sinks;  // [heads], null: none
  const float* lse;    // the forward's, natural log
  SeqParams seqs;
  int qk_chunks, v_chunks;  // 16-byte chunks of the problem's own columns (narrowed)
  int head_dim, head_dim_v;
  int64_t batch;
  const uint8_t* d_o;
  Strides dos;
  uint8_t *dq, *dk, *dv;
  Strides dqs, dks, dvs;
  float* dsinks;  // [heads], null: not asked for
  float* delta;   // [LSE rows]: D_i, at the LSE's index
  float* dq_acc;  // [LSE rows][head_dim] f32 in dq_col's order; null: the deterministic mode
                  // on the dQ kernel
  // The ordered deterministic mode (a dK/dV pass that adds each query tile's dQ into dq_acc in
  // the order of its key blocks): a counter per tile of order_rows rows, [batch][heads][tiles],
  // of the key blocks that have added into it; null: none.
  int* dq_order;
  int order_rows;
  int64_t order_tiles;
};

// Where column `col` of accumulator row `row` (its LSE index) lies in the row: in each complete
// group of 64 columns, the 8-float chunks trade places by the row's index mod 8 (XOR). Rows
// staged in shared memory in this order spread a warp's stores of 8 rows over every bank, so
// that sm_90a's backward stages a tile of consecutive rows as the accumulator holds them and adds
// it with one bulk reduction. Pairs (col even) stay adjacent.
__host__ __device__ __forceinline__ int dq_col(int64_t row, int col, int head_dim) {
  return col < head_dim / 64 * 64 ? col ^ (int(row & 7) << 3) : col;
}

// The shared memory of a dK/dV or dQ CTA: a tile of Q and dO rows, one of K and V rows (16-bit
// pairs, rows padded a word so that lane j reading row j hits bank j + w), the tile's P and
// scale · dS, and its rows' LSE (log2 domain) and D.
template <int D>
struct Smem {
  uint32_t q[kBM][D / 2 + 1];
  uint32_t d_o[kBM][D / 2 + 1];
  uint32_t k[kBN][D / 2 + 1];
  uint32_t v[kBN][D / 2 + 1];
  float p[kBM][kBN + 1];
  float ds[kBM][kBN + 1];
  float lse2[kBM];
  float delta[kBM];
};

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Rows [r0, r0 + N) of a 16-bit tensor at `base` (row stride `rs` elements) into `s` as element
// pairs; rows at or past `rows` and 16-byte chunks at or past `chunks` as zeros.
template <int D, int N>
__device__ __forceinline__ void load_rows(uint32_t (*s)[D / 2 + 1], const uint8_t* base, int64_t rs,
                                          int64_t r0, int64_t rows, int chunks) {
  constexpr int CH = D / 8;
  for (int c = threadIdx.x; c < N * CH; c += kThreads) {
    const int r = c / CH, ch = c % CH;
    uint4 u = make_uint4(0, 0, 0, 0);
    if (r0 + r < rows && ch < chunks)
      u = *reinterpret_cast<const uint4*>(base + 2 * ((r0 + r) * rs + ch * 8));
    s[r][4 * ch] = u.x;
    s[r][4 * ch + 1] = u.y;
    s[r][4 * ch + 2] = u.z;
    s[r][4 * ch + 3] = u.w;
  }
}

// One sequence's view of a call: where its rows are, its mask, its ALiBi.
struct SeqView {
  Seq<int64_t> seq;
  Band mask;
  int64_t b;
};

__device__ __forceinline__ SeqView seq_view(const Params& pm, int64_t b) {
  const Seq<int64_t> seq = seq_of<int64_t>(pm.seqs, b, pm.base.seq_q, pm.base.seq_k);
  return {seq, pm.mask.rebased(seq.seq_q, seq.seq_k), b};
}

// The LSE (log2 domain) and D of the kBM rows from m0 of head h into shared memory (rows past
// the sequence: -inf and 0, which give P = dS = 0).
template <int D>
__device__ __forceinline__ void load_row_stats(const Params& pm, Smem<D>& sm, const SeqView& s,
                                               int64_t h, int64_t m0) {
  for (int r = threadIdx.x; r < kBM; r += kThreads) {
    float lse2 = -INFINITY, delta = 0.f;
    if (m0 + r < s.seq.seq_q) {
      const int64_t at = lse_index(pm.seqs, s.seq, s.b, h, pm.base.heads, pm.base.seq_q, m0 + r);
      lse2 = pm.lse[at] * kLog2e;
      delta = pm.delta[at];
    }
    sm.lse2[r] = lse2;
    sm.delta[r] = delta;
  }
}

// P and scale · dS of one score of row i and key j, from s = q_i · k_j and dp = dO_i · v_j: the
// logit (scale, softcap, ALiBi at distance |i + seq_k - seq_q - j|), P against the row's LSE
// (log2 domain), dS from dP and the row's D; both zero where the pair is not visible. Every
// backward kernel takes its scores' gradients here.
struct ScoreGrad {
  float p, ds;
};
__device__ __forceinline__ ScoreGrad score_grad(const Params& pm, float s, float dp, float lse2,
                                                float delta, float slope2, int64_t dist,
                                                bool visible) {
  float x = s * pm.base.scale_log2, dcap = 1.f;
  if (pm.cap2 > 0.f) {
    const float t = tanhf(x * pm.inv_cap2);
    x = pm.cap2 * t;
    dcap = 1.f - t * t;
  }
  if (pm.alibi) x -= slope2 * float(dist);
  const float p = visible ? exp2f(x - lse2) : 0.f;
  return {p, visible ? p * (dp - delta) * dcap * pm.scale : 0.f};
}

// P and scale · dS of the tile of kBM rows from m0 and kBN keys from n0 into sm.p and sm.ds:
// each warp its kRPW rows, each lane its key. Q, dO, K, V and the rows' LSE and D are in shared
// memory.
template <typename T, int D>
__device__ __forceinline__ void tile_grads(const Params& pm, Smem<D>& sm, const SeqView& s,
                                           float slope2, int64_t m0, int64_t n0) {
  using P2 = Pair<T>;
  constexpr int W = D / 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float sc[kRPW], dp[kRPW];
#pragma unroll
  for (int r = 0; r < kRPW; ++r) sc[r] = dp[r] = 0.f;
#pragma unroll 4
  for (int w = 0; w < W; ++w) {
    const float2 k = P2::to_float2(sm.k[lane][w]);
    const float2 v = P2::to_float2(sm.v[lane][w]);
#pragma unroll
    for (int r = 0; r < kRPW; ++r) {
      const float2 q = P2::to_float2(sm.q[warp * kRPW + r][w]);
      const float2 g = P2::to_float2(sm.d_o[warp * kRPW + r][w]);
      sc[r] = fmaf(q.x, k.x, fmaf(q.y, k.y, sc[r]));
      dp[r] = fmaf(g.x, v.x, fmaf(g.y, v.y, dp[r]));
    }
  }
  const int64_t j = n0 + lane;
#pragma unroll
  for (int r = 0; r < kRPW; ++r) {
    const int row = warp * kRPW + r;
    const int64_t i = m0 + row;
    const bool visible = i < s.seq.seq_q && j < s.seq.seq_k && s.mask.sees(i, j);
    const ScoreGrad g = score_grad(pm, sc[r], dp[r], sm.lse2[row], sm.delta[row], slope2,
                                   llabs(i + s.seq.seq_k - s.seq.seq_q - j), visible);
    sm.p[row][lane] = g.p;
    sm.ds[row][lane] = g.ds;
  }
}

// ALiBi's slope of head h in the log2 domain (0: none).
__device__ __forceinline__ float slope2_of(const Params& pm, int64_t b, int64_t h) {
  return pm.alibi ? pm.alibi[b * pm.alibi_bstride + h] * kLog2e : 0.f;
}

// dQ of the warp's kRPW rows over the tile's kBN keys, added to `acc` (lane: words lane, lane +
// 32, ... of each row): Σ_j scale · dS_ij K_j, hidden pairs skipped on a partly masked tile.
template <typename T, int D>
__device__ __forceinline__ void add_dq(const Smem<D>& sm, const SeqView& s, int64_t m0, int64_t n0,
                                       bool masked, float (&acc)[kRPW][2 * ((D / 2 + 31) / 32)]) {
  using P2 = Pair<T>;
  constexpr int W = D / 2, CPL = (W + 31) / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < kRPW; ++r) {
    const int row = warp * kRPW + r;
    for (int j = 0; j < kBN; ++j) {
      if (masked && !(n0 + j < s.seq.seq_k && s.mask.sees(m0 + row, n0 + j))) continue;
      const float ds = sm.ds[row][j];
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        if (lane + 32 * c >= W) continue;
        const float2 k = P2::to_float2(sm.k[j][lane + 32 * c]);
        acc[r][2 * c] = fmaf(ds, k.x, acc[r][2 * c]);
        acc[r][2 * c + 1] = fmaf(ds, k.y, acc[r][2 * c + 1]);
      }
    }
  }
}

// 1. D_i = dO_i · O_i of each row (a warp a row), and in the atomic mode its dQ accumulator
// zeroed.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) delta_kernel(const __grid_constant__ Params pm) {
  using P2 = Pair<T>;
  const KernelParams& p = pm.base;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t i = int64_t(blockIdx.x) * kWarps + warp, h = blockIdx.y, b = blockIdx.z;
  const Seq<int64_t> seq = seq_of<int64_t>(pm.seqs, b, p.seq_q, p.seq_k);
  if (i >= seq.seq_q) return;
  const auto* o = reinterpret_cast<const uint32_t*>(
      p.o + 2 * (b * p.os.batch + h * p.os.head + (seq.q0 + i) * p.os.seq));
  const auto* g = reinterpret_cast<const uint32_t*>(
      pm.d_o + 2 * (b * pm.dos.batch + h * pm.dos.head + (seq.q0 + i) * pm.dos.seq));
  float sum = 0.f;
  for (int w = lane; w < pm.head_dim_v / 2; w += 32) {
    const float2 x = P2::to_float2(o[w]), y = P2::to_float2(g[w]);
    sum = fmaf(x.x, y.x, fmaf(x.y, y.y, sum));
  }
  sum = warp_sum(sum);
  const int64_t at = lse_index(pm.seqs, seq, b, h, p.heads, p.seq_q, i);
  if (lane == 0) pm.delta[at] = sum;
  if (pm.dq_acc != nullptr)
    for (int c = lane; c < pm.head_dim; c += 32) pm.dq_acc[at * pm.head_dim + c] = 0.f;
  if (pm.dq_order != nullptr && lane == 0 && i % pm.order_rows == 0)
    pm.dq_order[(b * p.heads + h) * pm.order_tiles + i / pm.order_rows] = 0;
}

// 2. dK and dV of a tile of kBN keys of K/V head blockIdx.y, sequence blockIdx.z (kAtomicDq:
// and each tile's dQ, added to the accumulator).
template <typename T, int D, bool kAtomicDq>
__global__ void __launch_bounds__(kThreads, 1) dkdv_kernel(const __grid_constant__ Params pm) {
  using P2 = Pair<T>;
  constexpr int W = D / 2, CW = W / kWarps;  // words of a row; a warp's share of them
  constexpr int CPL = (W + 31) / 32;
  static_assert(W % kWarps == 0, "each warp owns whole words of dK and dV");
  const KernelParams& p = pm.base;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<Smem<D>*>(smem_raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n0 = int64_t(blockIdx.x) * kBN, hk = blockIdx.y, b = blockIdx.z;
  const SeqView s = seq_view(pm, b);
  // The rows of dK and dV this sequence owns: its keys in packed K/V, every row of dense K/V
  // (those past seq_k, with seqused_k, take zeros).
  const int64_t key_rows = pm.seqs.cu_k != nullptr ? s.seq.seq_k : p.seq_k;
  if (n0 >= key_rows) return;  // CTA-uniform, before any barrier
  const uint8_t* kb = p.k + 2 * (b * p.ks.batch + hk * p.ks.head + s.seq.k0 * p.ks.seq);
  const uint8_t* vb = p.v + 2 * (b * p.vs.batch + hk * p.vs.head + s.seq.k0 * p.vs.seq);
  load_rows<D, kBN>(sm.k, kb + 2 * n0 * p.ks.seq, p.ks.seq, 0, s.seq.seq_k - n0, pm.qk_chunks);
  load_rows<D, kBN>(sm.v, vb + 2 * n0 * p.vs.seq, p.vs.seq, 0, s.seq.seq_k - n0, pm.v_chunks);

  float dk[2 * CW], dv[2 * CW];
#pragma unroll
  for (int c = 0; c < 2 * CW; ++c) dk[c] = dv[c] = 0.f;
  const int64_t j = n0 + lane;

  for (int64_t g = 0; g < p.group; ++g) {
    const int64_t h = hk * p.group + g;
    const float slope2 = slope2_of(pm, b, h);
    const uint8_t* qb = p.q + 2 * (b * p.qs.batch + h * p.qs.head + s.seq.q0 * p.qs.seq);
    const uint8_t* gb = pm.d_o + 2 * (b * pm.dos.batch + h * pm.dos.head + s.seq.q0 * pm.dos.seq);
    for (int64_t m0 = 0; m0 < s.seq.seq_q; m0 += kBM) {
      // Query tiles that see none of these keys (CTA-uniform).
      if (s.mask.key_end(m0, kBM) <= n0 || s.mask.key_begin(m0, kBM) >= n0 + kBN) continue;
      __syncthreads();  // the previous tile is consumed (and, the first time, K and V stored)
      load_rows<D, kBM>(sm.q, qb + 2 * m0 * p.qs.seq, p.qs.seq, 0, s.seq.seq_q - m0, pm.qk_chunks);
      load_rows<D, kBM>(sm.d_o, gb + 2 * m0 * pm.dos.seq, pm.dos.seq, 0, s.seq.seq_q - m0,
                        pm.v_chunks);
      load_row_stats(pm, sm, s, h, m0);
      __syncthreads();
      tile_grads<T, D>(pm, sm, s, slope2, m0, n0);
      __syncthreads();
      const bool masked = s.mask.tile_masked(m0, kBM, n0, kBN);
      // dV_j += Σ_i P_ij dO_i, dK_j += Σ_i scale · dS_ij Q_i: the lane's key, the warp's words.
      for (int r = 0; r < kBM; ++r) {
        if (masked && !(j < s.seq.seq_k && s.mask.sees(m0 + r, j))) continue;
        const float pij = sm.p[r][lane], dsij = sm.ds[r][lane];
#pragma unroll
        for (int c = 0; c < CW; ++c) {
          const float2 gv = P2::to_float2(sm.d_o[r][warp * CW + c]);
          const float2 qv = P2::to_float2(sm.q[r][warp * CW + c]);
          dv[2 * c] = fmaf(pij, gv.x, dv[2 * c]);
          dv[2 * c + 1] = fmaf(pij, gv.y, dv[2 * c + 1]);
          dk[2 * c] = fmaf(dsij, qv.x, dk[2 * c]);
          dk[2 * c + 1] = fmaf(dsij, qv.y, dk[2 * c + 1]);
        }
      }
      if constexpr (kAtomicDq) {
        float acc[kRPW][2 * CPL] = {};
        add_dq<T, D>(sm, s, m0, n0, masked, acc);
#pragma unroll
        for (int r = 0; r < kRPW; ++r) {
          const int64_t i = m0 + warp * kRPW + r;
          if (i >= s.seq.seq_q) continue;
          const int64_t at = lse_index(pm.seqs, s.seq, b, h, p.heads, p.seq_q, i);
#pragma unroll
          for (int c = 0; c < CPL; ++c) {
            const int col = 2 * (lane + 32 * c);
            if (col >= pm.head_dim) continue;
            float* pair = pm.dq_acc + at * pm.head_dim + dq_col(at, col, pm.head_dim);
            atomicAdd(pair, acc[r][2 * c]);
            atomicAdd(pair + 1, acc[r][2 * c + 1]);
          }
        }
      }
    }
  }

  if (j >= key_rows) return;
  auto* dk_row = reinterpret_cast<uint32_t*>(
      pm.dk + 2 * (b * pm.dks.batch + hk * pm.dks.head + (s.seq.k0 + j) * pm.dks.seq));
  auto* dv_row = reinterpret_cast<uint32_t*>(
      pm.dv + 2 * (b * pm.dvs.batch + hk * pm.dvs.head + (s.seq.k0 + j) * pm.dvs.seq));
#pragma unroll
  for (int c = 0; c < CW; ++c) {
    const int w = warp * CW + c;
    if (2 * w < pm.head_dim) dk_row[w] = P2::from_float2(dk[2 * c], dk[2 * c + 1]);
    if (2 * w < pm.head_dim_v) dv_row[w] = P2::from_float2(dv[2 * c], dv[2 * c + 1]);
  }
}

// 3a. The atomic mode's dQ: the f32 accumulator rounded to the dtype (a warp a row).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) convert_kernel(const __grid_constant__ Params pm) {
  using P2 = Pair<T>;
  const KernelParams& p = pm.base;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t i = int64_t(blockIdx.x) * kWarps + warp, h = blockIdx.y, b = blockIdx.z;
  const Seq<int64_t> seq = seq_of<int64_t>(pm.seqs, b, p.seq_q, p.seq_k);
  if (i >= seq.seq_q) return;
  const int64_t at = lse_index(pm.seqs, seq, b, h, p.heads, p.seq_q, i);
  const float* acc = pm.dq_acc + at * pm.head_dim;
  auto* row = reinterpret_cast<uint32_t*>(
      pm.dq + 2 * (b * pm.dqs.batch + h * pm.dqs.head + (seq.q0 + i) * pm.dqs.seq));
  for (int w = lane; w < pm.head_dim / 2; w += 32) {
    const float* pair = acc + dq_col(at, 2 * w, pm.head_dim);
    row[w] = P2::from_float2(pair[0], pair[1]);
  }
}

// 3b. The deterministic mode's dQ: a tile of kBM rows of head blockIdx.y, sequence blockIdx.z,
// over the keys its rows see, in order.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) dq_kernel(const __grid_constant__ Params pm) {
  using P2 = Pair<T>;
  constexpr int W = D / 2, CPL = (W + 31) / 32;
  const KernelParams& p = pm.base;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<Smem<D>*>(smem_raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t m0 = int64_t(blockIdx.x) * kBM, h = blockIdx.y, b = blockIdx.z;
  const int64_t hk = h / p.group;
  const SeqView s = seq_view(pm, b);
  if (m0 >= s.seq.seq_q) return;  // CTA-uniform, before any barrier
  const float slope2 = slope2_of(pm, b, h);
  const uint8_t* qb = p.q + 2 * (b * p.qs.batch + h * p.qs.head + s.seq.q0 * p.qs.seq);
  const uint8_t* gb = pm.d_o + 2 * (b * pm.dos.batch + h * pm.dos.head + s.seq.q0 * pm.dos.seq);
  const uint8_t* kb = p.k + 2 * (b * p.ks.batch + hk * p.ks.head + s.seq.k0 * p.ks.seq);
  const uint8_t* vb = p.v + 2 * (b * p.vs.batch + hk * p.vs.head + s.seq.k0 * p.vs.seq);
  load_rows<D, kBM>(sm.q, qb + 2 * m0 * p.qs.seq, p.qs.seq, 0, s.seq.seq_q - m0, pm.qk_chunks);
  load_rows<D, kBM>(sm.d_o, gb + 2 * m0 * pm.dos.seq, pm.dos.seq, 0, s.seq.seq_q - m0, pm.v_chunks);
  load_row_stats(pm, sm, s, h, m0);

  float acc[kRPW][2 * CPL] = {};
  const int64_t n_begin = s.mask.key_begin(m0, kBM), n_end = s.mask.key_end(m0, kBM);
  for (int64_t n0 = n_begin; n0 < n_end; n0 += kBN) {
    __syncthreads();  // the previous tile is consumed (and, the first time, Q and dO stored)
    load_rows<D, kBN>(sm.k, kb + 2 * n0 * p.ks.seq, p.ks.seq, 0, s.seq.seq_k - n0, pm.qk_chunks);
    load_rows<D, kBN>(sm.v, vb + 2 * n0 * p.vs.seq, p.vs.seq, 0, s.seq.seq_k - n0, pm.v_chunks);
    __syncthreads();
    tile_grads<T, D>(pm, sm, s, slope2, m0, n0);
    __syncwarp();  // the warp reads only its own rows of sm.ds
    add_dq<T, D>(sm, s, m0, n0, s.mask.tile_masked(m0, kBM, n0, kBN), acc);
  }

#pragma unroll
  for (int r = 0; r < kRPW; ++r) {
    const int64_t i = m0 + warp * kRPW + r;
    if (i >= s.seq.seq_q) continue;
    auto* row = reinterpret_cast<uint32_t*>(
        pm.dq + 2 * (b * pm.dqs.batch + h * pm.dqs.head + (s.seq.q0 + i) * pm.dqs.seq));
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const int w = lane + 32 * c;
      if (w < W && 2 * w < pm.head_dim) row[w] = P2::from_float2(acc[r][2 * c], acc[r][2 * c + 1]);
    }
  }
}

// 4. dsink_h = -Σ_i exp(sink_h - lse_i) D_i over head h's rows of every sequence, summed in a
// fixed order (a row that sees nothing has D_i = 0 and adds nothing).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) dsinks_kernel(const __grid_constant__ Params pm) {
  const KernelParams& p = pm.base;
  const int64_t h = blockIdx.x;
  const float sink = pm.sinks[h];
  float sum = 0.f;
  for (int64_t b = 0; b < pm.batch; ++b) {
    const Seq<int64_t> seq = seq_of<int64_t>(pm.seqs, b, p.seq_q, p.seq_k);
    for (int64_t i = threadIdx.x; i < seq.seq_q; i += kThreads) {
      const int64_t at = lse_index(pm.seqs, seq, b, h, p.heads, p.seq_q, i);
      const float d = pm.delta[at];
      if (d != 0.f) sum -= expf(sink - pm.lse[at]) * d;
    }
  }
  __shared__ float part[kWarps];
  sum = warp_sum(sum);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += part[w];
    pm.dsinks[h] = total;
  }
}

inline Params make_params(const BwdArgs& a) {
  const FwdArgs& f = a.fwd;
  Params p{};
  p.base = sdpa::make_params(f);
  p.mask = mask::band_of<int64_t>(f);
  if (f.mods.softcap > 0.f) {
    p.cap2 = f.mods.softcap * kLog2e;
    p.inv_cap2 = 1.f / p.cap2;
  }
  p.scale = f.mods.scale;
  p.alibi = f.mods.alibi ? device_ptr<const float>(f.mods.alibi_slopes) : nullptr;
  p.alibi_bstride = f.mods.alibi_batch_stride;
  p.sinks = f.mods.sinks ? device_ptr<const float>(f.mods.sink_logits) : nullptr;
  p.lse = device_ptr<const float>(f.out.lse);
  p.seqs = SeqParams::of(f);
  p.qk_chunks = int(f.dims.head_dim / 8);
  p.v_chunks = int(f.dims.head_dim_v / 8);
  p.head_dim = int(f.dims.head_dim);
  p.head_dim_v = int(f.dims.head_dim_v);
  p.batch = f.dims.batch;
  p.d_o = device_ptr<const uint8_t>(a.grads.d_o);
  p.dos = a.grads.do_stride;
  p.dq = device_ptr<uint8_t>(a.grads.dq);
  p.dk = device_ptr<uint8_t>(a.grads.dk);
  p.dv = device_ptr<uint8_t>(a.grads.dv);
  p.dqs = a.grads.dq_stride;
  p.dks = a.grads.dk_stride;
  p.dvs = a.grads.dv_stride;
  p.dsinks = f.mods.sinks ? device_ptr<float>(a.grads.dsinks) : nullptr;
  return p;
}

// The LSE's rows (the index space of D and the dQ accumulator).
inline int64_t lse_rows(const FwdArgs& a) {
  return a.seqs.total_q > 0 ? a.dims.heads * a.seqs.total_q
                            : a.dims.batch * a.dims.heads * a.dims.seq_q;
}

// The workspace: D per LSE row, then (the atomic mode) the f32 dQ accumulator.
// Query tiles of `order_rows` rows a (sequence, head) in the ordered mode.
inline int64_t order_tiles(const FwdArgs& a, int order_rows) {
  return (a.dims.seq_q + order_rows - 1) / order_rows;
}

// Whether this call's dQ takes the ordered deterministic mode (`order_rows` > 0: the backend's
// dK/dV pass has it).
inline bool ordered(const BwdArgs& a, int order_rows) {
  return a.grads.deterministic && order_rows > 0;
}

// The workspace: D per LSE row, then (the atomic and the ordered modes) the f32 dQ accumulator,
// then (the ordered mode) its tiles' counters.
inline int64_t workspace_bytes(const BwdArgs& a, int order_rows = 0) {
  const int64_t rows = lse_rows(a.fwd);
  const int64_t delta = (rows * 4 + 255) / 256 * 256;
  const int64_t acc = rows * a.fwd.dims.head_dim * 4;
  if (ordered(a, order_rows))
    return delta + acc + a.fwd.dims.batch * a.fwd.dims.heads * order_tiles(a.fwd, order_rows) * 4;
  return delta + (a.grads.deterministic ? 0 : acc);
}

template <typename T, int D>
std::string can_implement(const BwdArgs& a, const DeviceInfo& dev) {
  const FwdArgs& f = a.fwd;
  if (f.seqs.page_size > 0)
    return "the backward takes dense or packed sequences, not a paged K/V cache";
  if (f.dims.kv_heads > limits::kGridYZMax)
    return "kv_heads (" + std::to_string(f.dims.kv_heads) + ") must be at most 65535 (grid y)";
  return limits::first({limits::narrowed_head_dims(f, D), limits::grid_of_query_tiles(f, kBM),
                        limits::sm80_or_newer(dev),
                        limits::smem_per_block(dev, int(sizeof(Smem<D>)))});
}

// Dynamic shared memory above 48 KB for `Kernel`, once a device: one `configured` per kernel
// (a static shared by two kernels would let the second launch without it).
template <auto Kernel, int kSmem>
void opt_in() {
  if constexpr (kSmem > 48 * 1024) {
    static std::atomic<uint64_t> configured{0};
    opt_in_smem(reinterpret_cast<const void*>(Kernel), kSmem, configured);
  }
}

// `Kernel` on its arguments (pm, and whatever else a backend's kernel takes), after its
// shared-memory opt-in.
template <auto Kernel, int kSmem, typename... Args>
void launch(dim3 grid, int threads, cudaStream_t stream, const Args&... args) {
  opt_in<Kernel, kSmem>();
  Kernel<<<grid, threads, kSmem, stream>>>(args...);
}

// A backward kernel as `sdpa info` lists it: its name's stem, the kernel, the dynamic shared
// memory its launches ask for.
struct NamedKernel {
  const char* name;
  const void* kernel;
  int32_t smem;
};
template <class Kernel>
const void* kernel_ptr(Kernel* k) {
  return reinterpret_cast<const void*>(k);
}

// `backend`'s backward kernels at element type T and head dim D, each named stem + dtype + _dD.
template <typename T, int D, int N>
void push_kernels(std::vector<KernelAttr>& out, const char* backend,
                  const NamedKernel (&kernels)[N]) {
  const std::string tag = std::string(dtype_name<T>()) + "_d" + std::to_string(D);
  for (const NamedKernel& k : kernels) {
    cudaFuncAttributes fa;
    if (!attributes_on_device(k.kernel, fa)) continue;
    out.push_back({backend, k.name + tag, fa.numRegs, int32_t(fa.sharedSizeBytes), k.smem,
                   int32_t(fa.localSizeBytes), fa.maxThreadsPerBlock});
  }
}

// The backward's launches around a dK/dV pass: the D pre-pass, `dkdv(pm)` (this kernel's, or a
// faster backend's on the same Params and workspace), then dQ (the accumulator's conversion,
// or the deterministic dQ kernel) and the sinks' gradient. kOrderRows > 0: the dK/dV pass has
// the ordered deterministic mode on query tiles of that many rows (Params::dq_order), so the
// deterministic mode converts the accumulator as the atomic one does. `who` names the backend
// in errors.
template <typename T, int D, int kOrderRows = 0, class DkDv>
void run_backward(const BwdArgs& a, cudaStream_t stream, const char* who, DkDv&& dkdv) {
  const FwdArgs& f = a.fwd;
  if (!f.out.lse || !a.grads.workspace || (f.mods.alibi && !f.mods.alibi_slopes) ||
      (f.mods.sinks && !f.mods.sink_logits))
    throw Error(std::string(who) +
                " backward: the LSE, the workspace, the ALiBi slopes or the sinks is missing");
  Params pm = make_params(a);
  auto* ws = device_ptr<uint8_t>(a.grads.workspace);
  const bool in_order = ordered(a, kOrderRows);
  const int64_t acc_at = (lse_rows(f) * 4 + 255) / 256 * 256;
  pm.delta = reinterpret_cast<float*>(ws);
  pm.dq_acc = a.grads.deterministic && !in_order ? nullptr : reinterpret_cast<float*>(ws + acc_at);
  pm.dq_order =
      in_order ? reinterpret_cast<int*>(ws + acc_at + lse_rows(f) * f.dims.head_dim * 4) : nullptr;
  pm.order_rows = kOrderRows;
  pm.order_tiles = kOrderRows > 0 ? order_tiles(f, kOrderRows) : 0;
  const auto heads = unsigned(f.dims.heads), batch = unsigned(f.dims.batch);
  const dim3 rows_grid(unsigned((f.dims.seq_q + kWarps - 1) / kWarps), heads, batch);
  constexpr int kSmem = int(sizeof(Smem<D>));

  delta_kernel<T, D><<<rows_grid, kThreads, 0, stream>>>(pm);
  SDPA_LAUNCH_CHECK("backward delta_kernel launch");
  dkdv(pm);
  if (pm.dq_acc != nullptr) {
    convert_kernel<T, D><<<rows_grid, kThreads, 0, stream>>>(pm);
    SDPA_LAUNCH_CHECK("backward convert_kernel launch");
  } else if constexpr (kOrderRows == 0) {
    // Only without the ordered mode: a backend that has it never instantiates this kernel.
    const dim3 q_grid(unsigned((f.dims.seq_q + kBM - 1) / kBM), heads, batch);
    launch<dq_kernel<T, D>, kSmem>(q_grid, kThreads, stream, pm);
    SDPA_LAUNCH_CHECK("backward dq_kernel launch");
  }
  if (pm.dsinks != nullptr) {
    dsinks_kernel<T, D><<<heads, kThreads, 0, stream>>>(pm);
    SDPA_LAUNCH_CHECK("backward dsinks_kernel launch");
  }
}

template <typename T, int D>
void backward(const BwdArgs& a, const DeviceInfo&, cudaStream_t stream) {
  const FwdArgs& f = a.fwd;
  const dim3 keys_grid(unsigned((f.dims.seq_k + kBN - 1) / kBN), unsigned(f.dims.kv_heads),
                       unsigned(f.dims.batch));
  constexpr int kSmem = int(sizeof(Smem<D>));
  run_backward<T, D>(a, stream, "scalar", [&](const Params& pm) {
    if (pm.dq_acc != nullptr)
      launch<dkdv_kernel<T, D, true>, kSmem>(keys_grid, kThreads, stream, pm);
    else
      launch<dkdv_kernel<T, D, false>, kSmem>(keys_grid, kThreads, stream, pm);
    SDPA_LAUNCH_CHECK("scalar dkdv_kernel launch");
  });
}

template <typename T, int D>
void attributes(std::vector<KernelAttr>& out, const DeviceInfo&) {
  constexpr int32_t kSmem = int32_t(sizeof(Smem<D>));
  push_kernels<T, D>(out, "scalar",
                     {{"bwd_delta_", kernel_ptr(delta_kernel<T, D>), 0},
                      {"bwd_dkdv_", kernel_ptr(dkdv_kernel<T, D, false>), kSmem},
                      {"bwd_dkdv_atomic_", kernel_ptr(dkdv_kernel<T, D, true>), kSmem},
                      {"bwd_dq_", kernel_ptr(dq_kernel<T, D>), kSmem},
                      {"bwd_convert_", kernel_ptr(convert_kernel<T, D>), 0},
                      {"bwd_dsinks_", kernel_ptr(dsinks_kernel<T, D>), 0}});
}

}  // namespace sdpa::scalar::bwd
