// WMMA backend: FlashAttention-2 style forward on tensor cores through nvcuda::wmma (sm_80+).
// Assumes validated arguments (crates/sdpa/src/problem.rs): head_dim == D, 16-byte aligned
// rows, strides in elements, heads % kv_heads == 0, seq_q, seq_k >= 1.
//
// One CTA = BM = 64 query rows of one (batch, head); 4 warps each own 16 rows (one wmma M) and
// sweep every key tile themselves, so the softmax never has to merge state across warps. Per
// tile of BN = 64 keys a warp computes its 16x64 S strip with 16x16x16 wmma into shared memory,
// runs the online softmax on it (2 lanes per row, log2 domain, f32), writes P back as T over the
// same strip and accumulates P·V into O fragments kept in registers. K/V tiles arrive by
// cp.async, double-buffered: tile n+1 is in flight while tile n is computed.
#pragma once

#include <cuda_runtime.h>
#include <mma.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "common/check.cuh"
#include "common/dtype.cuh"

namespace sdpa::wmma_backend {

namespace wm = nvcuda::wmma;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBM = kWarps * 16;  // one 16-row wmma strip per warp
constexpr int kBN = 64;
static_assert(kBM == kBN, "Q is staged with the K/V tile loader");
// 8 elements (16 bytes) of padding per K/V/Q row: the row pitch is then 16 bytes past a
// multiple of 128, so the 8 rows one wmma load touches per phase start in different banks.
constexpr int kPad = 8;
// S strip pitch in floats (64 + 4): 272 bytes, again 16 bytes past a multiple of 128, which
// keeps the softmax's float4 reads (lanes 0-7 read rows 0-7) and the P writes conflict-free.
constexpr int kSLd = kBN + 4;
// P is written as T over its own S row, so its pitch in elements is the S pitch in bytes / 2.
constexpr int kPLd = 2 * kSLd;

using Acc = wm::fragment<wm::accumulator, 16, 16, 16, float>;

// Dynamic shared memory, byte offsets. Every region starts on a 128-byte boundary (wmma needs
// 32). Q is staged once over the S strips, which are free until the first tile.
template <int D>
struct Layout {
  static constexpr int kLd = D + kPad;                 // K/V/Q row pitch in elements
  static constexpr int kTile = kBN * kLd * 2;          // one K or V tile
  static constexpr int kStrip = 16 * kSLd * 4;         // one warp's f32 S strip
  static constexpr int kK = 0;                         // K tiles [2][kBN][kLd]
  static constexpr int kV = kK + 2 * kTile;            // V tiles [2][kBN][kLd]
  static constexpr int kS = kV + 2 * kTile;            // S/P strips [kWarps][16][kSLd]; Q staging
  static constexpr int kAlpha = kS + kWarps * kStrip;  // per-row factors [kWarps][16]
  static constexpr int kBytes = kAlpha + kWarps * 16 * 4;
  static_assert(kTile % 128 == 0 && kStrip % 128 == 0, "regions must stay 128-byte aligned");
  static_assert(kBM * kLd * 2 <= kWarps * kStrip, "Q staging must fit in the S strips");
  // Within the 99 KB per-CTA opt-in limit of sm_86/sm_89. At D = 128 (85.3 KB) two CTAs fit
  // an sm_90 SM (228 KB) but only one an sm_80 SM (164 KB); D = 64 (53.3 KB) fits two on both.
  static_assert(kBytes <= 99 * 1024, "shared memory over budget");
};

struct Params {
  const uint8_t *q, *k, *v;
  uint8_t* o;
  int64_t seq_q, seq_k, heads, group;  // group = heads / kv_heads
  Strides qs, ks, vs, os;
  float scale_log2;  // scale * log2(e): scores live in the log2 domain
};

// 16-byte global -> shared copy that bypasses L1 (.cg: K/V are reused across CTAs through L2,
// not within one). With valid == false nothing is read and the 16 bytes are zero-filled.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  const size_t s = __cvta_generic_to_global(src);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(s),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// Issues cp.async for 64 rows [r0, r0 + 64) of a [n, D] matrix with row stride `ld` elements
// into shared memory with pitch kLd. Rows >= n are zero-filled: zero K/Q rows give finite
// scores that the mask then discards, and zero V rows keep 0 * garbage = NaN out of P·V.
template <int D>
__device__ __forceinline__ void load_tile(uint8_t* dst, const uint8_t* src, int64_t ld, int64_t r0,
                                          int64_t n, int tid) {
  constexpr int CH = D / 8;  // 16-byte chunks per row
  static_assert(kBN * CH % kThreads == 0, "tile chunks must split evenly over the CTA");
#pragma unroll
  for (int i = 0; i < kBN * CH / kThreads; ++i) {
    const int c = tid + i * kThreads, r = c / CH, col = (c % CH) * 8;
    const bool valid = r0 + r < n;
    // An out-of-range row still needs a mapped source address; the base is never read.
    const uint8_t* g = valid ? src + 2 * ((r0 + r) * ld + col) : src;
    cp_async16(dst + 2 * (r * Layout<D>::kLd + col), g, valid);
  }
}

template <typename T, int D, bool CAUSAL>
__global__ void __launch_bounds__(kThreads) fwd_kernel(const Params p) {
  using L = Layout<D>;
  using P2 = Pair<T>;
  constexpr int KD = D / 16;  // k-steps of Q·Kᵀ, and O fragments per warp
  constexpr int NE = Acc::num_elements;
  static_assert(D % 64 == 0, "the epilogue writes 64 columns at a time");

  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T* sK = reinterpret_cast<const T*>(smem + L::kK);
  const T* sV = reinterpret_cast<const T*>(smem + L::kV);
  float* sS = reinterpret_cast<float*>(smem + L::kS + warp * L::kStrip);  // this warp's strip
  T* sP = reinterpret_cast<T*>(sS);
  float* sAlpha = reinterpret_cast<float*>(smem + L::kAlpha) + warp * 16;

  const int64_t m0 = int64_t(blockIdx.x) * kBM;
  const int64_t h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const uint8_t* qb = p.q + 2 * (b * p.qs.batch + h * p.qs.head);
  const uint8_t* kb = p.k + 2 * (b * p.ks.batch + hk * p.ks.head);
  const uint8_t* vb = p.v + 2 * (b * p.vs.batch + hk * p.vs.head);
  const int64_t off = p.seq_k - p.seq_q;  // causal mask aligned bottom-right
  const int64_t wrow0 = m0 + warp * 16;   // this warp's first query row

  // Keys this CTA can see: all, or (causal) up to its last real row's diagonal. May be 0.
  int64_t n_end = p.seq_k;
  if (CAUSAL) n_end = min(p.seq_k, max(int64_t(0), min(m0 + kBM, p.seq_q) + off));
  const int n_tiles = int((n_end + kBN - 1) / kBN);

  // Prologue: Q (staged over the S strips) and K/V tile 0 as one cp.async group.
  load_tile<D>(smem + L::kS, qb, p.qs.seq, m0, p.seq_q, tid);
  if (n_tiles > 0) {
    load_tile<D>(smem + L::kK, kb, p.ks.seq, 0, p.seq_k, tid);
    load_tile<D>(smem + L::kV, vb, p.vs.seq, 0, p.seq_k, tid);
  }
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  // Q stays in registers as matrix_a fragments for the whole key sweep.
  wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major> qf[KD];
  {
    const T* sQ = reinterpret_cast<const T*>(smem + L::kS) + warp * 16 * L::kLd;
#pragma unroll
    for (int k = 0; k < KD; ++k) wm::load_matrix_sync(qf[k], sQ + k * 16, L::kLd);
  }
  __syncthreads();  // the S strips are about to overwrite other warps' Q rows

  // O lives in accumulator fragments, whose element -> (row, col) mapping wmma leaves
  // unspecified. The per-row rescale only needs each element's row, so read it off a fragment
  // loaded from a matrix whose entries are their own row index. The mapping is a property of
  // the fragment type (mma_sync takes C/D fragments without a layout), so it holds for every
  // O fragment. This keeps O in registers instead of a shared-memory round trip per tile.
  int row_of[NE];
  {
    for (int i = lane; i < 16 * 16; i += 32) sS[(i / 16) * kSLd + i % 16] = float(i / 16);
    __syncwarp();
    Acc probe;
    wm::load_matrix_sync(probe, sS, kSLd, wm::mem_row_major);
#pragma unroll
    for (int e = 0; e < NE; ++e) row_of[e] = int(probe.x[e]);
    __syncwarp();  // the first S tile overwrites the probe matrix
  }

  Acc o[KD];
#pragma unroll
  for (int f = 0; f < KD; ++f) wm::fill_fragment(o[f], 0.f);

  // Softmax ownership: lane and lane ^ 16 share row r, each holding 32 of the 64 columns.
  const int r = lane & 15, half = lane >> 4;
  const int64_t row = wrow0 + r;
  float m_run = -INFINITY, l_run = 0.f;  // l_run: this lane's partial row sum

  for (int t = 0; t < n_tiles; ++t) {
    const int buf = t & 1;
    const int64_t n0 = int64_t(t) * kBN;
    if (t > 0) {
      cp_async_wait_all();
      // Tile t is visible to all, and every warp is done with tile t - 1, whose buffer the
      // prefetch below reuses. One barrier per tile.
      __syncthreads();
    }
    if (t + 1 < n_tiles) {
      load_tile<D>(smem + L::kK + (buf ^ 1) * L::kTile, kb, p.ks.seq, n0 + kBN, p.seq_k, tid);
      load_tile<D>(smem + L::kV + (buf ^ 1) * L::kTile, vb, p.vs.seq, n0 + kBN, p.seq_k, tid);
      cp_async_commit();
    }

    // S = Q·Kᵀ: the row-major K tile read as a col-major matrix_b is Kᵀ. This loop and the P·V
    // key loop stay rolled: unrolled, ptxas hoists all their fragment loads and D = 128 spills.
    const T* kt = sK + buf * kBN * L::kLd;
#pragma unroll 1
    for (int nb = 0; nb < kBN / 16; ++nb) {
      Acc s;
      wm::fill_fragment(s, 0.f);
#pragma unroll
      for (int k = 0; k < KD; ++k) {
        wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::col_major> kf;
        wm::load_matrix_sync(kf, kt + nb * 16 * L::kLd + k * 16, L::kLd);
        wm::mma_sync(s, qf[k], kf, s);
      }
      wm::store_matrix_sync(sS + nb * 16, s, kSLd, wm::mem_row_major);
    }
    __syncwarp();

    // Online softmax of this lane's half row.
    float x[32];
    {
      const float* srow = sS + r * kSLd + half * 32;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float4 v = *reinterpret_cast<const float4*>(srow + 4 * j);
        x[4 * j] = v.x * p.scale_log2;
        x[4 * j + 1] = v.y * p.scale_log2;
        x[4 * j + 2] = v.z * p.scale_log2;
        x[4 * j + 3] = v.w * p.scale_log2;
      }
    }
    // Only the last tile and (causal) tiles crossing this warp's diagonal need a mask.
    const bool edge = n0 + kBN > p.seq_k || (CAUSAL && n0 + kBN - 1 > wrow0 + off);
    if (edge) {
      const int64_t j0 = n0 + half * 32;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        if (j0 + j >= p.seq_k || (CAUSAL && j0 + j > row + off)) x[j] = -INFINITY;
    }
    float mx = x[0];
#pragma unroll
    for (int j = 1; j < 32; ++j) mx = fmaxf(mx, x[j]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
    const float m_new = fmaxf(m_run, mx);
    // A row with nothing visible yet keeps m = -inf; subtracting 0 then keeps p = 0, not NaN.
    const float base = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = exp2f(m_run - base);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      x[j] = exp2f(x[j] - base);
      sum += x[j];
    }
    l_run = l_run * alpha + sum;
    m_run = m_new;

    __syncwarp();  // every lane has read its S values: P may now overwrite the strip
    {
      uint4* prow = reinterpret_cast<uint4*>(sP + r * kPLd + half * 32);
#pragma unroll
      for (int q = 0; q < 4; ++q)
        prow[q] = make_uint4(P2::from_float2(x[8 * q], x[8 * q + 1]),
                             P2::from_float2(x[8 * q + 2], x[8 * q + 3]),
                             P2::from_float2(x[8 * q + 4], x[8 * q + 5]),
                             P2::from_float2(x[8 * q + 6], x[8 * q + 7]));
    }
    if (half == 0) sAlpha[r] = alpha;
    __syncwarp();

#pragma unroll
    for (int e = 0; e < NE; ++e) {
      const float a = sAlpha[row_of[e]];
#pragma unroll
      for (int f = 0; f < KD; ++f) o[f].x[e] *= a;
    }

    // O += P·V.
    const T* vt = sV + buf * kBN * L::kLd;
#pragma unroll 1
    for (int kk = 0; kk < kBN / 16; ++kk) {
      wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major> pf;
      wm::load_matrix_sync(pf, sP + kk * 16, kPLd);
#pragma unroll
      for (int f = 0; f < KD; ++f) {
        wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::row_major> vf;
        wm::load_matrix_sync(vf, vt + kk * 16 * L::kLd + f * 16, L::kLd);
        wm::mma_sync(o[f], pf, vf, o[f]);
      }
    }
  }

  // Normalize by the full row sum; a row with no visible key has l = 0 and outputs zeros.
  const float l = l_run + __shfl_xor_sync(0xffffffffu, l_run, 16);
  __syncwarp();  // all lanes are past their last reads of sAlpha and of P in the strip
  if (half == 0) sAlpha[r] = l > 0.f ? 1.f / l : 0.f;
  __syncwarp();
#pragma unroll
  for (int e = 0; e < NE; ++e) {
    const float inv = sAlpha[row_of[e]];
#pragma unroll
    for (int f = 0; f < KD; ++f) o[f].x[e] *= inv;
  }

  // Out through the strip, 64 columns at a time, so each row leaves as 16-byte stores.
  uint8_t* ob = p.o + 2 * (b * p.os.batch + h * p.os.head);
#pragma unroll
  for (int c0 = 0; c0 < D; c0 += 64) {
#pragma unroll
    for (int f = 0; f < 4; ++f)
      wm::store_matrix_sync(sS + f * 16, o[c0 / 16 + f], kSLd, wm::mem_row_major);
    __syncwarp();
#pragma unroll
    for (int i = lane; i < 16 * 8; i += 32) {
      const int rr = i / 8, cc = (i % 8) * 8;
      const int64_t orow = wrow0 + rr;
      if (orow < p.seq_q) {
        const float4 lo = *reinterpret_cast<const float4*>(sS + rr * kSLd + cc);
        const float4 hi = *reinterpret_cast<const float4*>(sS + rr * kSLd + cc + 4);
        *reinterpret_cast<uint4*>(ob + 2 * (orow * p.os.seq + c0 + cc)) =
            make_uint4(P2::from_float2(lo.x, lo.y), P2::from_float2(lo.z, lo.w),
                       P2::from_float2(hi.x, hi.y), P2::from_float2(hi.z, hi.w));
      }
    }
    __syncwarp();  // the next column block overwrites the strip
  }
}

template <typename T, int D, bool CAUSAL>
void launch(const FwdArgs& a, cudaStream_t stream) {
  constexpr int kSmem = Layout<D>::kBytes;
  // Dynamic shared memory above 48 KB needs an opt-in, which is per function and per device:
  // one bit per device already configured makes it one call per (instantiation, device).
  static std::atomic<uint64_t> configured{0};
  int dev = 0;
  SDPA_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? uint64_t(1) << dev : 0;
  if (bit == 0 || !(configured.load(std::memory_order_relaxed) & bit)) {
    SDPA_CUDA_CHECK(cudaFuncSetAttribute(fwd_kernel<T, D, CAUSAL>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    configured.fetch_or(bit, std::memory_order_relaxed);
  }

  Params p;
  p.q = static_cast<const uint8_t*>(a.q);
  p.k = static_cast<const uint8_t*>(a.k);
  p.v = static_cast<const uint8_t*>(a.v);
  p.o = static_cast<uint8_t*>(a.o);
  p.seq_q = a.seq_q;
  p.seq_k = a.seq_k;
  p.heads = a.heads;
  p.group = a.heads / a.kv_heads;
  p.qs = a.q_stride;
  p.ks = a.k_stride;
  p.vs = a.v_stride;
  p.os = a.o_stride;
  p.scale_log2 = a.scale * 1.4426950408889634f;
  const dim3 grid(unsigned((a.seq_q + kBM - 1) / kBM), unsigned(a.heads), unsigned(a.batch));
  fwd_kernel<T, D, CAUSAL><<<grid, kThreads, kSmem, stream>>>(p);
  SDPA_LAUNCH_CHECK("wmma fwd_kernel launch");
}

template <typename T, int D>
void forward(const FwdArgs& a, cudaStream_t stream) {
  if (a.causal)
    launch<T, D, true>(a, stream);
  else
    launch<T, D, false>(a, stream);
}

template <typename T, int D>
void attributes(std::vector<KernelAttr>& out) {
  const void* fns[2] = {reinterpret_cast<const void*>(fwd_kernel<T, D, false>),
                        reinterpret_cast<const void*>(fwd_kernel<T, D, true>)};
  for (int c = 0; c < 2; ++c) {
    cudaFuncAttributes fa;
    SDPA_CUDA_CHECK(cudaFuncGetAttributes(&fa, fns[c]));
    // sharedSizeBytes counts static shared memory only; this kernel's is all dynamic.
    out.push_back(
        {"wmma",
         std::string("fwd_") + dtype_name<T>() + "_d" + std::to_string(D) + (c ? "_causal" : ""),
         fa.numRegs, int32_t(fa.sharedSizeBytes), Layout<D>::kBytes, int32_t(fa.localSizeBytes),
         fa.maxThreadsPerBlock});
  }
}

}  // namespace sdpa::wmma_backend
