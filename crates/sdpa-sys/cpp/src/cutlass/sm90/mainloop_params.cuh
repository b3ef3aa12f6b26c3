// The sm_90a kernel's parameters for its collectives (TMA descriptors, sizes, scales, the band
// and its score mods, the sequence layout) and, on the host, their making from FwdArgs: the one
// place the collectives read the call's arguments.
#pragma once

#include "common/mask.cuh"
#include "common/seqs.cuh"
#include "cutlass/sm90/primitives.cuh"
#include "cutlass/sm90/tile_config.cuh"
#include "cutlass/sm90/v_prepass.cuh"

namespace sdpa::cutlass_sm90 {

// 32-bit sizes, rows and keys (offsets are 64-bit): can_implement (sm90_fwd.cuh) keeps seq_q,
// seq_k <= 2^31 - the tile (row and key indices reach a tile past the end) and masked seq_q + seq_k
// <= 2^31 - 1 (the producer's diagonal).
template <class E, int D>
struct MainloopParams {
  using C = TileConfig<E, D>;
  typename C::TmaQ tma_q;
  typename C::TmaK tma_k;
  typename C::TmaV tma_v;
  int seq_q, seq_k, heads, kv_heads, batch;
  float scale_log2;  // scale * log2(e)
  int turns;         // 1: the consumers take turns issuing (C::kPingPong)
  FastDiv div_group;
  // E4M3 only: dequantization scales, one per tensor or one per (batch, head) (per_head).
  const float *q_scale, *k_scale, *v_scale;
  int per_head;
  // Band only: the band (mask::Band's diag, left, right, top_left, chunk) and the score mods:
  // softcap · log2 e (0: none), ALiBi slopes (null: none) of (b, h) at b * alibi_bstride + h.
  int diag, left, right, top_left, chunk;
  float cap2;
  const float* alibi;
  int alibi_bstride;
  // Band only: sequences of different lengths (dense: none). Packed Q, K and V are TMA
  // tensors of one batch entry whose rows start at each sequence's offset; a paged cache's
  // pages hold whole key tiles (can_implement), found through the block table per tile.
  SeqParams seqs;
  // Fast mode: V^T's keys a row (v_prepass.cuh), and the masked kernels' table of the NaN
  // codes the pre-pass took out of V (null: none).
  int keys_t;
  const uint32_t* nan_first;
};

// An operand in global memory as the TMA descriptors see it: (rows, d, heads, batch) with the
// call's strides, d its head dim (at most the kernel's D; GTensorOf). Packed and paged tensors
// (batch stride 0) are one batch entry of all their rows; the batch stride of a one-entry mode is
// never used, and TMA wants it a 16-byte multiple. The main and the small-problem kernel both make
// theirs with it.
template <typename T>
auto operand_tensor(T const* ptr, int64_t rows, int64_t d, int64_t heads, int64_t batch,
                    const Strides& st) {
  const int64_t bs = batch == 1 && st.batch == 0 ? rows * st.seq : st.batch;
  return make_tensor(make_gmem_ptr(ptr), make_shape(int(rows), int(d), int(heads), int(batch)),
                     make_stride(st.seq, _1{}, st.head, bs));
}

// The parameters: a TMA descriptor per operand (make_tma_copy encodes it on the host; it
// travels in the __grid_constant__ parameter block) and the scalars. E4M3 with the pre-pass: V
// is the pre-pass's f16 copy `v` with strides `vs`.
template <class E, int D, class Mask>
MainloopParams<E, D> make_mainloop_params(const FwdArgs& a, const void* v, const Strides& vs,
                                          bool turns) {
  using C = TileConfig<E, D>;
  using QK = typename E::QK;
  using PV = typename E::PV;
  constexpr int BM = C::kBM, BN = C::kBN;
  constexpr bool kBand = mask::kIsBand<Mask>;
  const auto gmem = [&](auto const* ptr, int64_t rows, int64_t heads, int64_t batch,
                        const Strides& st,
                        int64_t d) { return operand_tensor(ptr, rows, d, heads, batch, st); };
  const int64_t d = a.dims.head_dim, dv = a.dims.head_dim_v;
  const int64_t q_rows = a.seqs.total_q > 0 ? a.seqs.total_q : a.dims.seq_q;
  const int64_t q_batch = a.seqs.total_q > 0 ? 1 : a.dims.batch;
  const int64_t kv_rows = a.seqs.kv_rows > 0 ? a.seqs.kv_rows : a.dims.seq_k;
  const int64_t kv_batch = a.seqs.kv_rows > 0 ? 1 : a.dims.batch;
  MainloopParams<E, D> p{};
  p.tma_q = make_tma_copy(
      SM90_TMA_LOAD{},
      gmem(device_ptr<const QK>(a.ops.q), q_rows, a.dims.heads, q_batch, a.ops.q_stride, d),
      typename C::LayoutQ{}, Shape<Int<BM>, Int<D>>{}, _1{});
  p.tma_k = make_tma_copy(
      SM90_TMA_LOAD{},
      gmem(device_ptr<const QK>(a.ops.k), kv_rows, a.dims.kv_heads, kv_batch, a.ops.k_stride, d),
      take<0, 2>(typename C::LayoutK{}), Shape<Int<BN>, Int<D>>{}, _1{});
  if constexpr (E::kConvertV) {
    p.tma_v =
        make_tma_copy(SM90_TMA_LOAD{},
                      gmem(static_cast<const QK*>(v), kv_rows, a.dims.kv_heads, kv_batch, vs, dv),
                      take<0, 2>(typename C::LayoutV8{}), Shape<Int<BN>, Int<D>>{}, _1{});
  } else if constexpr (E::kFp8PV) {
    // The pre-pass's V^T in the workspace `v`, [batch][kv_head][D][keys_t]; after it, the
    // masked kernels' NaN table.
    const int64_t keys = transposed_keys(a);
    p.keys_t = int(keys);
    p.tma_v = make_tma_copy(
        SM90_TMA_LOAD{},
        make_tensor(make_gmem_ptr(static_cast<const PV*>(v)),
                    make_shape(Int<D>{}, int(keys), int(a.dims.kv_heads), int(a.dims.batch)),
                    make_stride(keys, _1{}, D * keys, a.dims.kv_heads * D * keys)),
        take<0, 2>(typename C::LayoutVt{}), Shape<Int<D>, Int<BN>>{}, _1{});
    if (nan_table_bytes(a) > 0)
      p.nan_first =
          reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(v) + transposed_v_bytes(a));
  } else {
    p.tma_v =
        make_tma_copy(SM90_TMA_LOAD{},
                      gmem(static_cast<const PV*>(v), kv_rows, a.dims.kv_heads, kv_batch, vs, dv),
                      take<0, 2>(typename C::LayoutV{}), Shape<Int<BN>, Int<C::kDV>>{}, _1{});
  }
  fill_sizes(p, a);
  p.turns = turns ? 1 : 0;
  p.q_scale = device_ptr<const float>(a.fp8.q_scale);
  p.k_scale = device_ptr<const float>(a.fp8.k_scale);
  p.v_scale = device_ptr<const float>(a.fp8.v_scale);
  p.per_head = a.fp8.per_head_scales ? 1 : 0;
  if constexpr (kBand) {
    const mask::Band<int> band = mask::band_of<int>(a);
    p.diag = band.diag;
    p.left = band.left;
    p.right = band.right;
    p.top_left = band.top_left ? 1 : 0;
    p.chunk = band.chunk;
    p.cap2 = a.mods.softcap > 0.f ? a.mods.softcap * 1.4426950408889634f : 0.f;
    p.alibi = a.mods.alibi ? device_ptr<const float>(a.mods.alibi_slopes) : nullptr;
    p.alibi_bstride = int(a.mods.alibi_batch_stride);
    p.seqs = SeqParams::of(a);
  }
  return p;
}

}  // namespace sdpa::cutlass_sm90
