// Where one sequence's rows live in a call's tensors when a batch's sequences differ in length
// (FwdArgs' varlen and paged-cache fields): the offsets of its queries and keys, its lengths, and
// for a paged cache the pages of its keys. A kernel reads them once per CTA (seq_of) and a paged
// cache's K/V rows per copy (paged_row); for dense sequences every offset is 0 and the lengths
// the call's, so one code path serves both.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "sdpa/sdpa.h"

namespace sdpa {

// The metadata as a kernel parameter. Kernels read it from the parameter space where they use
// it (nothing of a paged cache stays in registers across their loops).
struct SeqParams {
  const int32_t *cu_q, *cu_k, *used_k, *block_table;  // null: none
  int64_t pages_per_seq;
  int page_shift;   // log2 page_size (a paged cache)
  int64_t total_q;  // rows of packed Q (0: dense): the LSE's head stride

  static SeqParams of(const FwdArgs& a) {
    SeqParams s{a.cu_seqlens_q,
                a.cu_seqlens_k,
                a.has_seqused_k ? a.seqused_k : nullptr,
                a.page_size > 0 ? a.block_table : nullptr,
                a.pages_per_seq,
                0,
                a.total_q};
    while ((int64_t(1) << s.page_shift) < a.page_size) ++s.page_shift;
    return s;
  }

  __host__ __device__ __forceinline__ bool paged() const { return block_table != nullptr; }

  // The row of a paged cache holding key j of sequence b, in K's (and V's) sequence dimension.
  __device__ __forceinline__ int64_t paged_row(int64_t b, int64_t j) const {
    const int64_t page = __ldg(block_table + b * pages_per_seq + (j >> page_shift));
    return (page << page_shift) | (j & ((int64_t(1) << page_shift) - 1));
  }
};

// One sequence: queries q0 .. q0 + seq_q of Q's (and O's) sequence dimension, keys k0 ..
// k0 + seq_k of packed or dense K/V (a paged cache: SeqParams::paged_row).
template <typename Index>
struct Seq {
  Index q0, k0, seq_q, seq_k;
};

// Sequence b's place, for a call whose longest sequences are seq_q and seq_k.
template <typename Index>
__device__ __forceinline__ Seq<Index> seq_of(const SeqParams& s, int64_t b, Index seq_q,
                                             Index seq_k) {
  Seq<Index> r{0, 0, seq_q, seq_k};
  if (s.cu_q != nullptr) {
    r.q0 = __ldg(s.cu_q + b);
    r.seq_q = __ldg(s.cu_q + b + 1) - r.q0;
  }
  if (s.cu_k != nullptr) {
    r.k0 = __ldg(s.cu_k + b);
    r.seq_k = __ldg(s.cu_k + b + 1) - r.k0;
  }
  if (s.used_k != nullptr) r.seq_k = __ldg(s.used_k + b);
  return r;
}

// The log-sum-exp entry of row i of sequence b, head h: [batch][heads][seq_q] (seq_q the
// longest), or [heads][total_q] for packed Q.
template <typename Index>
__device__ __forceinline__ int64_t lse_index(const SeqParams& s, const Seq<Index>& q, int64_t b,
                                             int64_t h, int64_t heads, int64_t seq_q, Index i) {
  if (s.total_q > 0) return h * s.total_q + q.q0 + i;
  return (b * heads + h) * seq_q + i;
}

}  // namespace sdpa
