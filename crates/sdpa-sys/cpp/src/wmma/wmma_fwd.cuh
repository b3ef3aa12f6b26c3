// WMMA backend: FlashAttention-2 style forward on tensor cores through nvcuda::wmma (sm_80+).
// Assumes validated arguments (crates/sdpa/src/problem/mod.rs): head_dim == D, 16-byte aligned
// rows, strides in elements, heads % kv_heads == 0, seq_q, seq_k >= 1, scale > 0; and the
// limits can_implement (below) checks: heads and batch <= 65535 (grid y and z), seq_k <= 2^30
// (load_kv's tile offset).
//
// One CTA = BM = 64 query rows of one (batch, head); 4 warps each own 16 rows (one wmma M) and
// sweep every key tile themselves, so the softmax never has to merge state across warps. Per
// tile of BN = 64 keys a warp computes its 16x64 S strip with 16x16x16 wmma into shared memory,
// runs the online softmax on it (2 lanes per row, log2 domain, f32), writes P back as T into
// the same strip and accumulates P·V into O fragments kept in registers. K/V tiles arrive by
// cp.async, double-buffered: tile n+1 is in flight while tile n is computed.
//
// The mask is a policy of common/mask.cuh (Index int64_t), built in forward() from a.mask.kind: the
// kernel asks it for the CTA's key range, which tiles need a mask, and per row the keys it sees.
// Under a mask that hides keys, a V tile partly masked for the CTA (first_partial_tile on) is
// checked for Inf/NaN at the tile's barrier and, in the rare case it has some, handled as
// common/nonfinite.cuh describes (the non-finite V check).
//
// Every tuning choice below says what it trades. Those marked "(measured)" were chosen by timing
// the alternatives: docs/log/2026-11-notebook.md, "wmma tuned by measurement" (the variants and
// their figures) and "Figures that lived in code comments".
#pragma once

#include <cuda_runtime.h>
#include <mma.h>

#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common/attributes.cuh"
#include "common/check.cuh"
#include "common/dtype.cuh"
#include "common/ex2.cuh"
#include "common/launch.cuh"
#include "common/limits.cuh"
#include "common/mask.cuh"
#include "common/nonfinite.cuh"
#include "common/smem.cuh"

namespace sdpa::wmma_backend {

namespace wm = nvcuda::wmma;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBM = kWarps * 16;  // one 16-row wmma strip per warp
constexpr int kBN = 64;
static_assert(kBM == kBN, "Q is staged with the K/V tile loader");
// K/V/Q row padding: 8 elements (16 bytes) puts the row pitch 16 bytes past a multiple of 128, so
// the 8 rows one ldmatrix phase reads start in different banks. Without padding every ldmatrix
// of K/V is an 8-way bank conflict; 16 elements puts rows r and r + 4 in the same banks (pitch
// 32 bytes past a multiple of 128), and at D = 64 costs a CTA per SM (measured).
// wmma takes a pointer and a pitch, so an XOR swizzle is not expressible; padding is the choice.
constexpr int kPad = 8;
// S strip pitch in floats: 72 (288 bytes, 32 past 256). wmma's f32 accumulator store writes 8-byte
// pairs, 4 lanes per row, 4 rows per half-warp: at 72 those 4 rows land on disjoint 8-bank spans. A
// pitch of 68 is free of conflicts for the softmax reads but makes every accumulator store 2-way;
// 72 with the lane mapping below is conflict-free for all four accesses. Pitch 64 starts every row
// in the same bank, so the rows of each store and read conflict (measured).
constexpr int kSLd = kBN + 8;
// P (T) has its own pitch inside the strip: 72 elements = 144 bytes (16 past 128), so both the
// softmax's 8-byte P stores and the ldmatrix rows of the P·V load are conflict-free.
constexpr int kPLd = kBN + 8;
// Two K/V stages: a third stage costs a CTA per SM at D = 64 (4 -> 3) and at D = 128 (2 -> 1),
// more than the deeper prefetch returns (measured). An FA2-style schedule with one K and one V
// buffer loaded in split phases (two barriers per tile, 168 registers for 3 CTAs/SM) raises the
// warps an SM holds, but its second barrier per tile and smaller register budget take that back
// (measured): not worth a second schedule.
constexpr int kStages = 2;

using Acc = wm::fragment<wm::accumulator, 16, 16, 16, float>;

// Dynamic shared memory, byte offsets. Every region starts on a 128-byte boundary (wmma needs
// 32). Q is staged once over the S strips, which are free until the first tile.
template <int D>
struct Layout {
  static constexpr int kLd = D + kPad;                 // K/V/Q row pitch in elements
  static constexpr int kTile = kBN * kLd * 2;          // one K or V tile
  static constexpr int kStrip = 16 * kSLd * 4;         // one warp's f32 S strip
  static constexpr int kK = 0;                         // K tiles [kStages][kBN][kLd]
  static constexpr int kV = kK + kStages * kTile;      // V tiles [kStages][kBN][kLd]
  static constexpr int kS = kV + kStages * kTile;      // S/P strips [kWarps][16][kSLd]; Q staging
  static constexpr int kAlpha = kS + kWarps * kStrip;  // per-row factors [kWarps][16]
  // The non-finite V check's columns of the current V tile (rare path). A region of its own: it
  // must live from before the first warp's P·V to after the last one's, and all else is busy then.
  static constexpr int kNf = kAlpha + kWarps * 16 * 4;
  static constexpr int kBytes = kNf + int(sizeof(NonFiniteCols<D>));
  static_assert(kTile % 128 == 0 && kStrip % 128 == 0, "regions must stay 128-byte aligned");
  static_assert(kBM * kLd * 2 <= kWarps * kStrip, "Q staging must fit in the S strips");
  static_assert(16 * kPLd * 2 <= kStrip, "P must fit in its warp's S strip");
  // Within the 99 KB per-CTA opt-in limit of sm_86/sm_89. D = 128 (86.6 KB): two CTAs per SM
  // on sm_90 (228 KB), one on sm_80 (164 KB). D = 64 (54.4 KB): four on sm_90, two on sm_80.
  static_assert(kBytes <= 99 * 1024, "shared memory over budget");
};

using Params = KernelParams;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copies that bypass L1 (.cg: K/V are reused across CTAs through L2,
// not within one). With valid == false nothing is read and the 16 bytes are zero-filled.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst),
               "l"(__cvta_generic_to_global(src))
               : "memory");
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(__cvta_generic_to_global(src)), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// Softmax exponents, exact at any logit size. The max's base is RN(m·scale); every exponent
// is x·scale - base. Folded into one FMA (exact product, one rounding) the max's own exponent
// is the rounding residual of its base, up to half an ulp of m·scale: harmless below 2^15
// (|residual| <= 2^-9, p <= 1.0014), but past ~2^24 it reaches whole powers of two and p of
// the max becomes 0 or inf (tests/numerics.rs, logits 1e8-1e10). There the product is
// rounded first, RN(x·scale) - base: exactly 0 for the max, <= 0 for the rest (monotone).
// The check is per row, outside the element loop, so ordinary logits keep the single FMA.

// Fragment loads from shared memory. For f16 the library's wmma.load already carries the .shared
// state space and becomes ldmatrix. The bf16 builtins lose it: their PTX loads are generic, which
// ptxas turns into plain LD plus MOVM transposes, several instructions where f16 issues one
// ldmatrix (measured). The same wmma.load with .shared spelled out restores ldmatrix. Layouts
// are wmma's own (the instruction is the same), so mma_sync consumes them unchanged.
__device__ __forceinline__ void load_frag(
    wm::fragment<wm::matrix_a, 16, 16, 16, __nv_bfloat16, wm::row_major>& f, const __nv_bfloat16* p,
    unsigned ldm) {
  uint32_t* x = reinterpret_cast<uint32_t*>(&f);
  asm volatile("wmma.load.a.sync.aligned.row.m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;\n"
               : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
               : "r"(smem_addr(p)), "r"(ldm)
               : "memory");
}
__device__ __forceinline__ void load_frag(
    wm::fragment<wm::matrix_b, 16, 16, 16, __nv_bfloat16, wm::col_major>& f, const __nv_bfloat16* p,
    unsigned ldm) {
  uint32_t* x = reinterpret_cast<uint32_t*>(&f);
  asm volatile("wmma.load.b.sync.aligned.col.m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;\n"
               : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
               : "r"(smem_addr(p)), "r"(ldm)
               : "memory");
}
__device__ __forceinline__ void load_frag(
    wm::fragment<wm::matrix_b, 16, 16, 16, __nv_bfloat16, wm::row_major>& f, const __nv_bfloat16* p,
    unsigned ldm) {
  uint32_t* x = reinterpret_cast<uint32_t*>(&f);
  asm volatile("wmma.load.b.sync.aligned.row.m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;\n"
               : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
               : "r"(smem_addr(p)), "r"(ldm)
               : "memory");
}
template <typename Frag>
__device__ __forceinline__ void load_frag(Frag& f, const __half* p, unsigned ldm) {
  wm::load_matrix_sync(f, p, ldm);
}

// Issues cp.async for one 64-row tile. Thread tid owns the 16-byte column chunk tid % CH of rows
// tid / CH + i * RS; `g` points at its first chunk in global memory, `step` is RS rows in bytes and
// `dst` its first chunk in shared memory. Only a tile with fewer than 64 rows left pays for the row
// predicate: rows past the end are zero-filled (zero K/Q rows give finite scores that the mask then
// discards, zero V rows keep 0 * garbage = NaN out of P·V) and read from `base`, which is mapped.
// Precomputing the addresses cuts the loader's instructions per tile to about a third, which
// counts where issue slots are short (D = 64), not where the Q·Kᵀ chain binds (D = 128; measured).
template <int D>
__device__ __forceinline__ void load_tile(uint32_t dst, const uint8_t* g, int64_t step,
                                          int rows_left, int tid, const uint8_t* base) {
  constexpr int CH = D / 8, RS = kThreads / CH;
  static_assert(kThreads % CH == 0, "each thread must keep one column chunk");
  constexpr int kRowBytes = Layout<D>::kLd * 2;
  if (rows_left >= kBN) {
#pragma unroll
    for (int i = 0; i < kBN / RS; ++i) cp_async16(dst + i * RS * kRowBytes, g + i * step);
  } else {
#pragma unroll
    for (int i = 0; i < kBN / RS; ++i) {
      const bool valid = tid / CH + i * RS < rows_left;
      cp_async16(dst + i * RS * kRowBytes, valid ? g + i * step : base, valid);
    }
  }
}

// Non-finite V check, step 1, before the tile's barrier: whether the 16-byte chunks of one V tile
// that load_tile made this thread copy (from `dst`, as there) hold an Inf or a NaN. cp.async's
// wait_group makes a thread's own copies visible to it, so the check needs no barrier of its own:
// the tile's barrier ORs it over the CTA. Rows past seq_k are zero-filled: finite.
template <typename T, int D>
__device__ __forceinline__ bool own_chunks_nonfinite(uint32_t dst) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr int CH = D / 8, RS = kThreads / CH;
  constexpr int kRowBytes = Layout<D>::kLd * 2;
  uint32_t bits = 0;
#pragma unroll
  for (int i = 0; i < kBN / RS; ++i) {
    bits |= nonfinite8_bits<kBf16>(ld_shared_128(dst + i * RS * kRowBytes));
  }
  return (bits & kNonFinite2Bits) != 0;
}

// Non-finite V check, step 2 (rare path, some thread found a non-finite value): one thread per
// column records the first NaN, +Inf and -Inf of its column of V tile `v` into c and zeroes them.
template <typename T, int D>
__device__ __forceinline__ void record_and_zero(uint16_t* v, NonFiniteCols<D>& c, int tid) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  static_assert(kBN < kNoKey, "tile-relative keys must fit NonFiniteCols");
  for (int col = tid; col < D; col += kThreads) {
    c.first[0][col] = c.first[1][col] = c.first[2][col] = kNoKey;
#pragma unroll 1
    for (int key = 0; key < kBN; ++key) {
      uint16_t& x = v[key * Layout<D>::kLd + col];
      if (record_nonfinite<kBf16, D>(c, key, col, x)) x = 0;
    }
  }
}

// CTAs per SM that __launch_bounds__ asks for at D = 64. On sm_90, 4 fit in shared memory (4 x
// 54.4 KB) and 4 caps registers at 128; without the cap ptxas takes more and only 3 CTAs fit,
// and the 3-CTA configuration loses to 4 (measured). On sm_80 shared memory admits only 2, and the
// 128 cap would spill there, so it asks for 2. D = 128 holds 2 CTAs per SM on sm_90 and 1 on sm_80
// (shared memory) at any register count, so it asks for 1.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kMinCtasD64 = 2;
#else
constexpr int kMinCtasD64 = 4;
#endif

template <typename T, int D, class Mask>
__global__ void __launch_bounds__(kThreads, D == 64 ? kMinCtasD64 : 1) fwd_kernel(const Params p) {
  const Mask mask{p.seq_q, p.seq_k};  // which keys each row sees
  using L = Layout<D>;
  using P2 = Pair<T>;
  constexpr int KD = D / 16;    // k-steps of Q·Kᵀ, and O fragments per warp
  constexpr int NB = kBN / 16;  // 16-key blocks per tile
  constexpr int NE = Acc::num_elements;
  static_assert(D % 64 == 0, "the epilogue writes 64 columns at a time");

  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T* sK = reinterpret_cast<const T*>(smem + L::kK);
  const T* sV = reinterpret_cast<const T*>(smem + L::kV);
  float* sS = reinterpret_cast<float*>(smem + L::kS + warp * L::kStrip);  // this warp's strip
  T* sP = reinterpret_cast<T*>(sS);
  float* sAlpha = reinterpret_cast<float*>(smem + L::kAlpha) + warp * 16;
  NonFiniteCols<D>& nf = *reinterpret_cast<NonFiniteCols<D>*>(smem + L::kNf);

  const int64_t m0 = int64_t(blockIdx.x) * kBM;
  const int64_t h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const uint8_t* qb = p.q + 2 * (b * p.qs.batch + h * p.qs.head);
  const uint8_t* kb = p.k + 2 * (b * p.ks.batch + hk * p.ks.head);
  const uint8_t* vb = p.v + 2 * (b * p.vs.batch + hk * p.vs.head);
  const int64_t wrow0 = m0 + warp * 16;  // this warp's first query row

  // Key tiles [t_begin, n_tiles) hold the keys this CTA's rows see; may be none.
  const int t_begin = int(mask.key_begin(m0, kBM) / kBN);
  const int n_tiles = int((mask.key_end(m0, kBM) + kBN - 1) / kBN);
  // The first tile holding a key (< seq_k) that some row of the CTA does not see (the non-finite V
  // check); n_tiles if none. Under a causal mask, the last one or two.
  const int t_diag = mask.first_partial_tile(m0, kBN, n_tiles);

  // Loader addresses: this thread's chunk of a tile, advanced by whole tiles.
  constexpr int CH = D / 8, RS = kThreads / CH;
  const int lrow = tid / CH, lcol = (tid % CH) * 8;
  const uint32_t s_chunk = smem_addr(smem) + (lrow * L::kLd + lcol) * 2;
  const uint8_t* kg = kb + 2 * (lrow * p.ks.seq + lcol);
  const uint8_t* vg = vb + 2 * (lrow * p.vs.seq + lcol);
  // The block barrier of tile t < n_tiles, in buffer buf, once this thread's cp.async copies of
  // it have landed: on a partly masked tile it also says whether V holds an Inf or a NaN
  // (CTA-uniform), elsewhere false.
  const auto tile_barrier = [&](int t, int buf) {
    if (Mask::kMasksKeys && t >= t_diag)
      return __syncthreads_or(own_chunks_nonfinite<T, D>(s_chunk + L::kV + buf * L::kTile)) != 0;
    __syncthreads();
    return false;
  };
  // `tile * 2 * kBN` is an int product (then widened by the 64-bit stride): the last tile's
  // must fit, so seq_k <= 2^30 (checked by can_implement, below).
  auto load_kv = [&](int tile, int buf) {
    const int rows_left = int(min(mask.seq_k - int64_t(tile) * kBN, int64_t(kBN)));
    load_tile<D>(s_chunk + L::kK + buf * L::kTile, kg + tile * 2 * kBN * p.ks.seq,
                 2 * RS * p.ks.seq, rows_left, tid, kb);
    load_tile<D>(s_chunk + L::kV + buf * L::kTile, vg + tile * 2 * kBN * p.vs.seq,
                 2 * RS * p.vs.seq, rows_left, tid, vb);
  };

  // Prologue: Q (staged over the S strips) and the first K/V tile as one cp.async group.
  load_tile<D>(s_chunk + L::kS, qb + 2 * ((m0 + lrow) * p.qs.seq + lcol), 2 * RS * p.qs.seq,
               int(min(mask.seq_q - m0, int64_t(kBM))), tid, qb);
  if (t_begin < n_tiles) load_kv(t_begin, 0);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  // Q stays in registers as matrix_a fragments for the whole key sweep.
  wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major> qf[KD];
  {
    const T* sQ = reinterpret_cast<const T*>(smem + L::kS) + warp * 16 * L::kLd;
#pragma unroll
    for (int k = 0; k < KD; ++k) load_frag(qf[k], sQ + k * 16, L::kLd);
  }
  // The S strips are about to overwrite other warps' Q rows. Doubles as the first tile's barrier.
  bool nonfinite = false;
  if (Mask::kMasksKeys && t_begin < n_tiles)
    nonfinite = tile_barrier(t_begin, 0);
  else
    __syncthreads();

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

  // Softmax ownership: lanes 2r and 2r + 1 share row r. Lane half = lane & 1 holds the column
  // quads 8j + 4 * half + [0, 4), j < 8, so the 8 lanes of one 16-byte read phase cover rows
  // 0-3 x both halves: 8 disjoint 4-bank groups at pitch 72.
  const int r = lane >> 1, half = lane & 1;
  const int64_t row = wrow0 + r;
  float m_run = -INFINITY, l_run = 0.f;  // m_run: scaled (log2) max; l_run: this lane's sum

  // buf is carried rather than computed as t & 1: with t & 1, ptxas spills 4-8 bytes at D = 64
  // under the 128-register cap; with the carried bit it needs 126 and no spills.
  for (int t = t_begin, buf = 0; t < n_tiles; ++t, buf ^= 1) {
    const int64_t n0 = int64_t(t) * kBN;
    if (t > t_begin) {
      cp_async_wait_all();
      // Tile t is visible to all, and every warp is done with tile t - 1, whose buffer the
      // prefetch below reuses. One barrier per tile.
      nonfinite = tile_barrier(t, buf);
    }
    if (t + 1 < n_tiles) {
      load_kv(t + 1, buf ^ 1);
      cp_async_commit();
    }
    if (Mask::kMasksKeys && nonfinite) {  // rare; CTA-uniform
      record_and_zero<T, D>(reinterpret_cast<uint16_t*>(smem + L::kV + buf * L::kTile), nf, tid);
      __syncthreads();  // V is finite again before any P·V reads it; nf is complete
    }

    // S = Q·Kᵀ: the row-major K tile read as a col-major matrix_b is Kᵀ. Four independent
    // accumulators (one per 16-key block) interleave their mma chains; one accumulator at a time
    // leaves each 16-key block a chain of KD dependent mmas, the latency D = 128 waits on, and
    // two accumulators hide less of it (measured).
    {
      const T* kt = sK + buf * kBN * L::kLd;
      Acc s[NB];
#pragma unroll
      for (int n = 0; n < NB; ++n) wm::fill_fragment(s[n], 0.f);
#pragma unroll
      for (int k = 0; k < KD; ++k) {
#pragma unroll
        for (int n = 0; n < NB; ++n) {
          wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::col_major> kf;
          load_frag(kf, kt + n * 16 * L::kLd + k * 16, L::kLd);
          wm::mma_sync(s[n], qf[k], kf, s[n]);
        }
      }
#pragma unroll
      for (int n = 0; n < NB; ++n)
        wm::store_matrix_sync(sS + n * 16, s[n], kSLd, wm::mem_row_major);
    }
    __syncwarp();

    // Online softmax of this lane's half row, on raw scores: scale > 0 commutes with max, and the
    // scaling folds into one FFMA per element inside the exponent; with the tree reductions and
    // ex2 that keeps the softmax's instruction count and dependency chains short (measured).
    float x[32];
    {
      const float* srow = sS + r * kSLd + 4 * half;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float4 v = *reinterpret_cast<const float4*>(srow + 8 * j);
        x[4 * j] = v.x, x[4 * j + 1] = v.y, x[4 * j + 2] = v.z, x[4 * j + 3] = v.w;
      }
    }
    // Only the last tile and tiles the mask cuts for this warp's rows need masking.
    if (mask.tile_masked(wrow0, n0, kBN)) {
      // The row's last visible key (past seq_k or hidden beyond it), relative to this lane's
      // first column, clamped to the tile: one 32-bit compare per score.
      const int64_t rel = mask.last_key(row) - (n0 + 4 * half);
      const int last = int(max(int64_t(-1), min(rel, int64_t(kBN))));
#pragma unroll
      for (int j = 0; j < 32; ++j)
        if (8 * (j / 4) + j % 4 > last) x[j] = -INFINITY;
    }
    float mx[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) mx[j] = fmaxf(fmaxf(x[j], x[j + 8]), fmaxf(x[j + 16], x[j + 24]));
    float m = fmaxf(fmaxf(fmaxf(mx[0], mx[4]), fmaxf(mx[1], mx[5])),
                    fmaxf(fmaxf(mx[2], mx[6]), fmaxf(mx[3], mx[7])));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    const float m_new = fmaxf(m_run, __fmul_rn(m, p.scale_log2));
    // A row with nothing visible yet keeps m = -inf; subtracting 0 then keeps p = 0, not NaN.
    const float base = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = ex2(m_run - base);
    float part[4] = {0.f, 0.f, 0.f, 0.f};
    const auto exps = [&](auto exponent) {
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        x[j] = ex2(exponent(x[j]));
        part[j % 4] += x[j];
      }
    };
    if (fabsf(base) < 32768.f)
      exps([&](float v) { return fmaf(v, p.scale_log2, -base); });
    else
      exps([&](float v) { return __fmul_rn(v, p.scale_log2) - base; });
    l_run = l_run * alpha + ((part[0] + part[1]) + (part[2] + part[3]));
    m_run = m_new;

    __syncwarp();  // every lane has read its S values: P may now overwrite the strip
    {
      T* prow = sP + r * kPLd + 4 * half;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        *reinterpret_cast<uint2*>(prow + 8 * j) = make_uint2(
            P2::from_float2(x[4 * j], x[4 * j + 1]), P2::from_float2(x[4 * j + 2], x[4 * j + 3]));
    }
    if (half == 0) sAlpha[r] = alpha;
    __syncwarp();

#pragma unroll
    for (int e = 0; e < NE; ++e) {
      const float a = sAlpha[row_of[e]];
#pragma unroll
      for (int f = 0; f < KD; ++f) o[f].x[e] *= a;
    }

    // O += P·V. Unrolled by 2 so the next block's fragment loads overlap this block's mmas
    // (measured); fully unrolled, ptxas hoists every load and D = 128 runs out of registers.
    const T* vt = sV + buf * kBN * L::kLd;
#pragma unroll 2
    for (int kk = 0; kk < NB; ++kk) {
      wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major> pf;
      load_frag(pf, sP + kk * 16, kPLd);
#pragma unroll
      for (int f = 0; f < KD; ++f) {
        wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::row_major> vf;
        load_frag(vf, vt + kk * 16 * L::kLd + f * 16, L::kLd);
        wm::mma_sync(o[f], pf, vf, o[f]);
      }
    }

    // Non-finite V check, step 3 (rare): every O element adds what its row's visible keys of the
    // tile held before they were zeroed. Through this warp's strip (P is consumed), 64 columns at a
    // time, since the fragments' element -> column mapping is unspecified.
    if (Mask::kMasksKeys && nonfinite) {
#pragma unroll
      for (int c0 = 0; c0 < D; c0 += 64) {
        __syncwarp();  // every lane is past its P loads, or the previous block's loads
#pragma unroll
        for (int f = 0; f < 4; ++f)
          wm::store_matrix_sync(sS + f * 16, o[c0 / 16 + f], kSLd, wm::mem_row_major);
        __syncwarp();
#pragma unroll 1
        for (int i = lane; i < 16 * 64; i += 32) {
          const int rr = i / 64, cc = i % 64;
          // The row's last visible key, tile-relative: < 0 none, >= kBN - 1 all.
          const int64_t seen = mask.last_key(wrow0 + rr) - n0;
          const int last = int(max(int64_t(-1), min(seen, int64_t(kBN))));
          sS[rr * kSLd + cc] += nonfinite_term(nf, c0 + cc, last);
        }
        __syncwarp();
#pragma unroll
        for (int f = 0; f < 4; ++f)
          wm::load_matrix_sync(o[c0 / 16 + f], sS + f * 16, kSLd, wm::mem_row_major);
      }
    }
  }

  // Normalize by the full row sum; a row with no visible key has l = 0 and outputs zeros.
  const float l = l_run + __shfl_xor_sync(0xffffffffu, l_run, 1);
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
      if (orow < mask.seq_q) {
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

template <typename T, int D, class Mask>
void launch(const FwdArgs& a, cudaStream_t stream) {
  constexpr int kSmem = Layout<D>::kBytes;
  static std::atomic<uint64_t> configured{0};
  opt_in_smem(reinterpret_cast<const void*>(fwd_kernel<T, D, Mask>), kSmem, configured);

  const Params p = make_params(a);
  const dim3 grid(unsigned((a.dims.seq_q + kBM - 1) / kBM), unsigned(a.dims.heads),
                  unsigned(a.dims.batch));
  fwd_kernel<T, D, Mask><<<grid, kThreads, kSmem, stream>>>(p);
  SDPA_LAUNCH_CHECK("wmma fwd_kernel launch");
}

// load_kv forms key tile t's offset as t * 2 * kBN * stride with the first two products in
// `int`: for the last tile, t = ceil(seq_k / kBN) - 1, t * 2 * kBN must fit.
constexpr int64_t kMaxSeqK = (limits::kIntMax / (2 * kBN) + 1) * kBN;
static_assert(kMaxSeqK == int64_t(1) << 30, "can_implement's reason names 2^30");

// What this kernel takes beyond its instantiation: a grid of kBM-row query tiles with (batch,
// head) on grid z and y, key-tile offsets in `int`, an sm_80+ device with the shared memory of
// its Layout.
template <typename T, int D>
std::string can_implement(const FwdArgs& a, const DeviceInfo& dev) {
  std::string seq_k;
  if (a.dims.seq_k > kMaxSeqK)
    seq_k = "seq_k = " + std::to_string(a.dims.seq_k) +
            " exceeds 2^30: the wmma kernel computes key-tile offsets in 32-bit int";
  return limits::first({limits::dense_sequences(a, "wmma"), mask::plain_only(a, "wmma"),
                        limits::grid_of_query_tiles(a, kBM), seq_k, limits::sm80_or_newer(dev),
                        limits::smem_per_block(dev, Layout<D>::kBytes)});
}

template <typename T, int D>
void forward(const FwdArgs& a, const DeviceInfo&, cudaStream_t stream) {
  mask::dispatch_mask(a.mask.kind, a.dims.seq_q, a.dims.seq_k,
                      [&](auto m) { launch<T, D, decltype(m)>(a, stream); });
}

template <typename T, int D>
void attributes(std::vector<KernelAttr>& out, const DeviceInfo&) {
  // All of this kernel's shared memory is dynamic.
  push_attributes(
      out, "wmma", dtype_name<T>(), D,
      {reinterpret_cast<const void*>(fwd_kernel<T, D, mask::NoMask<int64_t>>),
       reinterpret_cast<const void*>(fwd_kernel<T, D, mask::CausalBottomRight<int64_t>>)},
      Layout<D>::kBytes);
}

}  // namespace sdpa::wmma_backend
