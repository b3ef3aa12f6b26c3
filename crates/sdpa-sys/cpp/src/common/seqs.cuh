// Where one sequence's rows live in a call's tensors when a batch's sequences differ in length
// (FwdArgs' varlen and paged-cache fields): the offsets of its queries and keys, its lengths, and
// for a paged cache the pages of its keys. A kernel reads them once per CTA (seq_of) and a paged
// cache's K/V rows per copy (paged_row); for dense sequences every offset is 0 and the lengths
// the call's, so one code path serves both.
//
// The metadata's values are the caller's and unchecked unless the caller asked (the Rust side's
// checked mode): everything read from them is clamped here, so that no value makes a kernel
// address memory outside the call's tensors. Offsets lie in [0, rows of the packed tensor],
// lengths in [0, the call's longest and what the tensor holds past the offset], seqused_k in
// [0, the sequence's keys], pages in [0, pages of the cache).
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
  int page_shift;     // log2 page_size (a paged cache)
  int64_t page_rows;  // a paged cache: rows of K/V from one page's first to the next's
  int64_t pages;      // a paged cache: its pages
  int64_t total_q;    // rows of packed Q (0: dense): the LSE's head stride
  int64_t kv_rows;  // rows of packed K/V, or of a paged cache ((pages - 1) · page_rows + page_size)

  static SeqParams of(const FwdArgs& a) {
    const bool paged = a.seqs.page_size > 0;
    const int64_t page_rows = a.seqs.page_rows > 0 ? a.seqs.page_rows : a.seqs.page_size;
    SeqParams s{device_ptr<const int32_t>(a.seqs.cu_seqlens_q),
                device_ptr<const int32_t>(a.seqs.cu_seqlens_k),
                a.seqs.has_seqused_k ? device_ptr<const int32_t>(a.seqs.seqused_k) : nullptr,
                paged ? device_ptr<const int32_t>(a.seqs.block_table) : nullptr,
                a.seqs.pages_per_seq,
                0,
                page_rows,
                paged ? (a.seqs.kv_rows - a.seqs.page_size) / page_rows + 1 : 0,
                a.seqs.total_q,
                a.seqs.kv_rows};
    while ((int64_t(1) << s.page_shift) < a.seqs.page_size) ++s.page_shift;
    return s;
  }

  __host__ __device__ __forceinline__ bool paged() const { return block_table != nullptr; }

  // Block-table entry `i` (of sequence b's row, i < pages_per_seq), clamped into the cache's
  // pages.
  __device__ __forceinline__ int64_t page(int64_t b, int64_t i) const {
    return min(max(int64_t(__ldg(block_table + b * pages_per_seq + i)), int64_t(0)), pages - 1);
  }

  // The row of a paged cache holding key j of sequence b (j below the sequence's keys, which
  // seq_of keeps within its pages_per_seq pages), in K's (and V's) sequence dimension.
  __device__ __forceinline__ int64_t paged_row(int64_t b, int64_t j) const {
    return page(b, j >> page_shift) * page_rows + (j & ((int64_t(1) << page_shift) - 1));
  }
};

// One sequence: queries q0 .. q0 + seq_q of Q's (and O's) sequence dimension, keys k0 ..
// k0 + seq_k of packed or dense K/V (a paged cache: SeqParams::paged_row).
template <typename Index>
struct Seq {
  Index q0, k0, seq_q, seq_k;
};

// Rows [begin, end) of a packed tensor of `rows` rows from offsets cu[b], cu[b + 1]: clamped
// into the tensor, the end not before the begin, at most `longest` rows.
__device__ __forceinline__ void packed_span(const int32_t* cu, int64_t b, int64_t rows,
                                            int64_t longest, int64_t& begin, int64_t& len) {
  begin = min(max(int64_t(__ldg(cu + b)), int64_t(0)), rows);
  const int64_t end = min(max(int64_t(__ldg(cu + b + 1)), begin), rows);
  len = min(end - begin, longest);
}

// Sequence b's place, for a call whose longest sequences are seq_q and seq_k (for a paged cache,
// seq_k fits the sequence's pages: the host checks it).
template <typename Index>
__device__ __forceinline__ Seq<Index> seq_of(const SeqParams& s, int64_t b, Index seq_q,
                                             Index seq_k) {
  Seq<Index> r{0, 0, seq_q, seq_k};
  int64_t begin, len;
  if (s.cu_q != nullptr) {
    packed_span(s.cu_q, b, s.total_q, seq_q, begin, len);
    r.q0 = Index(begin);
    r.seq_q = Index(len);
  }
  if (s.cu_k != nullptr) {
    packed_span(s.cu_k, b, s.kv_rows, seq_k, begin, len);
    r.k0 = Index(begin);
    r.seq_k = Index(len);
  }
  if (s.used_k != nullptr)
    r.seq_k = Index(min(max(int64_t(__ldg(s.used_k + b)), int64_t(0)), int64_t(r.seq_k)));
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
