// Scalar backend: FlashAttention-style forward on CUDA cores only (no tensor cores).
// Assumes validated arguments (crates/sdpa/src/problem/mod.rs): head dims <= D, 16-byte aligned
// rows, strides in elements, heads % kv_heads == 0, seq_q, seq_k >= 1; and what can_implement
// (below) checks. Rows, keys and offsets are 64-bit.
//
// One CTA = BM query rows of one (batch, head); 4 warps, each owning RPW rows. K/V stream
// through shared memory in tiles of BN = 32 keys, one key per lane for Q·Kᵀ (so the row max is
// one 5-step shuffle reduction per row and tile), then each lane owns column pairs lane, lane +
// 32, ... of the output for P·V with P broadcast from shared memory. Online softmax in the log2
// domain, f32 throughout; each lane keeps a partial row sum, reduced across the warp once at the
// end, where a sink joins it (common/sinks.cuh). Being the GPU reference path, it takes every head
// dim of kernels.txt, every mask, softcap, ALiBi, sinks and the log-sum-exp.
//
// The mask is a policy of common/mask.cuh (Index int64_t) carried in the parameters, its type
// chosen in forward() (mask::dispatch_band): the kernel asks it for the CTA's key range, whether
// a tile hides keys from some of a warp's rows, and per row and key whether the row sees it.
//
// Head dims below D (80 on the 96 instance; V of another head dim than Q and K) run on the Band
// kernel too (mask::narrowed): Q's, K's and V's columns past their own head dim read as zeros,
// and the output's past head_dim_v are not stored.
//
// Sequences of different lengths (packed Q or K/V, a paged cache, seqused_k; common/seqs.cuh) run
// on the Band kernel (mask::needs_band): each CTA finds its sequence's offsets and lengths,
// rebases the band to them and reads each K/V row where the sequence keeps it; CTAs past their
// sequence's queries return at once.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common/attributes.cuh"
#include "common/check.cuh"
#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/limits.cuh"
#include "common/mask.cuh"
#include "common/seqs.cuh"
#include "common/sinks.cuh"

namespace sdpa::scalar {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
// 32 rows per CTA: the mission problem (B2 H8 S256) then launches 128 CTAs on 132 SMs, and
// RPW = 8 rows per warp reuses each K value loaded from shared memory 8 times.
// Above head dim 256 (the 576 instance) 16 rows: 8 rows a warp of 288 column pairs would spill
// their accumulators.
template <int D>
constexpr int kBM = D > 256 ? 16 : 32;
template <int D>
constexpr int kRPW = kBM<D> / kWarps;
constexpr int kBN = 32;  // one key per lane

template <class Mask>
struct Params {
  KernelParams base;
  Mask mask;
  // Logits in the log2 domain: softcap: x -> cap2 * tanh(x * inv_cap2) (cap2 = softcap * log2 e);
  // ALiBi: - slope * log2 e * |i + seq_k - seq_q - j|.
  float cap2, inv_cap2;  // cap2 = 0: no softcap
  const float* alibi;    // null: none
  int64_t alibi_bstride;
  const float* sinks;  // [heads], null: none
  float* lse;          // null: none
  SeqParams seqs;      // sequences of different lengths (dense: every offset 0)
  // Band only: the 16-byte chunks of a row Q and K, and V and the output, have of D (the others
  // read as zeros and are not stored; mask::narrowed).
  int qk_chunks, v_chunks;
};

// The shared memory of one CTA at head dim D (dynamic: over 48 KB at D = 256).
template <int D>
struct Smem {
  float q[kBM<D>][D];
  uint32_t k[kBN][D / 2 + 1];  // padded: lane j reads row j, banks (j + w) % 32 differ
  uint32_t v[kBN][D / 2];
  float p[kWarps][kRPW<D>][kBN];
};

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <typename T, int D, class Mask>
__global__ void __launch_bounds__(kThreads, 1) fwd_kernel(const __grid_constant__ Params<Mask> pm) {
  static_assert(D % 8 == 0, "rows are read in 16-byte chunks");
  constexpr int W = D / 2;            // 32-bit words (element pairs) per row
  constexpr int CH = D / 8;           // 16-byte chunks per row
  constexpr int CPL = (W + 31) / 32;  // output words per lane: lane owns words lane, lane+32, ...
  using P2 = Pair<T>;
  const KernelParams& p = pm.base;

  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<Smem<D>*>(smem_raw);
  auto& sQ = sm.q;
  auto& sK = sm.k;
  auto& sV = sm.v;
  auto& sP = sm.p;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t m0 = int64_t(blockIdx.x) * kBM<D>;
  const int64_t h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  // Sequence b (the Band kernel only): its queries from row q0, its keys from k0 or in pages; the
  // grid covers the longest.
  constexpr bool kBand = mask::kIsBand<Mask>;
  Seq<int64_t> seq{0, 0, p.seq_q, p.seq_k};
  if constexpr (kBand) {
    seq = seq_of<int64_t>(pm.seqs, b, p.seq_q, p.seq_k);
    if (m0 >= seq.seq_q) return;  // CTA-uniform, before any barrier
  }
  const uint8_t* qb = p.q + 2 * (b * p.qs.batch + h * p.qs.head + seq.q0 * p.qs.seq);
  const bool paged = kBand && pm.seqs.paged();  // else K/V rows from the sequence's first, k0
  const int64_t k0 = paged ? 0 : seq.k0;
  const uint8_t* kb = p.k + 2 * (b * p.ks.batch + hk * p.ks.head + k0 * p.ks.seq);
  const uint8_t* vb = p.v + 2 * (b * p.vs.batch + hk * p.vs.head + k0 * p.vs.seq);
  const Mask mask = kBand ? pm.mask.rebased(seq.seq_q, seq.seq_k) : pm.mask;  // keys each row sees
  const int64_t seq_q = seq.seq_q, seq_k = seq.seq_k;
  // ALiBi's slope in the log2 domain, and the diagonal its distances are measured from.
  const float slope2 = pm.alibi ? pm.alibi[b * pm.alibi_bstride + h] * 1.4426950408889634f : 0.f;
  const int64_t alibi_diag = seq_k - seq_q;

  // Q tile -> f32, pre-scaled. Rows past seq_q are zero and never stored.
  for (int c = tid; c < kBM<D> * CH; c += kThreads) {
    const int r = c / CH, col = (c % CH) * 8;
    float4 lo = make_float4(0, 0, 0, 0), hi = lo;
    if (m0 + r < seq_q && (!kBand || c % CH < pm.qk_chunks)) {
      const uint4 u = *reinterpret_cast<const uint4*>(qb + 2 * ((m0 + r) * p.qs.seq + col));
      const float2 a = P2::to_float2(u.x), bb = P2::to_float2(u.y), cc = P2::to_float2(u.z),
                   dd = P2::to_float2(u.w);
      const float s = p.scale_log2;
      lo = make_float4(a.x * s, a.y * s, bb.x * s, bb.y * s);
      hi = make_float4(cc.x * s, cc.y * s, dd.x * s, dd.y * s);
    }
    *reinterpret_cast<float4*>(&sQ[r][col]) = lo;
    *reinterpret_cast<float4*>(&sQ[r][col + 4]) = hi;
  }

  // Keys this CTA's rows see.
  const int64_t n_begin = mask.key_begin(m0, kBM<D>), n_end = mask.key_end(m0, kBM<D>);

  float acc[kRPW<D>][2 * CPL];
  float m[kRPW<D>], l[kRPW<D>];
#pragma unroll
  for (int r = 0; r < kRPW<D>; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int c = 0; c < 2 * CPL; ++c) acc[r][c] = 0.f;
  }
  const int64_t row0 = m0 + warp * kRPW<D>;

  for (int64_t n0 = n_begin; n0 < n_end; n0 += kBN) {
    __syncthreads();  // previous tile fully consumed (and, first time, sQ visible after next)
    for (int c = tid; c < kBN * CH; c += kThreads) {
      const int r = c / CH, w = (c % CH) * 4;
      uint4 ku = make_uint4(0, 0, 0, 0), vu = ku;
      if (n0 + r < seq_k) {
        const int64_t row = paged ? pm.seqs.paged_row(b, n0 + r) : n0 + r;
        if (!kBand || c % CH < pm.qk_chunks)
          ku = *reinterpret_cast<const uint4*>(kb + 2 * (row * p.ks.seq + 2 * w));
        if (!kBand || c % CH < pm.v_chunks)
          vu = *reinterpret_cast<const uint4*>(vb + 2 * (row * p.vs.seq + 2 * w));
      }
      sK[r][w] = ku.x;
      sK[r][w + 1] = ku.y;
      sK[r][w + 2] = ku.z;
      sK[r][w + 3] = ku.w;
      *reinterpret_cast<uint4*>(&sV[r][w]) = vu;
    }
    __syncthreads();

    // S = Q·Kᵀ for this warp's rows; lane = key.
    float s[kRPW<D>];
#pragma unroll
    for (int r = 0; r < kRPW<D>; ++r) s[r] = 0.f;
#pragma unroll 4
    for (int w = 0; w < W; w += 2) {  // D % 4 == 0: W is even
      const float2 k01 = P2::to_float2(sK[lane][w]);
      const float2 k23 = P2::to_float2(sK[lane][w + 1]);
#pragma unroll
      for (int r = 0; r < kRPW<D>; ++r) {
        const float4 q = *reinterpret_cast<const float4*>(&sQ[warp * kRPW<D> + r][2 * w]);
        s[r] = fmaf(q.x, k01.x, fmaf(q.y, k01.y, fmaf(q.z, k23.x, fmaf(q.w, k23.y, s[r]))));
      }
    }

    // Softcap and ALiBi on the log2-domain scores; then the online softmax: mask, new row max,
    // rescale.
    const int64_t j = n0 + lane;
#pragma unroll
    for (int r = 0; r < kRPW<D>; ++r) {
      if (pm.cap2 > 0.f) s[r] = pm.cap2 * tanhf(s[r] * pm.inv_cap2);
      if (pm.alibi) s[r] -= slope2 * float(llabs(row0 + r + alibi_diag - j));
      const bool visible = j < seq_k && mask.sees(row0 + r, j);
      const float sv = visible ? s[r] : -INFINITY;
      const float m_new = fmaxf(m[r], warp_max(sv));
      // A row with nothing visible yet keeps m = -inf; subtracting 0 then keeps p = 0, not NaN.
      const float base = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m[r] - base);
      const float pj = exp2f(sv - base);
      m[r] = m_new;
      l[r] = l[r] * alpha + pj;
#pragma unroll
      for (int c = 0; c < 2 * CPL; ++c) acc[r][c] *= alpha;
      sP[warp][r][lane] = pj;
    }
    __syncwarp();

    // O += P·V; lane owns column pairs lane, lane + 32, ...
    // Keys a row does not see are skipped, not multiplied by their P = 0: 0 · NaN and 0 · Inf are
    // NaN (common/nonfinite.cuh). Only a tile the mask cuts for some of this warp's rows has any
    // (keys past seq_k hold V = 0 here).
    const auto accumulate = [&](auto masked) {
      // Unrolled by 2 only without the mask: with it, sm_80 spilled 8 bytes.
      constexpr int kUnroll = decltype(masked)::value ? 1 : 2;
#pragma unroll kUnroll
      for (int jj = 0; jj < kBN; jj += 4) {
        float2 v[4][CPL];
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
          for (int c = 0; c < CPL; ++c)
            v[t][c] = lane + 32 * c < W ? P2::to_float2(sV[jj + t][lane + 32 * c])
                                        : make_float2(0.f, 0.f);
#pragma unroll
        for (int r = 0; r < kRPW<D>; ++r) {
          const float4 pr = *reinterpret_cast<const float4*>(&sP[warp][r][jj]);
          const float pv[4] = {pr.x, pr.y, pr.z, pr.w};
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            if (decltype(masked)::value && !mask.sees(row0 + r, n0 + jj + t)) continue;
#pragma unroll
            for (int c = 0; c < CPL; ++c) {
              acc[r][2 * c] = fmaf(pv[t], v[t][c].x, acc[r][2 * c]);
              acc[r][2 * c + 1] = fmaf(pv[t], v[t][c].y, acc[r][2 * c + 1]);
            }
          }
        }
      }
    };
    if (mask.tile_hides(row0, kRPW<D>, n0, kBN))
      accumulate(std::true_type{});
    else
      accumulate(std::false_type{});
    __syncwarp();  // sP is rewritten next tile
  }

  uint8_t* ob = p.o + 2 * (b * p.os.batch + h * p.os.head + seq.q0 * p.os.seq);
  const float sink = pm.sinks ? pm.sinks[h] : -INFINITY;
#pragma unroll
  for (int r = 0; r < kRPW<D>; ++r) {
    float lsum = warp_sum(l[r]);
    const int64_t i = row0 + r;
    if (i >= seq_q) continue;
    const float alpha = fold_sink(m[r], lsum, sink);
    const float inv = lsum > 0.f ? alpha / lsum : 0.f;  // no visible key and no sink: zeros
    uint32_t* orow = reinterpret_cast<uint32_t*>(ob + 2 * (i * p.os.seq));
#pragma unroll
    for (int c = 0; c < CPL; ++c)
      if (lane + 32 * c < W && (!kBand || lane + 32 * c < 4 * pm.v_chunks))
        orow[lane + 32 * c] = P2::from_float2(acc[r][2 * c] * inv, acc[r][2 * c + 1] * inv);
    // ln(sum_j 2^(x_j)) = (m + log2(l)) ln 2, x the log2-domain logits.
    if (pm.lse && lane == 0)
      pm.lse[lse_index(pm.seqs, seq, b, h, p.heads, p.seq_q, i)] =
          lsum > 0.f ? (m[r] + log2f(lsum)) * 0.6931471805599453f : -INFINITY;
  }
}

template <typename T, int D, class Mask>
void launch(const FwdArgs& a, const Mask& mask, cudaStream_t stream) {
  if ((a.mods.alibi && !a.mods.alibi_slopes) || (a.mods.sinks && !a.mods.sink_logits) ||
      (a.out.has_lse && !a.out.lse))
    throw Error("scalar: the ALiBi slopes, the sinks or the log-sum-exp buffer is missing");
  Params<Mask> p{};
  p.base = make_params(a);
  p.mask = mask;
  if (a.mods.softcap > 0.f) {
    p.cap2 = a.mods.softcap * 1.4426950408889634f;
    p.inv_cap2 = 1.f / p.cap2;
  }
  p.alibi = a.mods.alibi ? device_ptr<const float>(a.mods.alibi_slopes) : nullptr;
  p.alibi_bstride = a.mods.alibi_batch_stride;
  p.sinks = a.mods.sinks ? device_ptr<const float>(a.mods.sink_logits) : nullptr;
  p.lse = a.out.has_lse ? device_ptr<float>(a.out.lse) : nullptr;
  p.seqs = SeqParams::of(a);
  p.qk_chunks = int(a.dims.head_dim / 8);
  p.v_chunks = int(a.dims.head_dim_v / 8);
  const auto kernel = fwd_kernel<T, D, Mask>;
  constexpr int kSmem = int(sizeof(Smem<D>));
  if constexpr (kSmem > 48 * 1024) {
    static std::atomic<uint64_t> configured{0};
    opt_in_smem(reinterpret_cast<const void*>(kernel), kSmem, configured);
  }
  const dim3 grid(unsigned((a.dims.seq_q + kBM<D> - 1) / kBM<D>), unsigned(a.dims.heads),
                  unsigned(a.dims.batch));
  kernel<<<grid, kThreads, kSmem, stream>>>(p);
  SDPA_LAUNCH_CHECK("scalar fwd_kernel launch");
}

// What this kernel takes beyond its instantiation: a grid of 32-row query tiles with (batch,
// head) on grid z and y (batch: the sequences of packed or paged ones), and an sm_80+ device with
// the shared memory of its Smem<D>.
template <typename T, int D>
std::string can_implement(const FwdArgs& a, const DeviceInfo& dev) {
  return limits::first({limits::narrowed_head_dims(a, D), limits::grid_of_query_tiles(a, kBM<D>),
                        limits::sm80_or_newer(dev),
                        limits::smem_per_block(dev, int(sizeof(Smem<D>)))});
}

template <typename T, int D>
void forward(const FwdArgs& a, const DeviceInfo&, cudaStream_t stream) {
  mask::dispatch_band<int64_t>(
      a, [&](auto m) { launch<T, D, decltype(m)>(a, m, stream); }, mask::narrowed(a, D));
}

template <typename T, int D>
void attributes(std::vector<KernelAttr>& out, const DeviceInfo&) {
  push_attributes(
      out, "scalar", dtype_name<T>(), D,
      {reinterpret_cast<const void*>(fwd_kernel<T, D, mask::NoMask<int64_t>>),
       reinterpret_cast<const void*>(fwd_kernel<T, D, mask::CausalBottomRight<int64_t>>),
       reinterpret_cast<const void*>(fwd_kernel<T, D, mask::Band<int64_t>>)},
      int(sizeof(Smem<D>)));
}

}  // namespace sdpa::scalar
