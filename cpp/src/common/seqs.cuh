// Where one sequence's rows live in a call's tensors when a batch's sequences differ in length
// (FwdArgs' varlen and paged-cache fields): the offsets of its queries and keys, its lengths, and
// for a paged cache the pages of its keys. A kernel reads them once per CTA (seq_of) and takes its
// K/V row addresses from key_row; for dense sequences every offset is 0 and the lengths the
// call's, so one code path serves both.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "sdpa/sdpa.h"

namespace sdpa {

// The metadata as a kernel parameter.
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
};

// One sequence: queries q0 .. q0 + seq_q of Q's (and O's) sequence dimension, keys from k0 (or
// in pages), seq_k of them.
template <typename Index>
struct Seq {
  Index q0, k0, seq_q, seq_k;
  const int32_t* pages;  // its block-table row; null: keys are rows k0 + j
  int page_shift;

  // The row of key j in K's (and V's) sequence dimension.
  __device__ __forceinline__ int64_t key_row(Index j) const {
    if (pages == nullptr) return int64_t(k0) + j;
    const int64_t page = __ldg(pages + (j >> page_shift));
    return (page << page_shift) | (j & ((Index(1) << page_shift) - 1));
  }
};

// Sequence b's place, for a call whose longest sequences are seq_q and seq_k.
template <typename Index>
__device__ __forceinline__ Seq<Index> seq_of(const SeqParams& s, int64_t b, Index seq_q,
                                             Index seq_k) {
  Seq<Index> r{0, 0, seq_q, seq_k, nullptr, 0};
  if (s.cu_q != nullptr) {
    r.q0 = __ldg(s.cu_q + b);
    r.seq_q = __ldg(s.cu_q + b + 1) - r.q0;
  }
  if (s.cu_k != nullptr) {
    r.k0 = __ldg(s.cu_k + b);
    r.seq_k = __ldg(s.cu_k + b + 1) - r.k0;
  }
  if (s.used_k != nullptr) r.seq_k = __ldg(s.used_k + b);
  if (s.block_table != nullptr) {
    r.pages = s.block_table + b * s.pages_per_seq;
    r.page_shift = s.page_shift;
  }
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
