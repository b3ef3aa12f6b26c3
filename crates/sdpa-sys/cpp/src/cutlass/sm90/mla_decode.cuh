// MLA decode in the absorbed form (DeepSeek V2/V3, Kimi K2): query heads of 576 columns against
// one latent K/V head of 576 whose first 512 columns are V, read from the same cache rows (the
// problem's `v_in_k`: V's address and strides are K's). A decode step of 1 to 16 query tokens.
//
// A CTA takes 64 query heads of one token of one K/V head (rows of the wgmma M dimension) and a
// range of 64-key tiles (split-KV: `splits` ranges chosen so the grid fills the GPU, merged by
// cutlass-sm80's combine kernel). All of a CTA's rows belong to one token, so a causal mask is a
// shorter key range for the whole CTA: no key the CTA loads is hidden from one of its rows.
//
// Two warpgroups, no producer warpgroup. Key tiles stream through two stages, the next one's
// copy issued as the current one's compute begins: by one thread's TMA (dense or packed caches,
// pages of a multiple of 64 keys, so a tile is one page's rows; the last tile's rows past the
// token's keys are zeroed in shared memory before any mma reads them), else by every thread's
// cp.async (16-byte chunks, any page size, rows past the keys zero-filled). Each tile:
//   - S = Q·Kᵀ: warpgroup w takes keys [32w, 32w + 32) of the tile (m64n32k16 over 576 columns);
//   - the row maxima meet in shared memory, so both keep the same running max; each warpgroup
//     writes its P half (16-bit) to shared memory;
//   - O += P·V: warpgroup w owns output columns [256w, 256w + 256) (m64n256k16, 128 f32
//     registers a thread), over both P halves and the tile's first 512 columns as V;
//   - the row sums meet once at the end.
// K tiles live as two halves of 32 keys (so each warpgroup's B operand of Q·Kᵀ is a whole tile
// of its own), each in 128-byte swizzle atoms of 8 keys x 64 columns; V's 256-column slice of a
// half is the same bytes seen MN-major.
//
// Shared memory: Q 72 KB + two key tiles of 72 KB + P 8 KB + the row exchange: 226 KB, one CTA an
// SM.
#pragma once

#include <cutlass/arch/barrier.h>

#include <atomic>
#include <string>
#include <vector>

#include "common/attributes.cuh"
#include "common/limits.cuh"
#include "common/seqs.cuh"
#include "common/sinks.cuh"
#include "cutlass/sm80/decode.cuh"
#include "cutlass/sm90/mainloop_params.cuh"
#include "cutlass/sm90/pipeline.cuh"
#include "cutlass/sm90/primitives.cuh"
#include "cutlass/sm90/tile_config.cuh"

namespace sdpa::cutlass_sm90::mla {

constexpr int kD = 576;   // Q's and the latent K's columns
constexpr int kDV = 512;  // V's: the latent K's first
constexpr int kBM = 64;   // query heads a CTA
constexpr int kBN = 64;   // keys a tile
constexpr int kHalf = kBN / 2;
constexpr int kThreads = 256;
constexpr int kStages = 2;
constexpr int kMaxTokens = 16;

template <typename T>
struct Geo {
  using QLayout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<_64, Int<kD>>{}));
  // One half of a key tile: 32 keys of 576 columns.
  using KHalfLayout =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<Int<kHalf>, Int<kD>>{}));
  // V's columns [256w, 256w + 256) of a half, as [column][key]: the same bytes, MN-major.
  using VtLayout = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{},
                                          Shape<Int<kDV / 2>, Int<kHalf>>{}, Step<_2, _1>{}));
  // One warpgroup's P: 64 rows of its 32 keys.
  using PLayout = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<T>{}, Shape<_64, Int<kHalf>>{}));

  static constexpr int kQElems = kBM * kD;
  static constexpr int kHalfElems = kHalf * kD;
  static constexpr int kTileElems = kBN * kD;
  static constexpr int kPElems = kBM * kHalf;
  // A slice of 256 V columns starts 4 swizzle atoms (of 8 x 64) x 4 key groups into its half.
  static constexpr int kVSliceElems = (kDV / 2 / 64) * (kHalf / 8) * 512;
  static constexpr int kKOffset = kQElems;  // elements
  static constexpr int kPOffset = kKOffset + kStages * kTileElems;
  static constexpr int kRowOffset = (kPOffset + 2 * kPElems) * int(sizeof(T));  // bytes
  // Row maxima [warpgroup][row], then row sums [warpgroup][row], then the stages' barriers.
  static constexpr int kBarOffset = kRowOffset + 2 * 2 * kBM * int(sizeof(float));
  static constexpr int kSmemBytes = kBarOffset + kStages * int(sizeof(uint64_t));

  // A half tile by TMA: 32 rows of 576 columns, as nine boxes of 64 columns.
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorOf<T, kD>>(),
                                      KHalfLayout{}, Shape<Int<kHalf>, Int<kD>>{}, _1{}));

  using MmaS = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<T, T, float, Shape<_64, Int<kHalf>, Int<kD>>, GMMA::Major::K,
                                 GMMA::Major::K>()));
  using MmaO = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<T, T, float, Shape<_64, Int<kDV / 2>, Int<kHalf>>, GMMA::Major::K,
                                 GMMA::Major::MN>()));
};

template <typename T>
struct Params {
  // Key tiles by TMA (dense or packed K, pages of a multiple of 64 keys): the latent cache as
  // (rows, 576, kv heads, outer), outer the batch (dense), 1 (packed) or the pages (paged, rows
  // a page's). Else cp.async, row by row.
  bool tma;
  typename Geo<T>::TmaK tma_k;
  int tma_rows, tma_outer, kv_heads;
  const void *q, *k;
  void* o;
  Strides qs, ks, os;
  int group, heads, seq_q, seq_k, head_blocks;
  bool causal;
  float scale_log2;
  float* lse;          // null: none
  const float* sinks;  // [heads] (null: none)
  SeqParams seqs;
  int splits, split_tiles;
  int64_t lse_rows;
  float *ws_o, *ws_lse;  // splits > 1: [split][lse row][kDV], [split][lse row]
};

// Row `r` of a C fragment of a 64-row wgmma and the column of value `v` (the accumulator
// layout: value v = c + 2·r2 + 4·j is row 16·warp + lane / 4 + 8·r2, column 8j + 2·(lane % 4)
// + c).
__device__ __forceinline__ int frag_row(int wtid, int r2) {
  return 16 * (wtid / 32) + (wtid % 32) / 4 + 8 * r2;
}
__device__ __forceinline__ int frag_col(int wtid, int j) { return 8 * j + 2 * (wtid % 4); }

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    mla_decode_kernel(const __grid_constant__ Params<T> p) {
#ifdef SDPA_SM90_DEVICE
  using G = Geo<T>;
  // The combine may launch and wait for this grid's completion; with one split the next grid is
  // another step's, which waits for the end (the decode kernel's reason, decode.cuh).
  if (p.splits > 1) pdl_launch_dependents();
  pdl_wait();  // launched programmatically: the grid before it on the stream has completed
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  T* const smem = reinterpret_cast<T*>(smem_raw);
  T* const sq = smem;
  T* const sk = smem + G::kKOffset;
  T* const sp = smem + G::kPOffset;
  float* const row_max = reinterpret_cast<float*>(smem_raw + G::kRowOffset);
  float* const row_sum = row_max + 2 * kBM;
  uint64_t* const full = reinterpret_cast<uint64_t*>(smem_raw + G::kBarOffset);
  using Bar = cutlass::arch::ClusterTransactionBarrier;

  const int tid = threadIdx.x, wg = tid / 128, wtid = tid % 128;
  const int split = blockIdx.x, b = blockIdx.z;
  const int hb = blockIdx.y % p.head_blocks;
  const int tok = (blockIdx.y / p.head_blocks) % p.seq_q;
  const int hk = blockIdx.y / (p.head_blocks * p.seq_q);
  const Seq<int> seq = seq_of<int>(p.seqs, b, p.seq_q, p.seq_k);
  if (tok >= seq.seq_q) return;  // CTA-uniform
  // Keys this token sees: all of the sequence's, or up to its own position.
  const int kv_end = p.causal ? min(seq.seq_k, seq.seq_k - seq.seq_q + 1 + tok) : seq.seq_k;
  const int tiles = kv_end > 0 ? (kv_end + kBN - 1) / kBN : 0;
  const int n_begin = split * p.split_tiles, n_end = min(n_begin + p.split_tiles, tiles);
  const int head0 = hk * p.group + hb * kBM;  // the CTA's first query head
  const int rows = min(kBM, p.group - hb * kBM);

  const auto elem = [](const void* base, int64_t off) {
    return reinterpret_cast<const T*>(base) + off;
  };
  const bool paged = p.seqs.paged();
  const T* const kbase = elem(p.k, int64_t(b) * p.ks.batch + int64_t(hk) * p.ks.head +
                                       (paged ? 0 : int64_t(seq.k0)) * p.ks.seq);
  // Copies: thread tid takes row tid / 4 of a tile (or of Q) and its 16-byte chunks tid % 4,
  // + 4, ...: one row address a tile, looked up (a paged cache's block table) a tile ahead.
  constexpr int kRowThreads = kThreads / kBN, kChunks = kD / 8 / kRowThreads;
  static_assert(kThreads % kBN == 0 && (kD / 8) % kRowThreads == 0);
  const int crow = tid / kRowThreads, cchunk = tid % kRowThreads;
  // The cache row holding key crow of tile n, -1 past the token's keys.
  const auto row_of = [&](int n) -> int64_t {
    const int key = n * kBN + crow;
    if (key >= kv_end) return -1;
    return paged ? p.seqs.paged_row(b, key) : int64_t(key);
  };
  T* const crow_dst = sk + (crow / kHalf) * G::kHalfElems;
  const auto load_tile = [&](int64_t row, int s) {
    Tensor half =
        make_tensor(make_smem_ptr(crow_dst + s * G::kTileElems), typename G::KHalfLayout{});
    const T* const src = kbase + max(row, int64_t(0)) * p.ks.seq;
    CUTE_UNROLL
    for (int j = 0; j < kChunks; ++j) {
      const int c = 8 * (cchunk + kRowThreads * j);
      cutlass_sm80::cp_async16(&half(crow % kHalf, c), src + c, row >= 0);
    }
  };

  // TMA: tile n into stage s, issued by one thread; the stage's barrier counts its bytes.
  const auto issue_tile = [&](int n, int s) {
    const int key0 = n * kBN;
    int row, outer;
    if (paged) {
      row = key0 & ((1 << p.seqs.page_shift) - 1);
      outer = int(p.seqs.page(b, key0 >> p.seqs.page_shift));
    } else {
      row = seq.k0 + key0;
      outer = p.seqs.cu_k != nullptr ? 0 : b;
    }
    Bar::arrive_and_expect_tx(&full[s], uint32_t(G::kTileElems * sizeof(T)));
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.tma_rows, Int<kD>{}, p.kv_heads, p.tma_outer));
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      Tensor gK = local_tile(domain_offset(make_coord(row + h * kHalf, 0), mK(_, _, hk, outer)),
                             Shape<Int<kHalf>, Int<kD>>{}, make_coord(0, 0));
      Tensor sH = make_tensor(make_smem_ptr(sk + s * G::kTileElems + h * G::kHalfElems),
                              typename G::KHalfLayout{});
      auto tK = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sH),
                              group_modes<0, 2>(gK));
      copy(p.tma_k.with(full[s]), get<0>(tK), get<1>(tK));
    }
  };
  // TMA reads whole tiles: the last one's rows past the token's keys (pages past seqused_k, the
  // next token's row) are zeroed before any mma reads them (P is 0 there, and 0 · NaN is not).
  const auto zero_tail = [&](int n, int s) {
    const int first = kv_end - n * kBN;
    for (int i = tid; i < (kBN - first) * (kD / 8); i += kThreads) {
      const int r = first + i / (kD / 8), c = (i % (kD / 8)) * 8;
      Tensor half = make_tensor(make_smem_ptr(sk + s * G::kTileElems + (r / kHalf) * G::kHalfElems),
                                typename G::KHalfLayout{});
      *reinterpret_cast<uint4*>(&half(r % kHalf, c)) = make_uint4(0, 0, 0, 0);
    }
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
  };

  typename G::MmaS mma_s;
  typename G::MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(wtid);
  auto thr_o = mma_o.get_thread_slice(wtid);
  Tensor tOrO = partition_fragment_C(mma_o, Shape<_64, Int<kDV / 2>>{});
  clear(tOrO);
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const float sl2 = p.scale_log2;

  if (n_begin < n_end) {
    Tensor sQ = make_tensor(make_smem_ptr(sq), typename G::QLayout{});
    {
      const bool in = crow < rows;
      const T* const src =
          elem(p.q, int64_t(b) * p.qs.batch + int64_t(in ? head0 + crow : 0) * p.qs.head +
                        int64_t(seq.q0 + tok) * p.qs.seq);
      CUTE_UNROLL
      for (int j = 0; j < kChunks; ++j) {
        const int c = 8 * (cchunk + kRowThreads * j);
        cutlass_sm80::cp_async16(&sQ(crow, c), src + c, in);
      }
    }
    if (p.tma) {
      if (tid == 0) {
        mbar_init(&full[0], 1);
        mbar_init(&full[1], 1);
        cutlass::arch::fence_barrier_init();
      }
      __syncthreads();
      if (tid == 0) issue_tile(n_begin, 0);
    } else {
      load_tile(row_of(n_begin), 0);
    }
    cute::cp_async_fence();
    int64_t next_row = !p.tma && n_begin + 1 < n_end ? row_of(n_begin + 1) : -1;

    Tensor tSrQ = thr_s.partition_fragment_A(sQ);
    for (int n = n_begin; n < n_end; ++n) {
      const int s = (n - n_begin) % kStages;
      if (p.tma) {
        if (tid == 0 && n + 1 < n_end) issue_tile(n + 1, (s + 1) % kStages);
        if (n == n_begin) {  // Q
          cute::cp_async_wait<0>();
          cutlass::arch::fence_view_async_shared();
          __syncthreads();
        }
        Bar::wait(&full[s], ((n - n_begin) / kStages) & 1);
        if ((n + 1) * kBN > kv_end) zero_tail(n, s);
      } else {
        if (n + 1 < n_end) load_tile(next_row, (s + 1) % kStages);
        cute::cp_async_fence();
        // The row after, read while this tile computes.
        if (n + 2 < n_end) next_row = row_of(n + 2);
        cute::cp_async_wait<1>();
        cutlass::arch::fence_view_async_shared();  // cp.async's writes, for wgmma's reads
        __syncthreads();
      }

      // S = Q·Kᵀ over this warpgroup's 32 keys.
      T* const stage = sk + s * G::kTileElems;
      Tensor sK = make_tensor(make_smem_ptr(stage + wg * G::kHalfElems), typename G::KHalfLayout{});
      Tensor tSrK = thr_s.partition_fragment_B(sK);
      Tensor tSrS = partition_fragment_C(mma_s, Shape<_64, Int<kHalf>>{});
      warpgroup_fence_operand(tSrS);
      warpgroup_arrive();
      mma_s.accumulate_ = GMMA::ScaleOut::Zero;
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tSrQ); ++kb) {
        cute::gemm(mma_s, tSrQ(_, _, kb), tSrK(_, _, kb), tSrS);
        mma_s.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);

      // Keys past the token's last: -inf (the last tile only).
      const int key0 = n * kBN + wg * kHalf;
      if (key0 + kHalf > kv_end) {
        CUTE_UNROLL
        for (int v = 0; v < size(tSrS); ++v)
          if (key0 + frag_col(wtid, v / 4) + v % 2 >= kv_end) tSrS(v) = -INFINITY;
      }
      // The row maxima of both halves, in shared memory.
      float mx[2] = {-INFINITY, -INFINITY};
      CUTE_UNROLL
      for (int v = 0; v < size(tSrS); ++v) mx[(v / 2) % 2] = fmaxf(mx[(v / 2) % 2], tSrS(v));
      CUTE_UNROLL
      for (int r2 = 0; r2 < 2; ++r2) {
        mx[r2] = fmaxf(mx[r2], __shfl_xor_sync(0xffffffffu, mx[r2], 1));
        mx[r2] = fmaxf(mx[r2], __shfl_xor_sync(0xffffffffu, mx[r2], 2));
        if (wtid % 4 == 0) row_max[wg * kBM + frag_row(wtid, r2)] = mx[r2];
      }
      named_sync(1, kThreads);
      float base[2], alpha[2];
      CUTE_UNROLL
      for (int r2 = 0; r2 < 2; ++r2) {
        const int row = frag_row(wtid, r2);
        const float m_new = fmaxf(m_run[r2], fmaxf(row_max[row], row_max[kBM + row]));
        base[r2] = scaled_base(m_new, sl2);
        alpha[r2] = ex2(m_run[r2] == -INFINITY ? -INFINITY : m_run[r2] * sl2 - base[r2]);
        m_run[r2] = m_new;
        l_run[r2] *= alpha[r2];
      }
      // P = 2^(s·scale - base), this half into shared memory.
      Tensor sPw = make_tensor(make_smem_ptr(sp + wg * G::kPElems), typename G::PLayout{});
      CUTE_UNROLL
      for (int v = 0; v < size(tSrS); v += 2) {
        const int r2 = (v / 2) % 2;
        const float p0 = ex2(fmaf(tSrS(v), sl2, -base[r2]));
        const float p1 = ex2(fmaf(tSrS(v + 1), sl2, -base[r2]));
        l_run[r2] += p0 + p1;
        *reinterpret_cast<uint32_t*>(&sPw(frag_row(wtid, r2), frag_col(wtid, v / 4))) =
            pack2<T>(p0, p1);
      }
      CUTE_UNROLL
      for (int v = 0; v < size(tOrO); ++v) tOrO(v) *= alpha[(v / 2) % 2];
      cutlass::arch::fence_view_async_shared();  // P's stores, for wgmma's reads
      named_sync(1, kThreads);

      // O += P·V over both halves, this warpgroup's 256 columns.
      warpgroup_fence_operand(tOrO);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        Tensor sP = make_tensor(make_smem_ptr(sp + h * G::kPElems), typename G::PLayout{});
        Tensor sVt = make_tensor(make_smem_ptr(stage + h * G::kHalfElems + wg * G::kVSliceElems),
                                 typename G::VtLayout{});
        Tensor tOrP = thr_o.partition_fragment_A(sP);
        Tensor tOrV = thr_o.partition_fragment_B(sVt);
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tOrP); ++kb)
          cute::gemm(mma_o, tOrP(_, _, kb), tOrV(_, _, kb), tOrO);
      }
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      __syncthreads();  // the stage, P and the row maxima are free for the next tile
    }
    cute::cp_async_wait<0>();
  }

  // The row sums of both halves.
  CUTE_UNROLL
  for (int r2 = 0; r2 < 2; ++r2) {
    l_run[r2] += __shfl_xor_sync(0xffffffffu, l_run[r2], 1);
    l_run[r2] += __shfl_xor_sync(0xffffffffu, l_run[r2], 2);
    if (wtid % 4 == 0) row_sum[wg * kBM + frag_row(wtid, r2)] = l_run[r2];
  }
  __syncthreads();
  float inv[2], lse[2];
  CUTE_UNROLL
  for (int r2 = 0; r2 < 2; ++r2) {
    const int row = frag_row(wtid, r2);
    float l = row_sum[row] + row_sum[kBM + row];
    float m2 = m_run[r2] * sl2;
    const float a = p.splits == 1 && p.sinks != nullptr && row < rows
                        ? fold_sink(m2, l, p.sinks[head0 + row])
                        : 1.f;
    inv[r2] = l > 0.f ? a / l : 0.f;
    lse[r2] = l > 0.f ? (m2 + __log2f(l)) * 0.6931471805599453f : -INFINITY;
  }
  CUTE_UNROLL
  for (int r2 = 0; r2 < 2; ++r2) {
    const int row = frag_row(wtid, r2);
    if (row >= rows) continue;
    const int head = head0 + row;
    const int64_t lrow = lse_index(p.seqs, seq, b, head, p.heads, p.seq_q, tok);
    T* const out = reinterpret_cast<T*>(p.o) + int64_t(b) * p.os.batch + int64_t(head) * p.os.head +
                   int64_t(seq.q0 + tok) * p.os.seq;
    float* const wo = p.ws_o + (int64_t(split) * p.lse_rows + lrow) * kDV;
    CUTE_UNROLL
    for (int v = 2 * r2; v < size(tOrO); v += 4) {
      const int col = wg * (kDV / 2) + frag_col(wtid, v / 4);
      const float x0 = tOrO(v) * inv[r2], x1 = tOrO(v + 1) * inv[r2];
      if (p.splits == 1)
        *reinterpret_cast<uint32_t*>(out + col) = pack2<T>(x0, x1);
      else
        *reinterpret_cast<float2*>(wo + col) = make_float2(x0, x1);
    }
    if (wg == 0 && wtid % 4 == 0) {
      if (p.splits > 1)
        p.ws_lse[int64_t(split) * p.lse_rows + lrow] = lse[r2];
      else if (p.lse != nullptr)
        p.lse[lrow] = lse[r2];
    }
  }
#endif
}

// Host side ----------------------------------------------------------------------------------

// Whether `a` is an absorbed MLA decode step: head dims 576 and 512 with V read from K's rows
// (V's address and strides K's: at plan time, before addresses, the strides say it).
inline bool applies(const FwdArgs& a) {
  return a.dims.head_dim == kD && a.dims.head_dim_v == kDV && a.ops.v == a.ops.k &&
         a.ops.v_stride.batch == a.ops.k_stride.batch &&
         a.ops.v_stride.head == a.ops.k_stride.head && a.ops.v_stride.seq == a.ops.k_stride.seq;
}

struct Plan {
  int head_blocks, splits, split_tiles;
  int64_t lse_rows;
};

inline Plan plan(const FwdArgs& a, const DeviceInfo& dev) {
  Plan pl{};
  const int64_t group = a.dims.heads / a.dims.kv_heads;
  pl.head_blocks = int((group + kBM - 1) / kBM);
  pl.lse_rows = a.seqs.total_q > 0 ? a.dims.heads * a.seqs.total_q
                                   : a.dims.batch * a.dims.heads * a.dims.seq_q;
  const int64_t tiles = (a.dims.seq_k + kBN - 1) / kBN;
  // Splits fill one CTA an SM (an unknown device: an H100's 132), each at least 4 tiles.
  const int64_t slots = known(dev) ? dev.sms : 132;
  cutlass_sm80::decode::split_keys(tiles,
                                   a.dims.batch * a.dims.kv_heads * a.dims.seq_q * pl.head_blocks,
                                   slots, pl.splits, pl.split_tiles);
  return pl;
}

inline int64_t workspace_bytes(const FwdArgs& a, const DeviceInfo& dev) {
  const Plan pl = plan(a, dev);
  if (pl.splits == 1) return 0;
  return int64_t(pl.splits) * pl.lse_rows * (kDV + 1) * int64_t(sizeof(float));
}

inline std::string refusal(const FwdArgs& a) {
  if (!applies(a))
    return "head_dim " + std::to_string(a.dims.head_dim) + " with head_dim_v " +
           std::to_string(a.dims.head_dim_v) +
           ": cutlass runs head dims above 256 as MLA's absorbed decode only, 576 with V read from "
           "K's rows as its first 512 columns (Problem::with_v_in_k); scalar runs the others";
  if (a.ops.dtype == Dtype::E4M3 || a.out.dtype != a.ops.dtype || a.ops.kv_dtype != a.ops.dtype)
    return "MLA decode: f16 or bf16 Q, K/V and output";
  if (a.mask.kind != Mask::NoMask && a.mask.kind != Mask::CausalBottomRight)
    return "MLA decode: no mask or causal bottom-right";
  if (a.mods.softcap > 0.f || a.mods.alibi) return "MLA decode: no softcap or ALiBi";
  if (a.dims.seq_q > kMaxTokens)
    return "MLA decode: at most " + std::to_string(kMaxTokens) +
           " query tokens a sequence (seq_q " + std::to_string(a.dims.seq_q) +
           "); scalar runs longer ones";
  const int64_t group = a.dims.heads / a.dims.kv_heads;
  if (a.dims.kv_heads * a.dims.seq_q * ((group + kBM - 1) / kBM) > 65535 || a.dims.batch > 65535)
    return "MLA decode: kv_heads x seq_q x head blocks and batch must each be at most 65535";
  return "";
}

template <typename T>
std::string can_implement(const FwdArgs& a, const DeviceInfo& dev) {
  return limits::first({refusal(a), limits::int_sequences(a, "MLA decode", kBN), sm90_only(dev),
                        limits::smem_per_block(dev, Geo<T>::kSmemBytes)});
}

template <typename T>
void forward(const FwdArgs& a, const DeviceInfo& dev, cudaStream_t stream) {
  if ((a.out.has_lse && !a.out.lse) || (a.mods.sinks && !a.mods.sink_logits))
    throw Error("MLA decode: a log-sum-exp or sinks without a buffer");
  const Plan pl = plan(a, dev);
  Params<T> p{};
  const SeqParams seqs = SeqParams::of(a);
  p.tma = a.seqs.page_size == 0 || a.seqs.page_size % kBN == 0;
  p.kv_heads = int(a.dims.kv_heads);
  if (p.tma) {
    Strides st = a.ops.k_stride;
    int64_t rows = a.seqs.packed_kv ? a.seqs.kv_rows : a.dims.seq_k,
            outer = a.seqs.packed_kv ? 1 : a.dims.batch;
    if (seqs.paged()) {
      rows = a.seqs.page_size;
      outer = seqs.pages;
      st.batch = seqs.page_rows * st.seq;
    }
    p.tma_rows = int(rows);
    p.tma_outer = int(outer);
    p.tma_k = make_tma_copy(
        SM90_TMA_LOAD{},
        operand_tensor(device_ptr<const T>(a.ops.k), rows, kD, a.dims.kv_heads, outer, st),
        typename Geo<T>::KHalfLayout{}, Shape<Int<kHalf>, Int<kD>>{}, _1{});
  }
  p.q = device_ptr<const void>(a.ops.q);
  p.k = device_ptr<const void>(a.ops.k);
  p.o = device_ptr<void>(a.ops.o);
  p.qs = a.ops.q_stride;
  p.ks = a.ops.k_stride;
  p.os = a.ops.o_stride;
  p.group = int(a.dims.heads / a.dims.kv_heads);
  p.heads = int(a.dims.heads);
  p.seq_q = int(a.dims.seq_q);
  p.seq_k = int(a.dims.seq_k);
  p.head_blocks = pl.head_blocks;
  p.causal = a.mask.kind == Mask::CausalBottomRight;
  p.scale_log2 = a.mods.scale * 1.4426950408889634f;
  p.lse = a.out.has_lse ? device_ptr<float>(a.out.lse) : nullptr;
  p.sinks = a.mods.sinks ? device_ptr<const float>(a.mods.sink_logits) : nullptr;
  p.seqs = seqs;
  p.splits = pl.splits;
  p.split_tiles = pl.split_tiles;
  p.lse_rows = pl.lse_rows;
  if (pl.splits > 1) {
    if (a.scratch.workspace == 0 || a.scratch.workspace % 16 != 0)
      throw Error("MLA decode: needs a 16-byte aligned workspace of workspace_bytes()");
    p.ws_o = device_ptr<float>(a.scratch.workspace);
    p.ws_lse = p.ws_o + int64_t(pl.splits) * pl.lse_rows * kDV;
  }
  const auto kernel = mla_decode_kernel<T>;
  static std::atomic<uint64_t> configured{0};
  opt_in_smem(reinterpret_cast<const void*>(kernel), Geo<T>::kSmemBytes, configured);
  // Programmatically: the launch and the CTAs' start overlap the tail of the grid before it.
  launch_kernel(kernel,
                dim3(unsigned(pl.splits), unsigned(a.dims.kv_heads * a.dims.seq_q * pl.head_blocks),
                     unsigned(a.dims.batch)),
                dim3(kThreads), Geo<T>::kSmemBytes, stream, true, p);
  if (pl.splits == 1) return;
  // The splits' merge: cutlass-sm80's decode combine at 512 columns, launched programmatically.
  using Mask0 = mask::NoMask<int>;
  cutlass_sm80::decode::Params<T, Mask0> c{};
  c.o = device_ptr<T>(a.ops.o);
  c.os = a.ops.o_stride;
  c.mask = Mask0{int(a.dims.seq_q), int(a.dims.seq_k)};
  c.heads = p.heads;
  c.lse = p.lse;
  c.sinks = p.sinks;
  c.seqs = p.seqs;
  c.splits = pl.splits;
  c.lse_rows = pl.lse_rows;
  c.ws_o = p.ws_o;
  c.ws_lse = p.ws_lse;
  cutlass_sm80::decode::launch_combine<T, kDV>(c, a, dev, stream);
}

template <typename T>
void attributes(std::vector<KernelAttr>& out, const DeviceInfo&) {
  // One kernel for every mask: listed as its non-causal and causal entries.
  const void* const k = reinterpret_cast<const void*>(mla_decode_kernel<T>);
  const void* const fns[2] = {k, k};
  push_attributes(out, "cutlass-sm90", dtype_name<T>(), kD, fns, Geo<T>::kSmemBytes);
}

}  // namespace sdpa::cutlass_sm90::mla
