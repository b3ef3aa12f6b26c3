// The sm_90a kernel's epilogue: a consumer warpgroup's 64 rows of O, normalized, from the wgmma
// accumulator to global memory through a shared staging area (or, for an f32 output, straight
// from the accumulator).
#pragma once

#include "common/launch.cuh"
#include "common/seqs.cuh"
#include "common/smem.cuh"
#include "cutlass/dtype.cuh"
#include "cutlass/sm90/primitives.cuh"
#include "cutlass/sm90/tile_config.cuh"

namespace sdpa::cutlass_sm90 {

template <class E, int D>
struct Epilogue {
  using C = TileConfig<E, D>;
  static constexpr int DV = C::kDV;  // O's head dim
  using Out = typename E::Out;

  // The output as written to global memory: Out, or f32 (E::kF32Out).
  using Stored = std::conditional_t<E::kF32Out, float, Out>;

  struct Params {
    Stored* o;
    Strides os;
    int seq_q;   // the longest sequence's queries
    float* lse;  // null: none; [batch][heads][seq_q], or [heads][total_q] for packed Q
    int heads;
    int64_t total_q;     // packed Q's rows (0: dense)
    const float* sinks;  // [heads] sink logits, folded in before the LSE and O (null: none)
    int dv;              // O's columns (head_dim_v, at most D): those past it are not stored
  };

  // Each row's log-sum-exp (softmax: the tile's finished online softmax, which stepped with
  // scale sl2; cS: the (row, col) of each S element this thread holds; seq: the tile's
  // sequence), where asked for. One lane of the quad that holds a row writes it.
  template <class Softmax, class TC>
  __device__ __forceinline__ static void store_lse(const Params& p, const Softmax& softmax,
                                                   const TC& cS, const Seq<int>& seq, int b, int h,
                                                   int m0, float sl2) {
    if (p.lse == nullptr) return;
    float* lb =
        p.lse + (p.total_q > 0 ? h * p.total_q + seq.q0 : (int64_t(b) * p.heads + h) * p.seq_q);
    CUTE_UNROLL
    for (int r = 0; r < decltype(size<0>(cS))::value; ++r) {
      const float v = softmax.lse(r, sl2);
      const int row = m0 + int(get<0>(cS(r, 0)));
      if (threadIdx.x % 4 == 0 && row < seq.seq_q) lb[row] = v;
    }
  }

  // Warpgroup wg's rows [m0 + 64 wg, m0 + 64 wg + 64) of the tile of sequence `seq` (rows from
  // its first, seq.q0; packed O has batch stride 0), the qi-th this CTA stores,
  // through its 64-row staging area: row r, 16-byte chunk j lives at chunk j ^ (r % 8), so the
  // quad-strided 4-byte writes and the row-contiguous 16-byte reads are both free of bank
  // conflicts. (Writing O straight from registers would scatter 4-byte stores over rows;
  // measured: docs/log/2026-11-notebook.md, the sm90 tuning log.) The barrier in
  // front keeps this tile's writes behind the reads of the previous one. `bar` is the
  // warpgroup's named barrier. The addresses are the same for every tile: computed from an opaque
  // thread index, or the compiler hoists them out of the tile loop and holds them in registers
  // across the main loop (spills).
  template <class TO>
  __device__ __forceinline__ static void store(const Params& p, typename C::Smem& sm,
                                               const TO& tOrO, const Seq<int>& seq, int b, int h,
                                               int m0, int wg, int ctid, int qi, int bar) {
    int etid = ctid;
    asm volatile("" : "+r"(etid));
    if constexpr (E::kF32Out) {
      store_f32(p, tOrO, seq, b, h, m0, etid);
    } else {
      const uint32_t so =
          uint32_t(__cvta_generic_to_shared(C::staging(sm))) + uint32_t(wg * 64 * DV * sizeof(Out));
      if (qi > 0) named_sync(bar, 128);
      {
        // The thread's elements lie in rows r0 + 8 a (all alike mod 8) and column pairs c0 + 8 j
        // (c0 < 8): wgmma's accumulator layout. So an element's chunk j is swizzled by the same
        // r0 % 8 as every other, and its staging address is one of eight (j % 8) per thread
        // plus a constant: made once, each write is one store at a fixed offset.
        typename C::MmaPV mma_pv;
        Tensor cO = mma_pv.get_thread_slice(etid).partition_C(
            make_identity_tensor(Shape<Int<C::kBM>, Int<DV>>{}));
        const int r0 = get<0>(cO(0)) - 64 * wg, c0 = get<1>(cO(0));
        const uint32_t thread_base = so + uint32_t(r0 * DV + c0) * sizeof(Out);
        const int swizzle = r0 & 7;
        CUTE_UNROLL
        for (int i = 0; i < size(tOrO); i += 2) {
          // element i + 1: (r, c + 1); dr and dc fold to constants
          const int dr = get<0>(cO(i)) - get<0>(cO(0)), dc = get<1>(cO(i)) - get<1>(cO(0));
          const int j = dc >> 3;
          const uint32_t chunk = uint32_t((((j & 7) ^ swizzle) << 3) * sizeof(Out));
          const uint32_t fixed = uint32_t((dr * DV + ((j & ~7) << 3)) * sizeof(Out));
          st_shared(thread_base + chunk + fixed, pack2<Out>(tOrO(i), tOrO(i + 1)));
        }
      }
      named_sync(bar, 128);
      Out* ob = p.o + int64_t(b) * p.os.batch + int64_t(h) * p.os.head + int64_t(seq.q0) * p.os.seq;
      constexpr int CH = DV / 8;  // 16-byte chunks per row (24 at DV = 192: not a divisor of 128)
      const int wtid = etid & 127;
      CUTE_UNROLL
      for (int i = 0; i < 64 * CH / 128; ++i) {
        const int ci = wtid + i * 128, r = ci / CH, j = ci % CH;
        const int row = m0 + 64 * wg + r;
        if (row < seq.seq_q && j * 8 < p.dv)
          st_global_128(ob + int64_t(row) * p.os.seq + j * 8,
                        ld_shared_128(so + (r * DV + ((j ^ (r & 7)) << 3)) * sizeof(Out)));
      }
    }
  }

  // O in f32 (a partial result that is merged before it is rounded), from the accumulator: each
  // thread's column pairs as 8-byte stores, so a quad's four threads fill a 32-byte sector of a
  // row (the 16-bit output's 4-byte stores fill half of one, hence its staging).
  template <class TO>
  __device__ __forceinline__ static void store_f32(const Params& p, const TO& tOrO,
                                                   const Seq<int>& seq, int b, int h, int m0,
                                                   int etid) {
    typename C::MmaPV mma_pv;
    Tensor cO = mma_pv.get_thread_slice(etid).partition_C(
        make_identity_tensor(Shape<Int<C::kBM>, Int<DV>>{}));
    float* ob = p.o + int64_t(b) * p.os.batch + int64_t(h) * p.os.head + int64_t(seq.q0) * p.os.seq;
    CUTE_UNROLL
    for (int i = 0; i < size(tOrO); i += 2) {
      const int row = m0 + int(get<0>(cO(i))), c = get<1>(cO(i));  // element i + 1: (row, c + 1)
      if (row < seq.seq_q && c < p.dv)
        *reinterpret_cast<float2*>(ob + int64_t(row) * p.os.seq + c) =
            make_float2(tOrO(i), tOrO(i + 1));
    }
  }
};

}  // namespace sdpa::cutlass_sm90
