// Which work tiles (query tile, head, batch) each CTA of the sm_90a kernel runs, in what order,
// and how large the grid is. Every role of a CTA walks the same sequence.
#pragma once

#include <algorithm>

#include "cutlass/sm90/primitives.cuh"
#include "cutlass/sm90/tile_feed.cuh"

namespace sdpa::cutlass_sm90 {

// Query tile m_block (-1: none, a CTA past the last tile of packed sequences) of head h,
// sequence b.
struct WorkTile {
  int m_block, h, b;
};

// Tiles of 64 * wgs query rows. Unmasked: a persistent grid of at most one CTA per SM, each
// taking tiles blockIdx.x, blockIdx.x + gridDim.x, ...; the query tiles of one head are
// neighbours, so the CTAs running at once share that head's K/V in L2. Masked (kVaries: tiles
// differ in cost, query tile m seeing about m + 1 key tiles): heads one after another, each
// heaviest tile first (L2 locality as above), except the (batch, head) pairs from tail_bh on,
// which are interleaved heaviest first, so that the tiles handed out last are the cheap ones;
// one CTA per tile (a static persistent split cannot balance the uneven tiles; measured:
// docs/log/2026-11-notebook.md, the sm90 tuning log), or, with a
// counter (the 16-bit kernels up to D = 128), a persistent grid that takes them in this order as
// CTAs free up (tile_feed.cuh).
//
// Packed Q (varlen; masked kernels alone run it): the host knows total_q but not the lengths, so
// the grid covers heads x (ceil(total_q / rows) + batch) tiles, at least every sequence's; tile
// r of each head walks the sequences in order, each one's tiles heaviest (last) first, with the
// heads of a tile next to each other (a GQA group's CTAs share their K/V in L2); the CTAs past
// the last tile end at once. A tile's sequence is a scan of cu_seqlens_q (TileKeys::record: on
// the feed the producer's alone).
template <bool kVaries>
struct TileScheduler {
  // 32-bit tile numbers: can_implement (sm90_fwd.cuh) keeps ceil(seq_q / 128) x batch x heads
  // <= 2^30 (tiles, and t + gridDim.x in the tile loops).
  struct Params {
    int wgs;       // consumer warpgroups in this launch (1, or the kernel's 2 or 3); tiles of
                   // 64 * wgs rows
    int m_blocks;  // query tiles per (batch, head)
    int tiles;     // m_blocks * heads * batch
    int heads;
    int tail_bh;  // kVaries: the first (batch, head) pair of the interleaved tail group
    FastDiv div_m_blocks, div_heads, div_tail;  // div_tail: by bh - tail_bh
    FastDiv div_rows;                           // by the tile's rows, 64 * wgs
    const int32_t* cu_q;                        // packed Q: cu_seqlens_q (else null)
    int batch;                                  // packed Q: the sequences
    // kVaries: the counter a persistent grid hands tiles out with (tile_feed.cuh); null: one
    // CTA a tile.
    int32_t* counter;
  };

  // 64-row tiles when tiles of the kernel's rows (64 * max_wgs) would leave more than half the
  // SMs idle: more CTAs to spread a small problem's latency over (measured:
  // docs/log/2026-11-notebook.md, the sm90 tuning log). Where one head's heaviest tile would
  // overrun the rest of the work by more than 0.12 of an SM's share (in per-head order it starts
  // when about one head's work, m_blocks^2 / 2 tiles, is left to all SMs, and overruns the rest by
  // about m_blocks - m_blocks^2 / (2 sms), against bh m_blocks^2 / (2 sms) per SM in all), the last
  // `tail` heads are interleaved, just enough of them that their work per SM outlasts the heaviest
  // tile twice: tail m_blocks^2 / 2 >= 2 sms m_blocks. Below that threshold the interleaved heads'
  // K/V crowd L2 and cost more than the overrun they save (the threshold and the tail's size:
  // measured, the same log). total_q > 0: packed Q with offsets cu_q.
  static Params make(int64_t seq_q, int64_t heads, int64_t batch, int sms, int max_wgs,
                     int64_t total_q, const int32_t* cu_q) {
    Params p{};
    const int bh = int(heads * batch);
    const int max_rows = 64 * max_wgs;
    if (kVaries && total_q > 0) {
      const auto tiles_of = [&](int rows) { return int((total_q + rows - 1) / rows + batch); };
      p.wgs = 2 * tiles_of(max_rows) * heads <= sms ? 1 : max_wgs;
      p.m_blocks = tiles_of(64 * p.wgs);  // tiles a head, at most
      p.tiles = p.m_blocks * int(heads);
      p.heads = int(heads);
      p.tail_bh = bh;
      p.div_m_blocks = FastDiv(p.m_blocks);
      p.div_heads = FastDiv(p.heads);
      p.div_tail = FastDiv(1);
      p.div_rows = FastDiv(64 * p.wgs);
      p.cu_q = cu_q;
      p.batch = int(batch);
      return p;
    }
    const int tiles_max = int((seq_q + max_rows - 1) / max_rows) * bh;
    p.wgs = 2 * tiles_max <= sms ? 1 : max_wgs;
    p.m_blocks = int((seq_q + 64 * p.wgs - 1) / (64 * p.wgs));
    p.tiles = p.m_blocks * bh;
    p.heads = int(heads);
    int tail = 0;
    if (kVaries) {
      const double nb = p.m_blocks, per_sm = bh * nb * nb / (2.0 * sms);
      if (nb - nb * nb / (2.0 * sms) > 0.12 * per_sm)
        tail = std::min(bh, std::max(1, (4 * sms + p.m_blocks - 1) / p.m_blocks));
    }
    p.tail_bh = bh - tail;
    p.div_m_blocks = FastDiv(p.m_blocks);
    p.div_heads = FastDiv(p.heads);
    p.div_tail = FastDiv(std::max(1, tail));
    p.div_rows = FastDiv(64 * p.wgs);
    return p;
  }

  static int grid_size(const Params& p, int sms) {
    return kVaries && p.counter == nullptr ? p.tiles : std::min(p.tiles, sms);
  }

  __device__ __forceinline__ static WorkTile decode(const Params& p, int t) {
    if (kVaries && p.cu_q != nullptr) return decode_packed(p, t);
    const int nb = p.m_blocks;
    int bh, m_block;
    if (!kVaries) {
      bh = p.div_m_blocks.div(t);
      m_block = t - bh * nb;
    } else if (t < p.tail_bh * nb) {
      bh = p.div_m_blocks.div(t);
      m_block = nb - 1 - (t - bh * nb);
    } else {
      const int r = t - p.tail_bh * nb, q = p.div_tail.div(r);
      m_block = nb - 1 - q;
      bh = p.tail_bh + (r - q * p.div_tail.d);
    }
    const int b = p.div_heads.div(bh);
    return {m_block, bh - b * p.heads, b};
  }

  // Packed Q: tile r of head h is the sequence's tile its running count of tiles reaches.
  __device__ __forceinline__ static WorkTile decode_packed(const Params& p, int t) {
    const int r = p.div_heads.div(t), h = t - r * p.heads;
    int seen = 0, start = __ldg(p.cu_q);
    for (int b = 0; b < p.batch; ++b) {
      const int end = __ldg(p.cu_q + b + 1);
      const int n = p.div_rows.div(end - start + p.div_rows.d - 1);
      if (r < seen + n) return {seen + n - 1 - r, h, b};
      seen += n;
      start = end;
    }
    return {-1, h, 0};
  }
};

// How the roles of a CTA walk its work tiles, all in the same order. make(t) is work tile t's
// record (Rec: TileKeys::record, its place, sequence and key tiles; none() for a tile past its
// sequence's queries, which no role runs); f(rec, at) runs a tile (a return from f goes on to
// the next), `at` the record's slot in shared memory on the feed (0 otherwise). On the feed
// (kFeed: the masked kernels with a persistent grid, tile_feed.cuh) the producer's TMA thread
// fetches each tile, makes its record and publishes it, and every other role reads the tile's
// place and key tiles from the slot (Rec::load) and keeps the slot until f returns; otherwise
// each role walks the tiles statically, blockIdx.x, blockIdx.x + gridDim.x, ... (kOneTile: the
// first alone), making each record itself. A role whose tile body was a loop body passes it as
// a lambda marked __attribute__((always_inline)): inlined late, as an ordinary lambda is, it is
// optimized apart from its surroundings, and the consumers' and the check's code comes out
// otherwise than as a loop body (the producer's loads were a lambda already).
template <bool kFeed, bool kOneTile>
struct TileWalk {
  // The producer's TMA thread, which issues the tiles. kGridEachTile: the grid size re-read at
  // each step of the static walk (held in a register across the loop, it is the one value ptxas
  // spills where the thread has 24 registers and e4m3 V to load into its own ring).
  template <bool kGridEachTile, class SP, class Smem, class Make, class F>
  __device__ __forceinline__ static void issue(const SP& sp, Smem& sm, Make&& make, F&& f) {
    using Rec = decltype(make(0));
    if constexpr (kFeed) {
      // The feed's index lives in shared memory: in a register across the loop it is what
      // ptxas spills first at D >= 192.
      const uint32_t k_at = uint32_t(__cvta_generic_to_shared(&sm.feed_next));
      st_shared(k_at, 0u);
      const TileFeed feed{sp.counter, sp.tiles};
      for (;;) {
        const int k = int(ld_shared_32(k_at));
        st_shared(k_at, uint32_t(k + 1));
        // The next tile with queries (none: the CTA is done).
        Rec rec = Rec::end();
        for (bool first = k == 0;; first = false) {
          const int t = feed.fetch(first);
          if (t >= sp.tiles) break;
          rec = make(t);
          if (!rec.none()) break;
        }
        const uint32_t at = TileFeed::publish(sm, k, rec);
        if (rec.none()) {
          feed.finish();
          break;
        }
        f(rec, at);
      }
    } else {
      const auto stride = [] {
        uint32_t n = gridDim.x;
        if constexpr (kGridEachTile) asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(n));
        return int(n);
      };
      for (int t = blockIdx.x; t < sp.tiles; t += stride()) {
        const Rec rec = make(t);
        if (!rec.none()) f(rec, 0u);
        if constexpr (kOneTile) break;
      }
    }
  }

  // Every other role: the tiles the TMA thread issues.
  template <class SP, class Smem, class Make, class F>
  __device__ __forceinline__ static void follow(const SP& sp, Smem& sm, Make&& make, F&& f) {
    using Rec = decltype(make(0));
    if constexpr (kFeed) {
      for (int k = 0;; ++k) {
        const uint32_t at = TileFeed::take(sm, k);
        const Rec rec = Rec::load(at);
        if (rec.none()) break;  // nothing is published after it: its slot is not handed back
        f(rec, at);
        TileFeed::done(sm, k);
      }
    } else {
      for (int t = blockIdx.x; t < sp.tiles; t += int(gridDim.x)) {
        const Rec rec = make(t);
        if (!rec.none()) f(rec, 0u);
        if constexpr (kOneTile) break;
      }
    }
  }
};

}  // namespace sdpa::cutlass_sm90
