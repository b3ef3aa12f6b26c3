// Mask policies: which keys each query row sees, as types the kernels are templated on. Row i
// (of seq_q) sees keys [first_key(i), last_key(i)], always within [0, seq_k). A kernel asks a
// policy three things: the key range a block of rows sees (which key tiles it loads), whether a
// tile of keys may hold a masked score for a block of rows (where it must mask), and per row the
// visible keys (the masking itself). A new mask (a sliding window, top-left causal) is one more
// policy here and one more case in `dispatch_mask`; the kernels need no new branches as long as
// it keeps the property the non-finite V check relies on: the tiles partly masked for a block of
// rows are the last ones of its key range (`first_partial_tile`).
//
// The tile test and the per-row visibility also come by the mask alone, for keys below seq_k
// (`tile_hides`, `sees`), for a kernel that tests seq_k itself where that is cheaper or already
// known: tile_masked(m0, n0, bn) == n0 + bn > seq_k || tile_hides(m0, n0, bn), and for a key
// below seq_k, sees(row, key) == (first_key(row) <= key && key <= last_key(row)).
//
// What the plain tensor-core kernels (wmma, cutlass-sm80 but for its Band path) rely on besides:
// within the key range of its block, each row sees a prefix (first_key(row) <= key_begin(m0,
// rows)), so they mask scores with last_key alone, and the non-finite V check, which keeps the
// first non-finite key of each column of a tile, only answers "does the row see one" for the keys
// up to a last one. A mask with a lower edge inside the range (a sliding window) needs both to
// learn first_key. The scalar kernel asks `sees` per score and skips hidden keys in P·V: any
// policy.
//
// Band (a sliding window, top-left causal) has a lower edge too, so its tiles can be partly
// masked at both ends of a block's key range; it answers the tile tests only with the block's row
// count (`tile_hides(m0, rows, n0, bn)`), and `lower_partial_end` says where its lower partly
// masked tiles end. The kernels that take it (scalar, cutlass-sm90, cutlass-sm80) mask with both
// edges.
//
// A mask also applies itself to a tile of scores (`apply`): a kernel hands it a view of the tile
// (Tile below: each element's row and key within the tile, and a way to keep one range of a row's
// columns), and the mask hides the scores of keys their rows do not see, paying only on tiles its
// tile test says may hold one. NoMask and CausalBottomRight hide by last_key alone (each row sees a
// prefix of the block's key range); Band by both edges.
//
// Index is the kernel's row/key type: int where the kernel's 32-bit limits hold (its
// can_implement), int64_t where the kernel computes in 64 bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "common/check.cuh"
#include "sdpa/sdpa.h"

namespace sdpa::mask {

// What `apply` asks of a kernel's tile of scores (Tile): kRows x kCols elements as the kernel's
// threads hold them (compile-time counts), row(r) and col(r, c) each element's row and key
// within the tile, and keep(r, lo, hi), which hides (sets to -inf) the scores of row r whose
// column lies outside [lo, hi] (given within [-1, bn]). One thread's part of a tile is a Tile too.
// A row's kept columns are one range, so a tile can test each score against a mask of its row
// made once, instead of the row's two edges.

// Column x of a tile of bn keys (x relative to the tile's first key), clamped to [-1, bn]:
// every column beyond either end hides or keeps the same scores.
template <typename Index>
__device__ __forceinline__ int tile_column(Index x, Index bn) {
  return int(x < Index(-1) ? Index(-1) : (x > bn ? bn : x));
}

// Hides the scores of keys past a row's last key (prefix masks: NoMask, CausalBottomRight), for
// the bn keys from n0 of the rows from m0, where the mask's tile test says some may be.
template <class M, class Tile, typename Index>
__device__ __forceinline__ void apply_prefix(const M& mask, const Tile& t, Index m0, Index n0,
                                             Index bn) {
  if (!mask.tile_masked(m0, n0, bn)) return;
#pragma unroll
  for (int r = 0; r < Tile::kRows; ++r)
    t.keep(r, 0, tile_column(mask.last_key(m0 + t.row(r)) - n0, bn));
}

// Every key of the sequence, for every row.
template <typename Index = int>
struct NoMask {
  static constexpr bool kMasksKeys = false;  // no key below seq_k is ever hidden
  Index seq_q, seq_k;

  __host__ __device__ __forceinline__ Index first_key(Index /*row*/) const { return 0; }
  __host__ __device__ __forceinline__ Index last_key(Index /*row*/) const { return seq_k - 1; }
  // Keys [begin, end) some row of [m0, m0 + rows) sees; empty when end <= begin.
  __host__ __device__ __forceinline__ Index key_begin(Index /*m0*/, Index /*rows*/) const {
    return 0;
  }
  __host__ __device__ __forceinline__ Index key_end(Index /*m0*/, Index /*rows*/) const {
    return seq_k;
  }
  // Whether some score of rows from m0 and keys [n0, n0 + bn) is masked (only past seq_k here).
  __host__ __device__ __forceinline__ bool tile_masked(Index /*m0*/, Index n0, Index bn) const {
    return n0 + bn > seq_k;
  }
  // tile_masked by the mask alone (the seq_k bound aside): never here.
  __host__ __device__ __forceinline__ bool tile_hides(Index /*m0*/, Index /*n0*/,
                                                      Index /*bn*/) const {
    return false;
  }
  // The same for a block of `rows` rows (Band's form; rows change nothing here).
  __host__ __device__ __forceinline__ bool tile_hides(Index m0, Index /*rows*/, Index n0,
                                                      Index bn) const {
    return tile_hides(m0, n0, bn);
  }
  // Whether row `row` sees key `key`, for a key below seq_k.
  __host__ __device__ __forceinline__ bool sees(Index /*row*/, Index /*key*/) const { return true; }
  // The first key tile of width bn holding a key below seq_k that some row from m0 does not see;
  // the tiles from it to the end of the key range are the partly masked ones. None here: `none`.
  __host__ __device__ __forceinline__ int first_partial_tile(Index /*m0*/, Index /*bn*/,
                                                             int none) const {
    return none;
  }
  // The same mask for one sequence of a batch of different lengths.
  __host__ __device__ __forceinline__ NoMask rebased(Index sq, Index sk) const { return {sq, sk}; }
  // Hides the scores past seq_k of the tile of bn keys from n0 (rows from m0; `rows` unused).
  template <class Tile>
  __device__ __forceinline__ void apply(const Tile& t, Index m0, Index /*rows*/, Index n0,
                                        Index bn) const {
    apply_prefix(*this, t, m0, n0, bn);
  }
};

// Causal, aligned bottom-right: row i sees keys j <= i + seq_k - seq_q (the last query row sees
// every key; with seq_q > seq_k the first seq_q - seq_k rows see none).
template <typename Index = int>
struct CausalBottomRight {
  static constexpr bool kMasksKeys = true;
  Index seq_q, seq_k;

  __host__ __device__ __forceinline__ Index diagonal() const { return seq_k - seq_q; }
  __host__ __device__ __forceinline__ Index first_key(Index /*row*/) const { return 0; }
  __host__ __device__ __forceinline__ Index last_key(Index row) const {
    const Index last = row + diagonal();
    return last < seq_k - 1 ? last : seq_k - 1;
  }
  __host__ __device__ __forceinline__ Index key_begin(Index /*m0*/, Index /*rows*/) const {
    return 0;
  }
  // Up to the diagonal of the block's last real row.
  __host__ __device__ __forceinline__ Index key_end(Index m0, Index rows) const {
    const Index last_row = m0 + rows < seq_q ? m0 + rows : seq_q;
    const Index end = last_row + diagonal();
    return end < 0 ? 0 : (end < seq_k ? end : seq_k);
  }
  // Past seq_k, or past the first row's diagonal (the row that sees the fewest keys).
  __host__ __device__ __forceinline__ bool tile_masked(Index m0, Index n0, Index bn) const {
    return n0 + bn > seq_k || n0 + bn - 1 > m0 + diagonal();
  }
  // The tile's last key is past the first row's diagonal.
  __host__ __device__ __forceinline__ bool tile_hides(Index m0, Index n0, Index bn) const {
    return n0 + bn - 1 > m0 + diagonal();
  }
  __host__ __device__ __forceinline__ bool tile_hides(Index m0, Index /*rows*/, Index n0,
                                                      Index bn) const {
    return tile_hides(m0, n0, bn);
  }
  __host__ __device__ __forceinline__ bool sees(Index row, Index key) const {
    return key <= row + diagonal();
  }
  __host__ __device__ __forceinline__ int first_partial_tile(Index m0, Index bn, int none) const {
    if (seq_k - 1 <= m0 + diagonal()) return none;  // the first row sees every key
    const Index first_hidden = m0 + diagonal() + 1;
    return int((first_hidden > 0 ? first_hidden : 0) / bn);
  }
  __host__ __device__ __forceinline__ CausalBottomRight rebased(Index sq, Index sk) const {
    return {sq, sk};
  }
  // Hides the scores past each row's diagonal (or seq_k) of the tile of bn keys from n0.
  template <class Tile>
  __device__ __forceinline__ void apply(const Tile& t, Index m0, Index /*rows*/, Index n0,
                                        Index bn) const {
    apply_prefix(*this, t, m0, n0, bn);
  }
};

// A band of keys around each row's diagonal key i + diag: row i sees [i + diag - left,
// i + diag + right] within [0, seq_k). Sliding windows (diag = seq_k - seq_q, FlashAttention's
// window_size), top-left causal (diag = 0, left unbounded, right = 0), and, for the kernels'
// general path, causal and no mask too. left and right are clamped to seq_q + seq_k (every larger
// value sees the same keys), so the indices formed stay within 2 (seq_q + seq_k) of zero.
template <typename Index = int>
struct Band {
  static constexpr bool kMasksKeys = true;
  Index seq_q, seq_k, diag, left, right;
  bool top_left;  // diag is 0, not seq_k - seq_q, whatever the lengths (rebased)
  // Chunked attention (0: none): a row sees no key before its diagonal's chunk of `chunk`
  // keys. The lower edge stays non-decreasing in the row, which the tile tests rely on.
  Index chunk;

  // The lower edge before clamping at key 0 (below it for rows whose band starts there).
  __host__ __device__ __forceinline__ Index lower_edge(Index row) const {
    const Index f = row + diag - left;
    if (chunk <= 0 || row + diag < 0) return f;
    const Index c = (row + diag) / chunk * chunk;
    return c > f ? c : f;
  }
  __host__ __device__ __forceinline__ Index first_key(Index row) const {
    const Index f = lower_edge(row);
    return f > 0 ? f : 0;
  }
  __host__ __device__ __forceinline__ Index last_key(Index row) const {
    const Index l = row + diag + right;
    return l < seq_k - 1 ? l : seq_k - 1;
  }
  // From the first row's first key to the last real row's last key.
  __host__ __device__ __forceinline__ Index key_begin(Index m0, Index /*rows*/) const {
    const Index b = first_key(m0);
    return b < seq_k ? b : seq_k;
  }
  __host__ __device__ __forceinline__ Index key_end(Index m0, Index rows) const {
    const Index last_row = (m0 + rows < seq_q ? m0 + rows : seq_q) - 1;
    const Index end = last_row + diag + right + 1;
    return end < 0 ? 0 : (end < seq_k ? end : seq_k);
  }
  // Whether some row of [m0, m0 + rows) does not see some key of [n0, n0 + bn) below seq_k: a
  // key past the first row's last, or before the last row's first.
  __host__ __device__ __forceinline__ bool tile_hides(Index m0, Index rows, Index n0,
                                                      Index bn) const {
    const Index last_row = (m0 + rows < seq_q ? m0 + rows : seq_q) - 1;
    return n0 + bn - 1 > m0 + diag + right || n0 < lower_edge(last_row);
  }
  __host__ __device__ __forceinline__ bool tile_masked(Index m0, Index rows, Index n0,
                                                       Index bn) const {
    return n0 + bn > seq_k || tile_hides(m0, rows, n0, bn);
  }
  __host__ __device__ __forceinline__ bool sees(Index row, Index key) const {
    return key >= lower_edge(row) && key <= row + diag + right;
  }
  // The upper partly masked tiles: from the first tile holding a key below seq_k past the first
  // row's last key (`none` if there is none).
  __host__ __device__ __forceinline__ int first_partial_tile(Index m0, Index bn, int none) const {
    const Index hidden = m0 + diag + right + 1;  // the first row's first hidden key above
    if (hidden >= seq_k) return none;
    return int((hidden > 0 ? hidden : 0) / bn);
  }
  // The lower partly masked tiles: tiles [0, lower_partial_end) hold a key before the last real
  // row's first key (those below key_begin are not loaded at all).
  __host__ __device__ __forceinline__ int lower_partial_end(Index m0, Index rows, Index bn) const {
    const Index last_row = (m0 + rows < seq_q ? m0 + rows : seq_q) - 1;
    const Index first = first_key(last_row);
    return int((first + bn - 1) / bn);
  }
  // The band in another index type (a kernel that bounds the sizes to hold them in `int`).
  template <typename J>
  __host__ __device__ __forceinline__ Band<J> as() const {
    return {J(seq_q), J(seq_k), J(diag), J(left), J(right), top_left, J(chunk)};
  }
  // The same band for one sequence of a batch of different lengths: its diagonal moves with
  // them (left and right were clamped to the longest lengths, unbounded for this one too).
  __host__ __device__ __forceinline__ Band rebased(Index sq, Index sk) const {
    return {sq, sk, top_left ? Index(0) : sk - sq, left, right, top_left, chunk};
  }
  // Hides the scores outside each row's [first_key, last_key] of the tile of bn keys from n0,
  // for the `rows` rows from m0, where the tile test says some may be.
  template <class Tile>
  __device__ __forceinline__ void apply(const Tile& t, Index m0, Index rows, Index n0,
                                        Index bn) const {
    if (!tile_masked(m0, rows, n0, bn)) return;
#pragma unroll
    for (int r = 0; r < Tile::kRows; ++r) {
      const Index row = m0 + t.row(r);
      t.keep(r, tile_column(first_key(row) - n0, bn), tile_column(last_key(row) - n0, bn));
    }
  }
};

// Whether Mask is a Band: a kernel's general path.
template <class Mask>
struct IsBand : std::false_type {};
template <class Index>
struct IsBand<Band<Index>> : std::true_type {};
template <class Mask>
constexpr bool kIsBand = IsBand<Mask>::value;

// The band of a Window, Chunked or CausalTopLeft mask, or (for a kernel's general path) of
// NoMask and CausalBottomRight.
template <typename Index>
Band<Index> band_of(const FwdArgs& a) {
  const int64_t unbounded = a.dims.seq_q + a.dims.seq_k;
  const auto side = [&](int64_t x) { return x < 0 || x > unbounded ? unbounded : x; };
  int64_t diag = a.dims.seq_k - a.dims.seq_q, left = unbounded, right = unbounded, chunk = 0;
  switch (a.mask.kind) {
    case Mask::NoMask:
      break;
    case Mask::CausalBottomRight:
      right = 0;
      break;
    case Mask::CausalTopLeft:
      diag = 0;
      right = 0;
      break;
    case Mask::Window:
      left = side(a.mask.window_left);
      right = side(a.mask.window_right);
      break;
    case Mask::Chunked:
      right = 0;
      chunk = side(a.mask.chunk);
      break;
  }
  return {Index(a.dims.seq_q), Index(a.dims.seq_k), Index(diag),
          Index(left),         Index(right),        a.mask.kind == Mask::CausalTopLeft,
          Index(chunk)};
}

// Whether `a` needs a kernel's general path: a mask with a lower edge or a top-left diagonal,
// a softcap, ALiBi, or sequences of different lengths (whose masks move with each one's lengths).
inline bool needs_band(const FwdArgs& a) {
  return a.mask.kind == Mask::CausalTopLeft || a.mask.kind == Mask::Window ||
         a.mask.kind == Mask::Chunked || a.mods.softcap > 0.f || a.mods.alibi ||
         a.seqs.total_q > 0 || a.seqs.packed_kv || a.seqs.page_size > 0 || a.seqs.has_seqused_k;
}

// Whether a kernel instantiated for head dim D runs `a` on fewer columns than D (head_dim or
// head_dim_v below it): the kernels that can do so (api.cu's narrows_head_dims) do it on their
// general path only, so that their plain kernels keep every register.
inline bool narrowed(const FwdArgs& a, int64_t D) {
  return a.dims.head_dim != D || a.dims.head_dim_v != D;
}

// Calls f with the policy for `mask` (a value of the policy type, for seq_q and seq_k): where a
// backend's forward turns the runtime mask into the kernel's template argument.
template <typename Index, class F>
decltype(auto) dispatch_mask(Mask mask, Index seq_q, Index seq_k, F&& f) {
  switch (mask) {
    case Mask::NoMask:
      return std::forward<F>(f)(NoMask<Index>{seq_q, seq_k});
    case Mask::CausalBottomRight:
      return std::forward<F>(f)(CausalBottomRight<Index>{seq_q, seq_k});
    case Mask::CausalTopLeft:
    case Mask::Window:
    case Mask::Chunked:
      break;  // can_implement refuses them for the kernels that dispatch here
  }
  throw Error("this kernel runs no mask but causal bottom-right");
}

// dispatch_mask for the kernels with a general path: NoMask and CausalBottomRight as their own
// policies where `a` needs nothing else (needs_band, and not `general`), every other case as its
// Band.
template <typename Index, class F>
decltype(auto) dispatch_band(const FwdArgs& a, F&& f, bool general = false) {
  if (general || needs_band(a)) return std::forward<F>(f)(band_of<Index>(a));
  return dispatch_mask(a.mask.kind, Index(a.dims.seq_q), Index(a.dims.seq_k), std::forward<F>(f));
}

// The reason a band kernel with `bn`-key tiles cannot run `a`'s window or chunks ("" where it
// can): the non-finite V check's records of a partly masked tile answer only for rows whose
// visible keys there reach one of its ends, which a window at least a tile wide, and chunks of
// whole tiles, guarantee.
inline std::string narrow_window(const FwdArgs& a, int64_t bn, const char* kernel) {
  // Chunks that are whole tiles start every row's keys at a tile's first key.
  if (a.mask.kind == Mask::Chunked && a.mask.chunk < a.dims.seq_k && a.mask.chunk % bn != 0)
    return "chunks of " + std::to_string(a.mask.chunk) + " keys are not a multiple of the " +
           kernel + " kernel's " + std::to_string(bn) +
           "-key tile, which its non-finite V check needs (scalar runs them)";
  // Either side alone at least a tile wide answers before the sum is formed, so the sum of two
  // sides near INT64_MAX is never computed.
  if (a.mask.kind != Mask::Window || a.mask.window_left < 0 || a.mask.window_right < 0 ||
      a.mask.window_left >= bn || a.mask.window_right >= bn ||
      a.mask.window_left + a.mask.window_right + 1 >= bn)
    return "";
  return "a window of " + std::to_string(a.mask.window_left + a.mask.window_right + 1) +
         " keys (left + right + 1) is narrower than the " + kernel + " kernel's " +
         std::to_string(bn) + "-key tile, which its non-finite V check needs (scalar runs it)";
}

// The reason a kernel without a general path cannot run `a` ("" where it can), its name in
// the message.
inline std::string plain_only(const FwdArgs& a, const char* kernel) {
  if (needs_band(a))
    return std::string(kernel) +
           " runs no mask but causal bottom-right, and no softcap or ALiBi (scalar, cutlass and "
           "cutlass-sm80 run them)";
  if (a.out.has_lse) return std::string(kernel) + " does not write the log-sum-exp";
  if (a.mods.sinks)
    return std::string(kernel) + " has no sinks (scalar, cutlass and cutlass-sm80 run them)";
  return "";
}

}  // namespace sdpa::mask
