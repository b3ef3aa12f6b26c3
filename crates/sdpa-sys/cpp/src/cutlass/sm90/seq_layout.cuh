// How the sm_90a kernel finds a work tile's sequence in Q, K and V: a policy each role asks.
// DenseSeqs: every sequence has the call's lengths at its own batch index. VarSeqs: the call's
// layout at run time (common/seqs.cuh): packed Q, packed K/V or a paged cache whose pages hold
// whole key tiles, seqused_k, or dense where it has none of them.
#pragma once

#include "common/seqs.cuh"
#include "cutlass/sm90/tile_scheduler.cuh"

namespace sdpa::cutlass_sm90 {

struct DenseSeqs {
  // Work tile w's sequence: its rows in Q and K/V and its lengths.
  template <class P>
  __device__ __forceinline__ static Seq<int> of(const P& p, const WorkTile& /*w*/) {
    return {0, 0, p.seq_q, p.seq_k};
  }
  // Whether a tile with rows from m0 lies past its sequence's queries: never.
  __device__ __forceinline__ static bool past_end(const Seq<int>& /*seq*/, int /*m0*/) {
    return false;
  }
  // The batch entry of Q's and of K's and V's TMA tensors that sequence b is in.
  template <class P>
  __device__ __forceinline__ static int q_batch(const P& /*p*/, int b) {
    return b;
  }
  template <class P>
  __device__ __forceinline__ static int kv_batch(const P& /*p*/, int b) {
    return b;
  }
  // Where key tile j of sequence b lies among the key tiles from the sequence's first row.
  template <class P>
  __device__ __forceinline__ static int key_tile_at(const P& /*p*/, int /*b*/, int j) {
    return j;
  }
  // Whether the rows past a sequence's keys are another's (TMA zero-fills only past the tensor).
  template <class P>
  __device__ __forceinline__ static bool foreign_tail(const P& /*p*/) {
    return false;
  }
};

// Key tiles of 1 << kLog2BN keys.
template <int kLog2BN>
struct VarSeqs {
  // Read afresh (an opaque b) wherever it is needed rather than held in registers across the
  // main loop.
  template <class P>
  __device__ __forceinline__ static Seq<int> of(const P& p, const WorkTile& w) {
    int b = w.b;
    asm volatile("" : "+r"(b));
    return seq_of<int>(p.seqs, b, p.seq_q, p.seq_k);
  }
  // Past its sequence's queries, or none (TileScheduler): no role of the CTA runs the tile
  // (TileKeys::record; a grid covers the longest sequence).
  __device__ __forceinline__ static bool past_end(const Seq<int>& seq, int m0) {
    return m0 < 0 || m0 >= seq.seq_q;
  }
  // Packed or paged tensors are one batch entry.
  template <class P>
  __device__ __forceinline__ static int q_batch(const P& p, int b) {
    return p.seqs.cu_q != nullptr ? 0 : b;
  }
  template <class P>
  __device__ __forceinline__ static int kv_batch(const P& p, int b) {
    return p.seqs.cu_k != nullptr || p.seqs.paged() ? 0 : b;
  }
  // Key tile j itself, or for a paged cache the tile its page holds it as (pages hold whole
  // tiles, and lie page_rows rows apart: a multiple of the tile; the cache's rows and the
  // table's entries fit an int: can_implement; the entry clamped into the cache like every
  // metadata value, seqs.cuh). Recomputed per copy from an opaque b: the producer thread holds
  // nothing of the block table across its loop.
  template <class P>
  __device__ __forceinline__ static int key_tile_at(const P& p, int b, int j) {
    if (p.seqs.paged()) {
      asm volatile("" : "+r"(b));
      const int shift = p.seqs.page_shift - kLog2BN;  // tiles a page: 1 << shift
      const int entry = __ldg(p.seqs.block_table + (b * int(p.seqs.pages_per_seq) + (j >> shift)));
      const int page = min(max(entry, 0), int(p.seqs.pages) - 1);
      return page * int(p.seqs.page_rows >> kLog2BN) + (j & ((1 << shift) - 1));
    }
    return j;
  }
  // Packed K/V, a paged cache or seqused_k: the rows past a sequence's keys are not zeroed.
  template <class P>
  __device__ __forceinline__ static bool foreign_tail(const P& p) {
    return p.seqs.cu_k != nullptr || p.seqs.used_k != nullptr || p.seqs.paged();
  }
};

}  // namespace sdpa::cutlass_sm90
