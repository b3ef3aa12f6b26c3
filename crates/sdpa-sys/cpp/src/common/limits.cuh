// The pieces the backends' can_implement (one in each kernel header) are made of: each returns
// the reason a kernel cannot take a problem or a device, or "" where it can. The numbers they
// are given (tile sizes, shared memory) are the kernel's own constants.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "sdpa/sdpa.h"

namespace sdpa::limits {

// Largest value of a C `int`, in which the kernels hold some counts and indices.
constexpr int64_t kIntMax = INT32_MAX;
// Largest grid y and z dimension of a launch.
constexpr int64_t kGridYZMax = 65535;

// The first non-empty reason, or "".
inline std::string first(std::initializer_list<std::string> reasons) {
  for (const std::string& r : reasons)
    if (!r.empty()) return r;
  return "";
}

inline std::string cc(const DeviceInfo& dev) {
  return std::to_string(dev.cc_major) + "." + std::to_string(dev.cc_minor);
}

// A kernel of head dim D that reads a problem's own columns only (mask::narrowed): both head
// dims in whole 16-byte chunks of 16-bit elements, and at most D.
inline std::string narrowed_head_dims(const FwdArgs& a, int64_t D) {
  if (a.dims.head_dim % 8 == 0 && a.dims.head_dim_v % 8 == 0 && a.dims.head_dim <= D &&
      a.dims.head_dim_v <= D)
    return "";
  return "head_dim " + std::to_string(a.dims.head_dim) + " and head_dim_v " +
         std::to_string(a.dims.head_dim_v) + " must be multiples of 8 and at most the instance's " +
         std::to_string(D);
}

// The kernels on mma.sync, wmma, cp.async and bf16 arithmetic: sm_80 and newer.
inline std::string sm80_or_newer(const DeviceInfo& dev) {
  if (!known(dev) || dev.cc_major >= 8) return "";
  return "needs compute capability 8.0 or newer, the GPU has " + cc(dev);
}

// `bytes` of dynamic shared memory per block (up to 48 KB every sm_80+ part gives without
// opting in; above, what dev.smem_optin_per_block allows).
inline std::string smem_per_block(const DeviceInfo& dev, int64_t bytes) {
  if (!known(dev) || bytes <= 48 * 1024 || bytes <= dev.smem_optin_per_block) return "";
  return "needs " + std::to_string(bytes) +
         " bytes of shared memory per block, the device offers " +
         std::to_string(dev.smem_optin_per_block);
}

// A grid of (query tiles of `rows` rows, heads, batch): each CTA finds its (batch, head) in
// blockIdx.z and .y.
inline std::string grid_of_query_tiles(const FwdArgs& a, int64_t rows) {
  if (a.dims.heads > kGridYZMax || a.dims.batch > kGridYZMax)
    return "batch (" + std::to_string(a.dims.batch) + ") and heads (" +
           std::to_string(a.dims.heads) + ") must each be at most 65535 (grid z and y)";
  const int64_t tiles = (a.dims.seq_q + rows - 1) / rows;
  if (tiles > kIntMax)
    return "seq_q = " + std::to_string(a.dims.seq_q) + " makes " + std::to_string(tiles) +
           " query tiles of " + std::to_string(rows) + " rows; grid x allows 2^31 - 1";
  return "";
}

// seq_q and seq_k (and the rows of packed Q, of packed or paged K/V, the block table's entries)
// held as `int`, with row and key indices formed up to one tile of `tile` rows or keys past them
// (tile start + tile size, last row + the causal offset), also in `int`.
inline std::string int_sequences(const FwdArgs& a, const char* kernel, int64_t tile) {
  for (const auto& [what, n] :
       {std::pair{"seq_q", a.dims.seq_q}, std::pair{"seq_k", a.dims.seq_k},
        std::pair{"total_q", a.seqs.total_q},
        std::pair{"the rows of packed or paged K/V", a.seqs.kv_rows},
        std::pair{"the block table's entries",
                  a.seqs.page_size > 0 ? a.dims.batch * a.seqs.pages_per_seq : 0}})
    if (n > kIntMax - (tile - 1))
      return std::string(what) + " = " + std::to_string(n) + " exceeds 2^31 - " +
             std::to_string(tile) + ": the " + kernel +
             " kernel indexes rows and keys, up to a tile past the end, in 32-bit int";
  return "";
}

// Whether `a`'s sequences are dense: no packed Q or K/V, paged cache or seqused_k.
inline bool dense(const FwdArgs& a) {
  return a.seqs.total_q == 0 && !a.seqs.packed_kv && a.seqs.page_size == 0 && !a.seqs.has_seqused_k;
}

// Dense sequences only.
inline std::string dense_sequences(const FwdArgs& a, const char* kernel) {
  if (dense(a)) return "";
  return std::string(kernel) +
         " runs dense sequences only, no packed (varlen) Q or K/V, paged cache or seqused_k "
         "(scalar runs them)";
}

}  // namespace sdpa::limits
