// Decode: a few query tokens (1 to 16 a sequence) against many cached keys, at the memory
// bandwidth the K/V reads allow. The prefill kernel (sm80_fwd.cuh) gives each CTA 64 query rows of
// one head, so a decode step would load each K/V head's bytes once per query head and leave most
// of the mma rows empty. Here:
//   - a CTA's rows are the (token, head) pairs of one K/V head's GQA group (row r: token r / group,
//     head hk · group + r % group), 16 or 32 of them, so each K/V byte is read once per group;
//   - the keys are split across CTAs (split-KV: `splits` ranges of `split_tiles` 64-key tiles,
//     chosen from the problem and the SM count so the grid fills the GPU) and, within a CTA,
//     across its 4 warps (warp w takes keys 16w .. 16w + 15 of each tile), each warp keeping its
//     own online-softmax state over all the CTA's rows;
//   - the warps' states meet in shared memory at the end; with one split the CTA writes the
//     output, with several it writes its normalized partial output and log-sum-exp (f32) and
//     the splits are merged: O = Σ_s e^{lse_s - m} O_s / Σ_s e^{lse_s - m} (merge_row). On
//     sm_90, where a row block has at most kClusterMax splits and the cluster fits, the row
//     block's splits are one cluster: each writes its partial into the first split's shared
//     memory (distributed shared memory) and, after the cluster's barrier, the first merges
//     them. Otherwise each writes it to the workspace and `combine_kernel`, launched
//     programmatically behind the grid, merges them. (The last split of a row block to finish
//     can merge them instead, found by a counter a row block, FwdArgs::tile_counter: one
//     launch, but no faster anywhere and slower at 16 splits; fold_counters.) A sink
//     (common/sinks.cuh) joins a row once: where the output is written (one split), or in the
//     merge as one more partial of output 0 (several), never in a split's partial.
// Nothing is allocated or synchronized per call: the workspace is the caller's (workspace_bytes),
// so a decode step can be captured in a CUDA graph.
//
// K/V tiles stream through 3 cp.async stages with the prefill kernel's geometry and swizzle
// (Cfg<T, D, 4, 1>: 64 keys, [key][d] rows); Q through a buffer of its own, its fragments re-read
// per k-block (the kernel is bound by memory, not by ldmatrix). Sequences of different lengths,
// a paged cache and seqused_k work as in the prefill kernel (common/seqs.cuh).
//
// Masks: none and causal bottom-right (a token sees the keys up to its own position); neither
// hides a key below the lower edge, so a row's visible keys of a tile are a prefix. The
// non-finite V check: a tile that hides keys from some row (causal with several tokens) is
// scanned; if it holds a NaN or an infinity, its columns' first non-finite keys are recorded and
// zeroed, each (row, column) ORs the kinds its visible keys hold into a flag byte, and the
// combined output adds the reference's term for them (common/nonfinite.cuh).
//
// An e4m3 K/V cache (F8) under 16-bit Q: its codes stream through kStagesF8 stages of their own
// (half the bytes), and each thread widens the chunks it copied into one 16-bit tile pair that
// the mma reads, in the same swizzled layout, so everything after (the non-finite check, the mma,
// the masks) is the 16-bit path's. Widening is exact (every e4m3 value is an f16 and a bf16
// value): the scales stay out of the tiles. A CTA reads one K/V head, so its K scale joins the
// softmax scale and its V scale the output's normalization, once per row. One 16-bit tile pair
// (a barrier before each widening) instead of one a stage keeps the CTA under half an SM's shared
// memory, so two CTAs of 4 warps share an SM and hide each other's widening and mma latency, and
// the splits fill two CTAs an SM.
#pragma once

#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <cstdlib>
#include <type_traits>

#include "common/cluster.cuh"
#include "cutlass/sm80/sm80_fwd.cuh"
#include "sdpa/counters.h"

namespace sdpa::cutlass_sm80::decode {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kStages = 3;
// An e4m3 cache's code stages (16 KB each at D = 128, so four stay within two CTAs an SM).
constexpr int kStagesF8 = 4;
// Query tokens a decode step may have (speculative decoding's drafts included).
constexpr int64_t kMaxTokens = 16;
// Splits a cluster may hold: the portable cluster size (larger, non-portable clusters cost
// more to launch and meet than the L2 round trip they save; docs/perf.md, step 16).
constexpr int kClusterMax = 8;

// Where a launch's splits are merged: by a second launch (combine_kernel; one split needs
// none), by the last split of each row block to finish (counters), or by the first split of
// each row block's cluster.
enum class Merge { kCombine, kLastSplit, kCluster };

// Geometry at head dim D with MT m16 strips of rows (16 · MT rows a CTA).
template <typename T, int D, int MT>
struct Geo {
  using C = Cfg<T, D, 4, 1>;  // the prefill tiles: 64 keys, swizzled [key][d] rows
  static constexpr int kBN = C::kBN;
  static constexpr int kRows = 16 * MT;
  static_assert(kBN == 16 * kWarps, "a warp takes 16 keys of a tile");
  static constexpr int kStageElems = C::kStageElems;
  static constexpr int kQOffset = kStages * kStageElems;  // elements
  static constexpr int kQElems = kRows * D;
  // After the stages and Q: the tile's non-finite records, then each (row, column)'s flags.
  static constexpr int kRecOffset = (kQOffset + kQElems) * int(sizeof(T));  // bytes
  static constexpr int kFlagOffset = kRecOffset + int(sizeof(NonFiniteCols<D>));
  static constexpr int kSmemBytes = kFlagOffset + kRows * D;
  // Merge::kCluster: the row block's partials [split][row][D], then their log-sum-exps
  // [split][row] (Params::merge_rows rows a split), in the first split's CTA at
  // Params::merge_offset: in the stages its own tiles never fill, past the end state, where
  // they fit there (merge_region), else past everything (kMergeOffset).
  static constexpr int kMergeOffset = (kSmemBytes + 15) / 16 * 16;
  // An e4m3 cache: one 16-bit tile pair (K, V), the code stages ([key][D] bytes, K then V),
  // then Q, the records and the flags; the end state lies over the tiles and the code stages.
  static constexpr int kCodeTileBytes = kBN * D;
  static constexpr int kCodeStageBytes = 2 * kCodeTileBytes;
  static constexpr int kCodeOffset = kStageElems * int(sizeof(T));  // bytes
  static constexpr int kQByteF8 = kCodeOffset + kStagesF8 * kCodeStageBytes;
  static constexpr int kRecOffsetF8 = kQByteF8 + kQElems * int(sizeof(T));
  static constexpr int kFlagOffsetF8 = kRecOffsetF8 + int(sizeof(NonFiniteCols<D>));
  static constexpr int kSmemBytesF8 = kFlagOffsetF8 + kRows * D;
  // The warps' states at the end, over the stages: m, l [warp][row], O [warp][row][kOPitch],
  // then each row's destination (an element offset). A row's pitch of 8 banks past a multiple
  // of 32 lets a warp's 8-byte writes (a quad's column pairs of 8 rows) and reads (a row's
  // consecutive pairs) meet no bank twice in a wavefront.
  static constexpr int kOPitch = D + 8;
  static_assert(kOPitch % 32 == 8, "a row's pitch is 8 banks past a multiple of 32");
  static constexpr int kEndStateBytes =
      (2 * kWarps * kRows + kWarps * kRows * kOPitch) * 4 + kRows * int(sizeof(int64_t));
  static_assert(kEndStateBytes <= kQByteF8, "the end state fits the tiles and code stages");
  static_assert(kEndStateBytes <= kQOffset * int(sizeof(T)), "the end state fits the stages");
  // At the head dims with a decode kernel (kHasDecode).
  static_assert(D > 128 || (kSmemBytes <= 112 * 1024 && kSmemBytesF8 <= 112 * 1024),
                "two CTAs an SM on Hopper (plan)");
  // The kernel's ldmatrix addresses (decode_kernel) need every tile row and Q row to start on a
  // multiple of D · 2 bytes from the 1024-byte aligned base.
  static constexpr bool kAligned = D * 2 <= 1024 && kStageElems * 2 % (D * 2) == 0 &&
                                   C::kTileElems * 2 % (D * 2) == 0 &&
                                   kQOffset * 2 % (D * 2) == 0 && kQByteF8 % (D * 2) == 0;
  static_assert(kAligned, "rows start on multiples of D · 2 bytes");
};

template <typename T, class Mask>
struct Params {
  const T *q, *k, *v;
  // An e4m3 cache instead of k, v: codes, and scales at b * scale_batch + hk * scale_head.
  const uint8_t *kc, *vc;
  const float *k_scale, *v_scale;
  int scale_batch, scale_head;
  T* o;
  Strides qs, ks, vs, os;
  Mask mask;  // for the longest sequences; rebased to each
  int group, heads, row_blocks;
  float scale_log2;
  float* lse;          // final log-sum-exp (null: none)
  const float* sinks;  // [heads] sink logits (null: none)
  SeqParams seqs;
  int splits, split_tiles;
  int64_t lse_rows;      // rows of the LSE layout: the workspace's per-split stride
  float *ws_o, *ws_lse;  // splits > 1: [split][lse row][D], [split][lse row]
  // Merge::kLastSplit: a counter a row block (batch, kv head, row block), zero between calls;
  // the last split to count merges the block's rows.
  int32_t* counters;
  // Merge::kCluster: the rows of a row block's partials in the merge region, and its byte
  // offset in dynamic shared memory (Geo's kMergeOffset comment).
  int merge_rows, merge_offset;
};

// Two e4m3 codes (low byte first) as two T values, exactly.
template <typename T>
__device__ __forceinline__ uint32_t widen2(uint16_t codes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(codes, __NV_E4M3);
  if constexpr (std::is_same_v<T, cute::half_t>) {
    return uint32_t(h.x) | (uint32_t(h.y) << 16);
  } else {
    const float2 f = __half22float2(__half2(h));
    return pack2<T>(f.x, f.y);
  }
}

// The K/V tiles of an e4m3 cache: thread tid copies 16-byte chunks of codes (chunk tid %
// kRowThreads of rows tid / kRowThreads + kPassRows · i) into a code stage, zero past seq_k, and
// later widens the same chunks into the 16-bit stage at C::off (visible to it alone until a
// barrier: each thread widens only what its own cp.async brought).
template <class C, typename T>
struct CodeCopy {
  static constexpr int D = C::kChunks * 8, BN = C::kBN;
  static constexpr int kRowThreads = D / 16;
  static constexpr int kPassRows = kThreads / kRowThreads;
  static constexpr int kTileBytes = BN * D;
  static_assert(BN % kPassRows == 0, "tiles of whole passes");
  int crow, cchunk;
  const uint8_t *kg, *vg;  // this thread's first row's chunk (a paged cache: row 0's)
  bool paged;

  __device__ __forceinline__ CodeCopy(const uint8_t* k, const uint8_t* v, const Strides& ks,
                                      const Strides& vs, int b, int hk, int k0, bool paged_,
                                      int tid)
      : crow(tid / kRowThreads), cchunk(tid % kRowThreads), paged(paged_) {
    const int64_t first_row = paged ? 0 : int64_t(k0) + crow;
    kg = k + (int64_t(b) * ks.batch + int64_t(hk) * ks.head + first_row * ks.seq + cchunk * 16);
    vg = v + (int64_t(b) * vs.batch + int64_t(hk) * vs.head + first_row * vs.seq + cchunk * 16);
  }

  __device__ __forceinline__ void load(uint8_t* stage, int n, int seq_k, const Strides& ks,
                                       const Strides& vs, const SeqParams& seqs, int b) const {
    constexpr int P = kPassRows;
    const int rows = seq_k - n * BN - crow;
    uint8_t* const sk = stage + crow * D + cchunk * 16;
    const auto pass = [&](int i, const uint8_t* k, const uint8_t* v) {
      const bool in = i * P < rows;
      cp_async16(sk + i * P * D, k, in);
      cp_async16(sk + kTileBytes + i * P * D, v, in);
    };
    tile_passes<BN, P>(paged, kg, vg, ks, vs, seqs, b, n, crow, rows, pass);
  }

  // The codes this thread copied into `stage`, as T into the 16-bit tiles `tile` (K, then V);
  // whether its V codes hold a NaN (e4m3 has no infinities), for the non-finite V check.
  __device__ __forceinline__ bool widen(const uint8_t* stage, T* tile) const {
    uint32_t nan = 0;
#pragma unroll
    for (int i = 0; i < BN / kPassRows; ++i) {
      const int row = i * kPassRows + crow;
#pragma unroll
      for (int kv = 0; kv < 2; ++kv) {
        const uint4 c = lds16(stage + kv * kTileBytes + row * D + cchunk * 16);
        const uint32_t w[4] = {c.x, c.y, c.z, c.w};
        if (kv == 1)
#pragma unroll
          for (int j = 0; j < 4; ++j) nan |= __vcmpeq4(w[j] & 0x7f7f7f7fu, 0x7f7f7f7fu);
        uint4 lo, hi;
        lo.x = widen2<T>(uint16_t(w[0])), lo.y = widen2<T>(uint16_t(w[0] >> 16));
        lo.z = widen2<T>(uint16_t(w[1])), lo.w = widen2<T>(uint16_t(w[1] >> 16));
        hi.x = widen2<T>(uint16_t(w[2])), hi.y = widen2<T>(uint16_t(w[2] >> 16));
        hi.z = widen2<T>(uint16_t(w[3])), hi.w = widen2<T>(uint16_t(w[3] >> 16));
        T* const t = tile + kv * C::kTileElems;
        *reinterpret_cast<uint4*>(t + C::off(row, cchunk * 16)) = lo;
        *reinterpret_cast<uint4*>(t + C::off(row, cchunk * 16 + 8)) = hi;
      }
    }
    return nan != 0;
  }
};

// The element offset of row (token `tok`, head `head`) of sequence b in the output.
template <typename T, class Mask>
__device__ __forceinline__ int64_t out_row(const Params<T, Mask>& p, const Seq<int>& seq, int b,
                                           int head, int tok) {
  return int64_t(b) * p.os.batch + int64_t(head) * p.os.head + int64_t(seq.q0 + tok) * p.os.seq;
}

// A merge of splits' partials whose weights e^{lse_s - m} sum to `sum` (m in natural-log units):
// the row's sink (sinks[head], none where null) joins once, as a partial of log-sum-exp sink and
// output 0, moving m and sum; returns the factor of the weighted partials' sum (0 where nothing
// is visible).
__device__ __forceinline__ float merged_factor(const float* sinks, int head, float& m, float& sum) {
  float a = 1.f;
  if (sinks != nullptr) {
    float m2 = m * kLog2e;
    a = fold_sink(m2, sum, sinks[head]);
    m = m2 * 0.6931471805599453f;
  }
  return sum > 0.f ? a / sum : 0.f;
}

// Splits a merge loads at once (see combine_row): up to 16, at most 32 column pairs of
// partials a lane in registers (MLA's 512 columns: 4).
template <int D>
constexpr int kFewSplits = std::min(16, 32 / (D / 64));

// Merges the splits' partial outputs of row (token `tok`, head `head`) of sequence b, whose
// LSE index is `lrow`, into its output and log-sum-exp: one warp, whose lanes read the splits'
// log-sum-exps side by side (a split per lane: lse_of(s), -inf past the splits), then the
// partial outputs (a column pair per lane: part(s, i) is split s's columns 2 lane + 64 i and the
// next; a split without keys for this row, weight 0, holds zeros). Up to kFewSplits<D> splits
// (short contexts, where the merge's latency shows in a step's time) every load is issued at
// once: one round trip, not one for the log-sum-exps and then one for each few splits. Both
// forms add in the same order.
template <typename T, int D, class Mask, class LseOf, class Part>
__device__ __forceinline__ void merge_row(const Params<T, Mask>& p, const Seq<int>& seq, int b,
                                          int tok, int head, int64_t lrow, int lane,
                                          const LseOf& lse_of, const Part& part) {
  constexpr int kPer = D / 64;  // column pairs a lane
  const int n = p.splits;
  const auto warp_max = [](float v) {
#pragma unroll
    for (int x = 16; x > 0; x /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, x));
    return v;
  };
  float m = -INFINITY, sum = 0.f, acc[kPer][2] = {};
  constexpr int kFew = kFewSplits<D>;
  if (n <= kFew) {
    const float ls = lse_of(lane);
    float2 x[kFew][kPer];
#pragma unroll
    for (int j = 0; j < kFew; ++j)
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        if (j < n) x[j][i] = part(j, i);
    m = warp_max(ls);
    if (m != -INFINITY) {
      const float wl = ls == -INFINITY ? 0.f : __expf(ls - m);
      sum = wl;
#pragma unroll
      for (int j = 0; j < kFew; ++j) {
        if (j >= n) break;
        const float wgt = __shfl_sync(0xffffffffu, wl, j);
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          acc[i][0] += wgt * x[j][i].x;
          acc[i][1] += wgt * x[j][i].y;
        }
      }
    }
  } else {
    for (int s = lane; s < n; s += 32) m = fmaxf(m, lse_of(s));
    m = warp_max(m);
    for (int s0 = 0; m != -INFINITY && s0 < n; s0 += 32) {
      const float ls = lse_of(s0 + lane);
      const float wl = ls == -INFINITY ? 0.f : __expf(ls - m);
      sum += wl;
      const int chunk = min(32, n - s0);
#pragma unroll 8
      for (int j = 0; j < chunk; ++j) {
        const float wgt = __shfl_sync(0xffffffffu, wl, j);
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          const float2 x = part(s0 + j, i);
          acc[i][0] += wgt * x.x;
          acc[i][1] += wgt * x.y;
        }
      }
    }
  }
#pragma unroll
  for (int x = 16; x > 0; x /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, x);
  const float inv = merged_factor(p.sinks, head, m, sum);
  T* const out = p.o + out_row(p, seq, b, head, tok);
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    *reinterpret_cast<uint32_t*>(out + 2 * lane + 64 * i) =
        pack2<T>(acc[i][0] * inv, acc[i][1] * inv);
  if (lane == 0 && p.lse != nullptr) p.lse[lrow] = sum > 0.f ? m + __logf(sum) : -INFINITY;
}

// merge_row over the partials in the workspace. They come through L2 (ld.global.cg): other
// CTAs wrote them during this grid.
template <typename T, int D, class Mask>
__device__ __forceinline__ void combine_row(const Params<T, Mask>& p, const Seq<int>& seq, int b,
                                            int tok, int head, int lane) {
  const int64_t lrow = lse_index(p.seqs, seq, b, head, p.heads, p.mask.seq_q, tok);
  merge_row<T, D>(
      p, seq, b, tok, head, lrow, lane,
      [&](int s) {
        return s < p.splits ? __ldcg(p.ws_lse + int64_t(s) * p.lse_rows + lrow) : -INFINITY;
      },
      [&](int s, int i) {
        return __ldcg(reinterpret_cast<const float2*>(
            p.ws_o + (int64_t(s) * p.lse_rows + lrow) * D + 2 * lane + 64 * i));
      });
}

// Whether this CTA is the last of its row block's splits to have written its partials (then
// it merges them; every CTA of the block reaches here or none does). Each thread's writes are
// fenced before thread 0 counts, and the last reads the others' after its own fence (the CUDA
// programming guide's last-block pattern); it sets the counter back to zero.
__device__ __forceinline__ bool last_split(int32_t* counter, int splits) {
  __threadfence();
  __syncthreads();
  bool last = false;
  if (threadIdx.x == 0) {
    last = atomicAdd(counter, 1) == splits - 1;
    if (last) *counter = 0;  // every split has counted
  }
  if (!__syncthreads_or(last)) return false;
  __threadfence();
  return true;
}

// kMerge: where the launch's splits are merged. A kernel for each: with a merge in it, ptxas
// shapes the decode loop's registers differently, and steps with one split ran 1-4% slower.
// Merge::kCluster: the grid's clusters are the row blocks' splits (x), 16-bit caches only.
template <typename T, int D, int MT, class Mask, bool F8, Merge kMerge>
__global__ void __launch_bounds__(kThreads, 1)
    decode_kernel(const __grid_constant__ Params<T, Mask> p) {
#ifdef SDPA_SM80_DEVICE
  static_assert(kMerge != Merge::kCluster || !F8, "the merge region lies past the 16-bit layout");
  // A combine launched after this grid (sm_90) may launch and wait for its completion already.
  // Otherwise the grid after is the next step's, which must not: a one-wave grid's CTAs each
  // want an SM of their own, and the next grid's CTAs, resident early, take the second slot of
  // SMs still loading and crowd the next wave onto fewer SMs (measured:
  // docs/log/2026-11-notebook.md, "decode launched programmatically").
  if (p.splits > 1 && kMerge == Merge::kCombine) pdl_launch_dependents();
  // Launched programmatically on sm_90 (launch()): the grid before it on the stream may still
  // run; nothing global is read or written before it completes.
  pdl_wait();
  using G = Geo<T, D, MT>;
  using C = typename G::C;
  constexpr int BN = G::kBN, S = F8 ? kStagesF8 : kStages, R = G::kRows;
  constexpr int kQK = D / 16, kON = D / 8;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  T* const smem = reinterpret_cast<T*>(smem_raw);
  T* const sQ = F8 ? reinterpret_cast<T*>(smem_raw + G::kQByteF8) : smem + G::kQOffset;
  NonFiniteCols<D>& nf =
      *reinterpret_cast<NonFiniteCols<D>*>(smem_raw + (F8 ? G::kRecOffsetF8 : G::kRecOffset));
  // [row][col]: bits NaN, +Inf, -Inf seen
  uint8_t* const flags = smem_raw + (F8 ? G::kFlagOffsetF8 : G::kFlagOffset);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int split = blockIdx.x, hk = blockIdx.y / p.row_blocks, b = blockIdx.z;
  const int r0 = (blockIdx.y % p.row_blocks) * R;  // the CTA's first (token, head) row
  const Seq<int> seq = seq_of<int>(p.seqs, b, p.mask.seq_q, p.mask.seq_k);
  const int rows = seq.seq_q * p.group;
  if (r0 >= rows) return;  // no such tokens in this sequence (uniform in a cluster too)
  // The other CTAs of the cluster write into this one's shared memory once it has started.
  if constexpr (kMerge == Merge::kCluster) cluster_arrive_relaxed();
  const Mask mask = p.mask.rebased(seq.seq_q, seq.seq_k);
  const int seq_k = seq.seq_k;
  const int tok_lo = r0 / p.group, tok_hi = (min(r0 + R, rows) - 1) / p.group;
  // The key tiles of this split that some row of the CTA sees.
  const int n_lo = split * p.split_tiles;
  const int n_begin = max(n_lo, mask.key_begin(tok_lo, tok_hi - tok_lo + 1) / BN);
  const int n_end =
      min(n_lo + p.split_tiles, (mask.key_end(tok_lo, tok_hi - tok_lo + 1) + BN - 1) / BN);

  // Whether some tile of this CTA may hide keys from one of its rows (below seq_k): only then is
  // V checked for non-finite values and are the flags kept (a one-token step sees every key).
  const bool checks = Mask::kMasksKeys && mask.last_key(tok_lo) + 1 < seq_k;
  if (checks) {
    static_assert((F8 ? G::kFlagOffsetF8 : G::kFlagOffset) % 16 == 0 && R * D % 16 == 0,
                  "the flags are zeroed 16 bytes a store");
    for (int i = tid; i < R * D / 16; i += kThreads)
      reinterpret_cast<uint4*>(flags)[i] = make_uint4(0u, 0u, 0u, 0u);
  }
  float o[MT][kON][4], m_run[MT][2], l_run[MT][2];
  start_rows(o, m_run, l_run);
  // An e4m3 cache: scores in code units, K's scale joined to the softmax scale (a negative or
  // non-finite one has no softmax: its rows are NaN), V's scale to the output's.
  float sl2 = p.scale_log2, v_mul = 1.f;
  if constexpr (F8) {
    const int64_t si = int64_t(b) * p.scale_batch + int64_t(hk) * p.scale_head;
    const float ks = p.k_scale[si];
    sl2 = ks >= 0.f && ks <= FLT_MAX ? sl2 * ks : __int_as_float(0x7fffffff);
    v_mul = p.v_scale[si];
  }
  uint8_t* const codes = smem_raw + G::kCodeOffset;  // F8 only

  if (n_begin < n_end) {
    const auto kv = [&] {
      if constexpr (F8)
        return CodeCopy<C, T>(p.kc, p.vc, p.ks, p.vs, b, hk, seq.k0, p.seqs.paged(), tid);
      else
        return KvCopy<C, T>(p.k, p.v, p.ks, p.vs, b, hk, seq.k0, p.seqs.paged(), tid);
    }();
    // This thread's chunk of the 16-bit V tile (the non-finite check's), as KvCopy places it.
    const int c_soff = C::off(tid / C::kRowThreads, (tid % C::kRowThreads) * 8);
    const auto load_kv = [&](int n, int s) {
      if constexpr (F8)
        kv.load(codes + s * G::kCodeStageBytes, n, seq_k, p.ks, p.vs, p.seqs, b);
      else
        kv.load(smem + s * G::kStageElems, n, seq_k, p.ks, p.vs, p.seqs, b);
    };
    // Q rows (token, head) of the CTA, zero past the sequence's tokens; with the first tile.
    static_assert(R * (D / 8) % kThreads == 0, "Q's chunks are whole passes of the CTA");
#pragma unroll
    for (int i = 0; i < R * (D / 8) / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int row = c / (D / 8), chunk = c % (D / 8), r = r0 + row;
      const int tok = r / p.group, head = hk * p.group + r % p.group;
      const T* src = p.q + int64_t(b) * p.qs.batch + int64_t(head) * p.qs.head +
                     int64_t(seq.q0 + (r < rows ? tok : 0)) * p.qs.seq + chunk * 8;
      cp_async16(sQ + C::off(row, chunk * 8), src, r < rows);
    }
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
      if (n_begin + i < n_end) load_kv(n_begin + i, i);
      cute::cp_async_fence();
    }

    // This lane's ldmatrix addresses, in bytes, at k-block 0: row r's chunk c is stored at chunk
    // c ^ phase(r), so chunk 2k + c, k-block k's, lies at (c ^ phase) ^ 2k, and its address is
    // k-block 0's XOR 32k: one instruction a load, where each row starts on a multiple of its
    // D · 2 bytes (G::kAligned).
    const int swz = C::phase(lane);
    const auto lane_off = [swz](int row, int c) {
      return uint32_t(row * D + ((c ^ swz) << 3)) * 2;
    };
    const auto kblock = [](uint32_t addr, int k) { return addr ^ uint32_t(k << 5); };
    const uint32_t smem_addr = uint32_t(__cvta_generic_to_shared(smem_raw));
    const uint32_t q_addr = uint32_t(__cvta_generic_to_shared(sQ)) + lane_off(lane & 15, lane >> 4);
    const uint32_t k_off = lane_off((lane & 7) + ((lane >> 4) << 3) + 16 * warp, (lane >> 3) & 1);
    const uint32_t v_off = C::kTileElems * 2 + lane_off((lane & 15) + 16 * warp, lane >> 4);

    for (int n = n_begin; n < n_end; ++n) {
      const int s = (n - n_begin) % S;
      const int n0 = n * BN;
      // The 16-bit tiles of this key tile (an e4m3 cache's one pair, widened into).
      T* const stage = smem + (F8 ? 0 : s) * G::kStageElems;
      cute::cp_async_wait<S - 2>();
      bool own_nan = false;  // F8: whether the V codes this thread widened hold a NaN
      if constexpr (F8) {
        // Every warp is done with the previous tile; these codes arrived for this thread alone
        // (and their stage is refilled by this thread alone, after it widened them).
        __syncthreads();
        own_nan = kv.widen(codes + s * G::kCodeStageBytes, stage);
      }
      // A tile that hides keys from some row (past seq_k aside) is checked for non-finite V.
      const bool partial = checks && n0 + BN - 1 > mask.last_key(tok_lo);
      bool nonfinite = false;
      if (partial) {
        // The widened tile is not visible before this barrier: an e4m3 cache ORs what each
        // thread saw while widening.
        bool own;
        if constexpr (F8)
          own = own_nan;
        else
          own = own_v_chunks_nonfinite<T, D, 4, 1>(stage + C::kTileElems + c_soff);
        nonfinite = __syncthreads_or(own) != 0;
      } else {
        __syncthreads();
      }
      if (n + S - 1 < n_end) load_kv(n + S - 1, (n - n_begin + S - 1) % S);
      cute::cp_async_fence();
      const uint32_t stage_addr = smem_addr + (F8 ? 0 : s) * G::kStageElems * 2;
      if (nonfinite) {  // rare; CTA-uniform
        record_and_zero<T, D, 4, 1, false>(stage + C::kTileElems, nf, nf, tid);
        __syncthreads();
        for (int i = tid; i < R * D; i += kThreads) {
          const int row = i / D, col = i % D, r = r0 + row;
          if (r >= rows) continue;
          const int last = min(mask.last_key(r / p.group) - n0, int(kNoKey) - 1);
          flags[i] |= (int(nf.first[0][col]) <= last ? 1 : 0) |
                      (int(nf.first[1][col]) <= last ? 2 : 0) |
                      (int(nf.first[2][col]) <= last ? 4 : 0);
        }
      }

      // S = Q·Kᵀ over this warp's 16 keys.
      float sacc[MT][2][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 2; ++j)
          sacc[mt][j][0] = sacc[mt][j][1] = sacc[mt][j][2] = sacc[mt][j][3] = 0.f;
#pragma unroll
      for (int kb = 0; kb < kQK; ++kb) {
        uint32_t kf[4];
        ldsm(kf, kblock(stage_addr + k_off, kb));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          uint32_t qf[4];
          ldsm(qf, kblock(q_addr, kb) + 16 * mt * D * 2);
          mma<T>(sacc[mt][0], qf, kf[0], kf[1]);
          mma<T>(sacc[mt][1], qf, kf[2], kf[3]);
        }
      }

      // Mask (keys past seq_k or past a token's last), online softmax, P in T.
      const int key0 = n0 + 16 * warp + 2 * t;  // this thread's first key column
      const bool edge = n0 + BN > seq_k || partial;
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (edge) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = r0 + 16 * mt + g + 8 * r;
            const int last = mask.last_key(min(row, rows - 1) / p.group) - key0;
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
              for (int e = 0; e < 2; ++e)
                if (8 * j + e > last) sacc[mt][j][2 * r + e] = -INFINITY;
          }
        }
        softmax_step<2, kON>(sacc[mt], m_run[mt], l_run[mt], o[mt], sl2);
        pa[mt][0] = pack2<T>(sacc[mt][0][0], sacc[mt][0][1]);
        pa[mt][1] = pack2<T>(sacc[mt][0][2], sacc[mt][0][3]);
        pa[mt][2] = pack2<T>(sacc[mt][1][0], sacc[mt][1][1]);
        pa[mt][3] = pack2<T>(sacc[mt][1][2], sacc[mt][1][3]);
      }

      // O += P·V over the same 16 keys.
#pragma unroll
      for (int dp = 0; dp < kON / 2; ++dp) {
        uint32_t vf[4];
        ldsm_t(vf, kblock(stage_addr + v_off, dp));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<T>(o[mt][2 * dp], pa[mt], vf[0], vf[1]);
          mma<T>(o[mt][2 * dp + 1], pa[mt], vf[2], vf[3]);
        }
      }
    }
    cute::cp_async_wait<0>();
  }
  __syncthreads();  // every warp is done with the stages: they hold the end state now

  // The warps' states: m (raw units), l (quad-summed) and O by (warp, row).
  float* const sm_m = reinterpret_cast<float*>(smem_raw);
  float* const sm_l = sm_m + kWarps * R;
  float* const sm_o = sm_l + kWarps * R;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // Eight rows at a time, warp-uniformly; those past the sequence's rows are never merged.
      if (r0 + 16 * mt + 8 * r >= rows) continue;
      const int row = 16 * mt + g + 8 * r;
      float l = l_run[mt][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if (t == 0) {
        sm_m[warp * R + row] = m_run[mt][r];
        sm_l[warp * R + row] = l;
      }
      float* const orow = sm_o + (warp * R + row) * G::kOPitch;
#pragma unroll
      for (int j = 0; j < kON; ++j)
        *reinterpret_cast<float2*>(orow + 8 * j + 2 * t) =
            make_float2(o[mt][j][2 * r], o[mt][j][2 * r + 1]);
    }
  __syncthreads();

  // Merge::kCluster: the partials go to the first split's merge region (this CTA's own when it
  // is the first), once every CTA of the cluster has started.
  uint32_t merge_o = 0, merge_lse = 0;
  if constexpr (kMerge == Merge::kCluster) {
    merge_o = map_rank(uint32_t(__cvta_generic_to_shared(smem_raw + p.merge_offset)), 0);
    merge_lse = merge_o + uint32_t(p.splits * p.merge_rows * D) * 4u;
    cluster_wait();
  }
  // The warps' states combined in two steps, neither a chain a row: a thread a row makes the
  // row's weights (warp w's e^{m_w - m}, over the row's sum) in place of the m's, its
  // log-sum-exp and its destination; then each thread adds the warps' O for one column pair of
  // every kGroups-th row.
  int64_t* const sm_dst = reinterpret_cast<int64_t*>(sm_o + kWarps * R * G::kOPitch);
  if (tid < R && r0 + tid < rows) {
    const int row = tid, r = r0 + row;
    const int tok = r / p.group, head = hk * p.group + r % p.group;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, sm_m[w * R + row]);
    float f[kWarps], l = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = sm_m[w * R + row];
      f[w] = mw == -INFINITY ? 0.f : exp2f((mw - m) * sl2);
      l += f[w] * sm_l[w * R + row];
    }
    float m2 = m * sl2;
    const float a = p.splits == 1 && p.sinks != nullptr ? fold_sink(m2, l, p.sinks[head]) : 1.f;
    const float inv = l > 0.f ? a * v_mul / l : 0.f;
    const float lse = l > 0.f ? (m2 + __log2f(l)) * 0.6931471805599453f : -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sm_m[w * R + row] = f[w] * inv;
    const int64_t lrow = lse_index(p.seqs, seq, b, head, p.heads, p.mask.seq_q, tok);
    if (p.splits == 1) {
      sm_dst[row] = out_row(p, seq, b, head, tok);
      if (p.lse != nullptr) p.lse[lrow] = lse;
    } else if constexpr (kMerge == Merge::kCluster) {
      sm_dst[row] = int64_t(split * p.merge_rows + row) * D;
      st_cluster(merge_lse + uint32_t(split * p.merge_rows + row) * 4u, lse);
    } else {
      sm_dst[row] = (int64_t(split) * p.lse_rows + lrow) * D;
      p.ws_lse[int64_t(split) * p.lse_rows + lrow] = lse;
    }
  }
  __syncthreads();
  constexpr int kPairs = D / 2, kGroups = kThreads / kPairs;
  static_assert(kThreads % kPairs == 0 && R % kGroups == 0, "whole column pairs and rows");
  const int col = 2 * (tid % kPairs), group0 = tid / kPairs;
  // Every row's sum first, then the stores: the cluster's stores are ordered (asm with a memory
  // clobber), and no shared-memory load may wait behind one.
  float2 x[R / kGroups];
#pragma unroll
  for (int i = 0; i < R / kGroups; ++i) {
    const int row = group0 + kGroups * i;
    float acc[2] = {0.f, 0.f};
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wgt = sm_m[w * R + row];
      const float2 ow = *reinterpret_cast<const float2*>(sm_o + (w * R + row) * G::kOPitch + col);
      acc[0] += wgt * ow.x;
      acc[1] += wgt * ow.y;
    }
    if (checks) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int fl = flags[row * D + col + e];
        if (fl) acc[e] += nonfinite_value(fl & 1, fl & 2, fl & 4);
      }
    }
    x[i] = make_float2(acc[0], acc[1]);
  }
#pragma unroll
  for (int i = 0; i < R / kGroups; ++i) {
    const int row = group0 + kGroups * i;
    if (r0 + row >= rows) break;  // rows only grow
    const int64_t dst = sm_dst[row] + col;
    if (p.splits == 1)
      *reinterpret_cast<uint32_t*>(p.o + dst) = pack2<T>(x[i].x, x[i].y);
    else if constexpr (kMerge == Merge::kCluster)
      st_cluster2(merge_o + uint32_t(dst) * 4u, x[i].x, x[i].y);
    else
      *reinterpret_cast<float2*>(p.ws_o + dst) = x[i];
  }
  if constexpr (kMerge == Merge::kCluster) {
    cluster_arrive();  // this CTA's partials written (release) ...
    cluster_wait();    // ... and every other's visible (acquire)
    if (split != 0) return;
    // The first split merges the block's rows from its merge region, in the same two steps: a
    // thread a row makes each split's weight (e^{lse_s - m} over the sum, a sink folded in),
    // the row's log-sum-exp and its output row (in the end state's place, which is spent).
    const float* const o_part = reinterpret_cast<const float*>(smem_raw + p.merge_offset);
    const float* const lse_part = o_part + p.splits * p.merge_rows * D;
    float* const sm_w = sm_m;  // [row][kClusterMax]
    if (tid < R && r0 + tid < rows) {
      const int row = tid, r = r0 + row;
      const int tok = r / p.group, head = hk * p.group + r % p.group;
      float ls[kClusterMax], m = -INFINITY;
#pragma unroll
      for (int s = 0; s < kClusterMax; ++s) {
        ls[s] = s < p.splits ? lse_part[s * p.merge_rows + row] : -INFINITY;
        m = fmaxf(m, ls[s]);
      }
      float wl[kClusterMax], sum = 0.f;
#pragma unroll
      for (int s = 0; s < kClusterMax; ++s) {
        wl[s] = ls[s] == -INFINITY ? 0.f : __expf(ls[s] - m);
        sum += wl[s];
      }
      const float inv = merged_factor(p.sinks, head, m, sum);
#pragma unroll
      for (int s = 0; s < kClusterMax; ++s) sm_w[row * kClusterMax + s] = wl[s] * inv;
      sm_dst[row] = out_row(p, seq, b, head, tok);
      if (p.lse != nullptr)
        p.lse[lse_index(p.seqs, seq, b, head, p.heads, p.mask.seq_q, tok)] =
            sum > 0.f ? m + __logf(sum) : -INFINITY;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < R / kGroups; ++i) {
      const int row = group0 + kGroups * i;
      if (r0 + row >= rows) break;
      float acc[2] = {0.f, 0.f};
#pragma unroll
      for (int s = 0; s < kClusterMax; ++s) {
        if (s >= p.splits) break;
        const float wgt = sm_w[row * kClusterMax + s];
        const float2 o =
            *reinterpret_cast<const float2*>(o_part + (s * p.merge_rows + row) * D + col);
        acc[0] += wgt * o.x;
        acc[1] += wgt * o.y;
      }
      *reinterpret_cast<uint32_t*>(p.o + sm_dst[row] + col) = pack2<T>(acc[0], acc[1]);
    }
  } else if constexpr (kMerge == Merge::kLastSplit) {
    if (!last_split(p.counters + (blockIdx.z * gridDim.y + blockIdx.y), p.splits)) return;
    // The last split of the row block: the block's rows merged, one warp a row.
    for (int row = warp; row < R; row += kWarps) {
      const int r = r0 + row;
      if (r >= rows) break;
      combine_row<T, D>(p, seq, b, r / p.group, hk * p.group + r % p.group, lane);
    }
  }
#endif
}

// Merges the splits' partial outputs where no counters let the last split do it: one warp per
// (token, head), 4 a CTA; grid (tokens / 4, heads, batch).
template <typename T, int D, class Mask>
__global__ void __launch_bounds__(128) combine_kernel(const __grid_constant__ Params<T, Mask> p) {
#ifdef SDPA_SM80_DEVICE
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tok = blockIdx.x * 4 + warp, head = blockIdx.y, b = blockIdx.z;
  pdl_launch_dependents();  // the next decode step's grid may launch and wait for this one
  pdl_wait();               // launched programmatically on sm_90: the splits' partials are complete
  const Seq<int> seq = seq_of<int>(p.seqs, b, p.mask.seq_q, p.mask.seq_k);
  if (tok >= seq.seq_q) return;
  combine_row<T, D>(p, seq, b, tok, head, lane);
#endif
}

// Host side ----------------------------------------------------------------------------------

// Head dims with a decode kernel: 64 and 128 (at 256 three stages and the end state of 32 rows
// outgrow shared memory; the prefill kernel runs it).
template <int D>
constexpr bool kHasDecode = D == 64 || D == 128;

// Whether `a` is a decode step this path takes, at a head dim with a decode kernel
// (kHasDecode, which the instances ask first): 16-bit inputs and output, at most kMaxTokens
// query tokens against at least 4 key tiles, no mask but causal bottom-right, no softcap or
// ALiBi.
inline bool applies(const FwdArgs& a) {
  if (a.ops.dtype == Dtype::E4M3 || a.out.dtype != a.ops.dtype) return false;
  if (a.mask.kind != Mask::NoMask && a.mask.kind != Mask::CausalBottomRight) return false;
  if (a.mods.softcap > 0.f || a.mods.alibi) return false;
  return a.dims.seq_q <= kMaxTokens && a.dims.seq_k >= 256 &&
         a.dims.heads / a.dims.kv_heads <= 64 &&
         a.dims.kv_heads * ((a.dims.seq_q * (a.dims.heads / a.dims.kv_heads) + 15) / 16) <= 65535 &&
         a.dims.batch <= 65535;
}

// The launch's shape: rows a CTA (16 or 32), row blocks, splits and their tiles.
struct Plan {
  int mt, row_blocks, splits, split_tiles;
  int64_t lse_rows;
};

template <int D>
inline int smem_bytes(int mt, bool f8) {
  // Geometry in bytes does not depend on the 16-bit type.
  using G1 = Geo<cute::half_t, D, 1>;
  using G2 = Geo<cute::half_t, D, 2>;
  if (f8) return mt == 1 ? G1::kSmemBytesF8 : G2::kSmemBytesF8;
  return mt == 1 ? G1::kSmemBytes : G2::kSmemBytes;
}

// Whether the K/V of `a` are an e4m3 cache under 16-bit Q.
inline bool fp8_kv(const FwdArgs& a) {
  return a.ops.kv_dtype == Dtype::E4M3 && a.ops.dtype != Dtype::E4M3;
}

// Why an e4m3 K/V cache problem is not a decode step this path takes (applies() false, or a
// head dim without a decode kernel): the only path of this backend that reads one.
inline std::string fp8_kv_refusal(const FwdArgs& a) {
  return "an e4m3 K/V cache is read by the decode kernel only: head_dim 64 or 128, at most " +
         std::to_string(kMaxTokens) +
         " query tokens a sequence against at least 256 keys, no mask or causal bottom-right, no "
         "softcap or ALiBi (this problem: head_dim " +
         std::to_string(a.dims.head_dim) + ", seq_q " + std::to_string(a.dims.seq_q) + ", seq_k " +
         std::to_string(a.dims.seq_k) + ")";
}

// The split count SDPA_DECODE_SPLITS=n in the environment forces (read once, for measuring; 0:
// none).
inline int64_t forced_splits() {
  static const int64_t forced = [] {
    const char* e = std::getenv("SDPA_DECODE_SPLITS");
    return e != nullptr ? std::atoll(e) : 0;
  }();
  return forced;
}

// Whether a decode step of `a` on `dev` may merge its splits in clusters (Merge::kCluster): a
// 16-bit cache on sm_90; SDPA_DECODE_CLUSTER=0 in the environment (read once, for measuring)
// says no.
inline bool may_merge_in_cluster(const FwdArgs& a, const DeviceInfo& dev) {
  static const bool on = [] {
    const char* e = std::getenv("SDPA_DECODE_CLUSTER");
    return !(e != nullptr && e[0] == '0');
  }();
  return on && dev.cc_major >= 9 && !fp8_kv(a);
}

// The split of `tiles` key tiles among CTAs where `base` CTAs of work meet `slots` CTA slots:
// enough splits to fill the slots, down to one tile each (forced_splits() sets the count
// instead); their count and tiles each. Short contexts want the most splits: the merge is short
// next to a tile's load latency (measured: docs/log/2026-11-notebook.md, "decode launched
// programmatically").
inline void split_keys(int64_t tiles, int64_t base, int64_t slots, int& splits, int& split_tiles) {
  int64_t n = base >= slots ? 1 : slots / base;
  n = std::max<int64_t>(1, std::min<int64_t>(n, tiles));
  if (forced_splits() > 0) n = std::min<int64_t>(forced_splits(), tiles);
  split_tiles = int((tiles + n - 1) / n);
  splits = int((tiles + split_tiles - 1) / split_tiles);
}

inline Plan plan(const FwdArgs& a, const DeviceInfo& dev) {
  Plan pl{};
  const int64_t group = a.dims.heads / a.dims.kv_heads, rows = a.dims.seq_q * group;
  pl.mt = rows <= 16 ? 1 : 2;
  pl.row_blocks = int((rows + 16 * pl.mt - 1) / (16 * pl.mt));
  pl.lse_rows = a.seqs.total_q > 0 ? a.dims.heads * a.seqs.total_q
                                   : a.dims.batch * a.dims.heads * a.dims.seq_q;
  const int64_t tiles = (a.dims.seq_k + 63) / 64;
  // Splits fill one CTA an SM (an unknown device: an H100's 132). One a SM, not the two that
  // fit: fewer, longer splits pay the pipeline's fill and drain and the combine fewer times,
  // which outweighs the bytes more CTAs would keep in flight (measured:
  // docs/log/2026-11-perf-history.md, "Serving: decode, paged cache, varlen").
  // Two CTAs an SM where two fit (at most 112 KB each: a Hopper's 228 KB; an unknown device is
  // taken for an H100) for an e4m3 cache, whose CTAs hide each other's widening, and for a paged
  // cache, whose CTAs hide each other's page-table reads (a tile's copies wait for its pages;
  // docs/perf.md, "Paged decode"). A dense cache's 32-row CTAs (speculative decoding's drafts)
  // take one too: with two, a batch that fills the GPU gets a second split, a merge, and SMs
  // left with one CTA; with one it streams near the 16-row kernel's rate (docs/perf.md,
  // "Speculative decode").
  const bool two =
      (fp8_kv(a) || a.seqs.page_size > 0) && (!known(dev) || dev.smem_per_sm >= (224 << 10));
  const int64_t slots = (known(dev) ? dev.sms : 132) * (two ? 2 : 1);
  split_keys(tiles, a.dims.batch * a.dims.kv_heads * pl.row_blocks, slots, pl.splits,
             pl.split_tiles);
  return pl;
}

inline int64_t workspace_bytes(const FwdArgs& a, const DeviceInfo& dev) {
  const Plan pl = plan(a, dev);
  if (pl.splits == 1) return 0;
  return int64_t(pl.splits) * pl.lse_rows * (a.dims.head_dim + 1) * int64_t(sizeof(float));
}

// What the decode path needs beyond applies(): seq_q, seq_k and key indices a tile past them in
// `int`, and its shared memory.
template <int D>
std::string can_implement(const FwdArgs& a, const DeviceInfo& dev) {
  std::string scales;
  if (fp8_kv(a) && a.ops.k != 0 && (a.fp8.k_scale == 0 || a.fp8.v_scale == 0))
    scales = "an e4m3 K/V cache needs k_scale and v_scale";
  return limits::first({limits::int_sequences(a, "cutlass-sm80", kMaxTileRows),
                        limits::smem_per_block(dev, smem_bytes<D>(plan(a, dev).mt, fp8_kv(a))),
                        scales});
}

// The row blocks' counters for the launch of `pl`, where its last split merges the splits
// (Merge::kLastSplit), or null: combine_kernel merges them. The combine measured as fast or
// faster on every decode problem (docs/log/2026-11-notebook.md, "The splits merged by the
// combine kernel again"), so the last split merges only where
// SDPA_DECODE_FOLD=1 in the environment (read once, for measuring) asks, there are splits to
// merge and a counter for every row block among FwdArgs::tile_counter's (sdpa/counters.h).
inline int32_t* fold_counters(const FwdArgs& a, const Plan& pl) {
  static const bool on = [] {
    const char* e = std::getenv("SDPA_DECODE_FOLD");
    return e != nullptr && e[0] == '1';
  }();
  const int64_t blocks = a.dims.batch * a.dims.kv_heads * pl.row_blocks;
  if (!on || pl.splits == 1 || a.scratch.tile_counter == 0 || blocks > kTileCounters)
    return nullptr;
  return device_ptr<int32_t>(a.scratch.tile_counter);
}

// Rows a row block of `a` holds in the merge region (Merge::kCluster): those of its CTA that
// exist.
inline int merge_rows(const FwdArgs& a, const Plan& pl) {
  return int(std::min<int64_t>(16 * pl.mt, a.dims.seq_q * (a.dims.heads / a.dims.kv_heads)));
}

// The merge region of a launch of `pl` (Merge::kCluster, `rows` rows a row block) at head dim D
// with MT strips: its byte offset, and the dynamic shared memory of the launch. Where the
// stages a split's tiles never fill hold it past the warps' end state, the kernel's own shared
// memory suffices (a short context's splits of one or two tiles: two CTAs an SM still fit).
struct MergeRegion {
  int offset, smem;
};
template <int D, int MT>
MergeRegion merge_region(const Plan& pl, int rows) {
  using G = Geo<cute::half_t, D, MT>;  // the layout in bytes is the same for both 16-bit types
  const int bytes = pl.splits * rows * (D + 1) * 4;
  const int used = std::min(pl.split_tiles, kStages) * G::kStageElems * 2;
  const int in_stages = (std::max(used, G::kEndStateBytes) + 15) / 16 * 16;
  if (in_stages + bytes <= G::kQOffset * 2) return {in_stages, G::kSmemBytes};
  return {G::kMergeOffset, G::kMergeOffset + bytes};
}

// Whether a launch of Kernel (Merge::kCluster) over `grid` with `smem` bytes merges its
// `splits` splits in clusters: where the step may (may_merge_in_cluster), 2 to kClusterMax
// splits, and as many clusters resident at once as the grid holds
// (cudaOccupancyMaxActiveClusters, asked once a device, split count and size: a cluster's CTAs
// share a GPC).
template <auto Kernel>
bool merges_in_cluster(const FwdArgs& a, const DeviceInfo& dev, int splits, int smem, dim3 grid) {
  if (!may_merge_in_cluster(a, dev) || splits < 2 || splits > kClusterMax ||
      smem > dev.smem_optin_per_block)
    return false;
  const void* kernel = reinterpret_cast<const void*>(Kernel);
  int device = 0;
  SDPA_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= 64) return false;
  // Once a device: any dynamic shared memory the device allows (the launch's varies).
  static std::atomic<uint64_t> configured{0};
  opt_in_smem(kernel, dev.smem_optin_per_block, configured);
  // The answer for (device, splits, smem), as (smem << 24) | (device << 16) | clusters.
  static std::atomic<uint64_t> asked[kClusterMax + 1];
  const uint64_t key = (uint64_t(smem) << 24) | (uint64_t(device) << 16);
  uint64_t v = asked[splits].load(std::memory_order_relaxed);
  if ((v & ~uint64_t(0xffff)) != key) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(unsigned(splits));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = size_t(smem);
    cudaLaunchAttribute at;
    at.id = cudaLaunchAttributeClusterDimension;
    at.val.clusterDim.x = unsigned(splits);
    at.val.clusterDim.y = at.val.clusterDim.z = 1;
    cfg.attrs = &at;
    cfg.numAttrs = 1;
    int clusters = 0;
    SDPA_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
    v = key | uint64_t(std::min(clusters, 0xffff));
    asked[splits].store(v, std::memory_order_relaxed);
  }
  return int64_t(v & 0xffff) >= int64_t(grid.y) * grid.z;
}

// Merges the splits' partial outputs into the output: combine_kernel over (tokens / 4, heads,
// batch). On sm_90 it launches programmatically: its launch and start overlap the splits' tail,
// and it waits for their completion before reading the partials.
template <typename T, int D, class Mask>
void launch_combine(const Params<T, Mask>& p, const FwdArgs& a, const DeviceInfo& dev,
                    cudaStream_t stream) {
  launch_kernel(
      combine_kernel<T, D, Mask>,
      dim3(unsigned((a.dims.seq_q + 3) / 4), unsigned(a.dims.heads), unsigned(a.dims.batch)),
      dim3(128), 0, stream, dev.cc_major >= 9, p);
}

// `Kernel` over `grid`, after its shared-memory opt-in (once a device, each kernel its own).
template <auto Kernel, int kSmem, typename T, class Mask>
void launch_decode(dim3 grid, const DeviceInfo& dev, cudaStream_t stream,
                   const Params<T, Mask>& p) {
  static std::atomic<uint64_t> configured{0};
  opt_in_smem(reinterpret_cast<const void*>(Kernel), kSmem, configured);
  launch_kernel(Kernel, grid, dim3(kThreads), kSmem, stream, dev.cc_major >= 9, p);
}

template <typename T, int D, int MT, class Mask, bool F8>
void launch(const FwdArgs& a, const DeviceInfo& dev, const Mask& mask, const Plan& pl,
            cudaStream_t stream) {
  using G = Geo<T, D, MT>;
  Params<T, Mask> p{};
  p.q = device_ptr<const T>(a.ops.q);
  if constexpr (F8) {
    p.kc = device_ptr<const uint8_t>(a.ops.k);
    p.vc = device_ptr<const uint8_t>(a.ops.v);
    p.k_scale = device_ptr<const float>(a.fp8.k_scale);
    p.v_scale = device_ptr<const float>(a.fp8.v_scale);
    // Per head: [batch][kv_heads] of dense K/V, [kv_heads] of packed or paged K/V (one
    // sequence dimension, batch stride 0).
    const bool dense = a.seqs.page_size == 0 && !a.seqs.packed_kv;
    p.scale_head = a.fp8.per_head_scales ? 1 : 0;
    p.scale_batch = a.fp8.per_head_scales && dense ? int(a.dims.kv_heads) : 0;
  } else {
    p.k = device_ptr<const T>(a.ops.k);
    p.v = device_ptr<const T>(a.ops.v);
  }
  p.o = device_ptr<T>(a.ops.o);
  p.qs = a.ops.q_stride;
  p.ks = a.ops.k_stride;
  p.vs = a.ops.v_stride;
  p.os = a.ops.o_stride;
  p.mask = mask;
  p.group = int(a.dims.heads / a.dims.kv_heads);
  p.heads = int(a.dims.heads);
  p.row_blocks = pl.row_blocks;
  p.scale_log2 = a.mods.scale * 1.4426950408889634f;
  p.lse = a.out.has_lse ? device_ptr<float>(a.out.lse) : nullptr;
  p.sinks = a.mods.sinks ? device_ptr<const float>(a.mods.sink_logits) : nullptr;
  p.seqs = SeqParams::of(a);
  p.splits = pl.splits;
  p.split_tiles = pl.split_tiles;
  p.lse_rows = pl.lse_rows;
  if (pl.splits > 1) {
    if (a.scratch.workspace == 0 || a.scratch.workspace % 16 != 0)
      throw Error("cutlass-sm80 decode: needs a 16-byte aligned workspace of workspace_bytes()");
    p.ws_o = device_ptr<float>(a.scratch.workspace);
    p.ws_lse = p.ws_o + int64_t(pl.splits) * pl.lse_rows * D;
  }
  p.merge_rows = merge_rows(a, pl);
  // On sm_90 programmatically: the launch and the CTAs' start overlap the tail of the grid
  // before it on the stream (a decode step's previous combine, or the previous layer's kernel).
  const dim3 grid(unsigned(pl.splits), unsigned(a.dims.kv_heads * pl.row_blocks),
                  unsigned(a.dims.batch));
  if constexpr (!F8) {
    constexpr auto kClustered = decode_kernel<T, D, MT, Mask, false, Merge::kCluster>;
    const MergeRegion region = merge_region<D, MT>(pl, p.merge_rows);
    p.merge_offset = region.offset;
    if (merges_in_cluster<kClustered>(a, dev, pl.splits, region.smem, grid))
      return launch_clustered(kClustered, grid, dim3(kThreads), size_t(region.smem), stream, true,
                              unsigned(pl.splits), p);
  }
  p.counters = fold_counters(a, pl);
  constexpr int smem = F8 ? G::kSmemBytesF8 : G::kSmemBytes;
  if (p.counters != nullptr)
    return launch_decode<decode_kernel<T, D, MT, Mask, F8, Merge::kLastSplit>, smem>(grid, dev,
                                                                                     stream, p);
  launch_decode<decode_kernel<T, D, MT, Mask, F8, Merge::kCombine>, smem>(grid, dev, stream, p);
  if (pl.splits > 1) launch_combine<T, D>(p, a, dev, stream);
}

template <typename T, int D>
void forward(const FwdArgs& a, const DeviceInfo& dev, cudaStream_t stream) {
  if ((a.out.has_lse && !a.out.lse) || (a.mods.sinks && !a.mods.sink_logits))
    throw Error("cutlass-sm80 decode: a log-sum-exp or sinks without a buffer");
  const bool f8 = fp8_kv(a);
  if (f8 && (a.fp8.k_scale == 0 || a.fp8.v_scale == 0))
    throw Error("cutlass-sm80 decode: an e4m3 K/V cache without its k_scale and v_scale");
  const Plan pl = plan(a, dev);
  mask::dispatch_mask(a.mask.kind, int(a.dims.seq_q), int(a.dims.seq_k), [&](const auto& mask) {
    if (f8) {
      if (pl.mt == 1)
        return launch<T, D, 1, std::decay_t<decltype(mask)>, true>(a, dev, mask, pl, stream);
      return launch<T, D, 2, std::decay_t<decltype(mask)>, true>(a, dev, mask, pl, stream);
    }
    if (pl.mt == 1)
      return launch<T, D, 1, std::decay_t<decltype(mask)>, false>(a, dev, mask, pl, stream);
    launch<T, D, 2, std::decay_t<decltype(mask)>, false>(a, dev, mask, pl, stream);
  });
}

}  // namespace sdpa::cutlass_sm80::decode
