// The key tiles of a work tile: its sequence, whether it lies past the sequence's queries, its
// mask, which key tiles it sees in what order, where each lies in K's and V's TMA tensors, and
// which of them the non-finite V check takes. Every role of the CTA walks the same records of
// them: made once by the producer on the tile feed, by each role otherwise (TileWalk).
#pragma once

#include "common/mask.cuh"
#include "common/seqs.cuh"
#include "common/smem.cuh"
#include "cutlass/sm90/kernel_traits.cuh"

namespace sdpa::cutlass_sm90 {

// The key tiles of one query tile: how many it sees, and from which on they are partly masked
// (n_tiles where none is). A band's tiles start at `begin`, and its n_cross partly masked ones
// (n_upper across the diagonal, the rest across the lower edge) are visited first.
struct KeyTiles {
  int n_tiles, n_first;
  int begin, n_cross, n_upper;
};

// A work tile as every role walks it (TileWalk): which tile, its key tiles and its sequence;
// none() past its sequence's queries. On the tile feed the producer publishes it in a slot of
// 12 words in shared memory (store); a reader loads the tile and its key tiles (load) and reads
// the sequence from the slot where it needs it (load_seq), rather than holding it in registers.
struct TileRecord {
  WorkTile w;
  KeyTiles kt;
  Seq<int> seq;

  __device__ __forceinline__ bool none() const { return w.m_block < 0; }
  __device__ __forceinline__ static TileRecord end() {
    TileRecord r{};
    r.w.m_block = -1;
    return r;
  }
  __device__ __forceinline__ void store(uint32_t at) const {
    st_shared_128(at, make_uint4(w.m_block, w.h, w.b, kt.n_tiles));
    st_shared_128(at + 16, make_uint4(kt.n_first, kt.begin, kt.n_cross, kt.n_upper));
    st_shared_128(at + 32, make_uint4(seq.q0, seq.k0, seq.seq_q, seq.seq_k));
  }
  // The tile and its key tiles (the sequence left zero).
  __device__ __forceinline__ static TileRecord load(uint32_t at) {
    const uint4 a = ld_shared_128(at), b = ld_shared_128(at + 16);
    TileRecord r{};
    r.w = {int(a.x), int(a.y), int(a.z)};
    r.kt = {int(a.w), int(b.x), int(b.y), int(b.z), int(b.w)};
    return r;
  }
  __device__ __forceinline__ static Seq<int> load_seq(uint32_t at) {
    const uint4 c = ld_shared_128(at + 32);
    return {int(c.x), int(c.y), int(c.z), int(c.w)};
  }
};

template <class E, int D, class Mask>
struct TileKeys {
  using T = KernelTraits<E, D, Mask>;
  using Params = typename T::Params;
  using Seqs = typename T::Seqs;
  static constexpr int BN = T::BN;
  static constexpr bool kBand = T::kBand;
  static_assert(sizeof(TileRecord) == sizeof(T::Smem::feed_slot[0]),
                "the feed's slot holds one TileRecord");

  // Work tile t's record: its place, its sequence and, where it has queries, its key tiles.
  __device__ __forceinline__ static TileRecord record(const Params& p,
                                                      const typename T::Sched::Params& sp, int t) {
    TileRecord r{};
    r.w = T::Sched::decode(sp, t);
    const int bm = 64 * sp.wgs, m0 = r.w.m_block * bm;
    r.seq = Seqs::of(p, r.w);
    if (Seqs::past_end(r.seq, m0)) return TileRecord::end();
    r.kt = key_tiles(p, r.seq, m0, bm);
    return r;
  }
  // Work tile w's sequence, where a role needs it: on the feed from the record's slot `at`
  // (packed sequences: one shared-memory read instead of loads from global memory), otherwise
  // from the layout.
  __device__ __forceinline__ static Seq<int> seq(const Params& p, const WorkTile& w, uint32_t at) {
    if constexpr (T::kFeed && kBand)
      return TileRecord::load_seq(at);
    else
      return Seqs::of(p, w);
  }

  // The mask of one sequence (the band rebased to its lengths: the call's own for dense ones).
  __device__ __forceinline__ static Mask mask_of(const Params& p, const Seq<int>& seq) {
    if constexpr (kBand)
      return Mask{p.seq_q, p.seq_k, p.diag, p.left, p.right, p.top_left != 0, p.chunk}.rebased(
          seq.seq_q, seq.seq_k);
    else
      return Mask{seq.seq_q, seq.seq_k};
  }

  // The key tiles of the query tile of `rows` rows from m0 of sequence `seq`.
  __device__ __forceinline__ static KeyTiles key_tiles(const Params& p, const Seq<int>& seq, int m0,
                                                       int rows) {
    const Mask mask = mask_of(p, seq);
    if constexpr (kBand) {
      const int begin = mask.key_begin(m0, rows) / BN;
      const int end = max(begin, (mask.key_end(m0, rows) + BN - 1) / BN);
      int upper = max(begin, min(end, mask.first_partial_tile(m0, BN, end)));
      // A last tile that runs past the sequence's keys holds rows TMA does not zero where the K/V
      // tensors go on (packed, paged or seqused_k): it is partly masked, and checked, too.
      if (Seqs::foreign_tail(p) && end > begin && end * BN > mask.seq_k)
        upper = min(upper, end - 1);
      const int lower = max(begin, min(upper, mask.lower_partial_end(m0, rows, BN)));
      return {end - begin, upper, begin, (end - upper) + (lower - begin), end - upper};
    } else {
      const int n_tiles = (mask.key_end(m0, rows) + BN - 1) / BN;
      return {n_tiles, mask.first_partial_tile(m0, BN, n_tiles), 0, 0, 0};
    }
  }

  // The key tile of a query tile's i-th ring use. Masked query tiles walk their keys from the
  // last: the (at most two) partly masked tiles, which the non-finite V check holds back, come
  // first, and their check runs while the consumers compute the first S = Q·Kᵀ and softmax
  // instead of sitting between the last V load and the last P·V. (The online softmax does not
  // depend on the order; rows that see nothing of the first tiles keep m = -inf and p = 0 until
  // they do.) A band visits its upper partly masked tiles from the last, then its lower ones,
  // then the rest from the last.
  __device__ __forceinline__ static int key_tile(int i, const KeyTiles& kt) {
    if constexpr (kBand) {
      const int end = kt.begin + kt.n_tiles;
      if (i < kt.n_upper) return end - 1 - i;
      if (i < kt.n_cross) return kt.begin + (i - kt.n_upper);
      return end - 1 - kt.n_upper - (i - kt.n_cross);
    } else {
      return Mask::kMasksKeys ? kt.n_tiles - 1 - i : i;
    }
  }

  // Whether a query tile's i-th ring use hides no key from any of its rows, so that its scores
  // need no mask: a band's uses past its partly masked ones, save the last key tile where it
  // comes first among them (no upper partly masked tile), which may run past the sequence's keys
  // (key_tiles counts it as partly masked only where the rows past them are another sequence's).
  __device__ __forceinline__ static bool unmasked_use(int i, const KeyTiles& kt) {
    return kBand && i >= kt.n_cross + (kt.n_upper == 0 ? 1 : 0);
  }

  // How many of a query tile's first ring uses the non-finite V check takes (partly masked).
  __device__ __forceinline__ static int checked_uses(const KeyTiles& kt) {
    if constexpr (kBand)
      return kt.n_cross;
    else
      return max(0, kt.n_tiles - kt.n_first);
  }
};

}  // namespace sdpa::cutlass_sm90
