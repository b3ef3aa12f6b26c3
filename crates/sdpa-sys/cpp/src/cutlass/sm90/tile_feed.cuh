// The masked kernels' work tiles, handed to a persistent grid as its CTAs free up. Tiles differ
// tenfold in cost (a causal query tile sees as many key tiles as its index, and packed sequences
// differ in length); the scheduler orders them heaviest first, and a CTA that finishes takes the
// next from a global counter, which balances them greedily. Within a CTA the producer's TMA
// thread fetches each tile, works out its sequence and key tiles once (a packed sequence's are
// a scan of cu_seqlens and loads from global memory), and publishes that record in a two-slot
// ring in shared memory; the consumers and the non-finite V check read it from there, so every
// role walks the same tiles, and a reader keeps its slot until it is done with the tile (it
// reads the sequence from there where it needs it). The CTA then loads the next tile's Q and
// K/V while its consumers finish the last one, instead of a new CTA starting cold.
//
// The counter (FwdArgs::tile_counter: tiles handed out past the first wave, CTAs done) is zero
// when a call starts; the last CTA to run out of tiles sets it back to zero. Everything that
// touches it comes after the kernel's griddepcontrol.wait, so a call launched programmatically
// behind another on the same stream sees it reset. Without a counter the grid has one CTA a tile
// and each CTA runs its own tile alone.
#pragma once

#include <cstdint>

#include "cutlass/sm90/pipeline.cuh"
#include "cutlass/sm90/primitives.cuh"

namespace sdpa::cutlass_sm90 {

struct TileFeed {
  int32_t* counter;  // null: one tile a CTA
  int tiles;

  // The grid size, read where used (held across the producer's loop, it is what ptxas spills).
  __device__ __forceinline__ static int grid() {
    uint32_t n;
    asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(n));
    return int(n);
  }

  // The CTA's next work tile: its own block index first, then one from the counter; `tiles`
  // (none) once they are all handed out.
  __device__ __forceinline__ int fetch(bool first) const {
    if (first) return int(blockIdx.x);
    if (counter == nullptr) return tiles;
    const int t = grid() + atomicAdd(counter, 1);
    return t < tiles ? t : tiles;
  }

  // This CTA is out of tiles (its last fetch came back empty): the last CTA to get here resets
  // the counter. The fence orders this CTA's fetches before its count of the CTAs done, so the
  // reset comes after every fetch of the call.
  __device__ __forceinline__ void finish() const {
    if (counter == nullptr) return;
    __threadfence();
    if (atomicAdd(counter + 1, 1) == grid() - 1) {
      atomicExch(counter, 0);
      atomicExch(counter + 1, 0);
    }
  }

  // The feed's two slots (record k in slot k % 2): the producer's TMA thread writes, every other
  // role of the CTA reads.
  template <class Smem>
  __device__ __forceinline__ static Handoff<2> slots(Smem& sm) {
    return {sm.feed_full, sm.feed_empty};
  }
  // Record k's slot, a shared-memory address.
  template <class Smem>
  __device__ __forceinline__ static uint32_t slot_at(Smem& sm, int k) {
    return uint32_t(__cvta_generic_to_shared(&sm.feed_slot[Handoff<2>::slot(k)][0]));
  }

  // The producer's TMA thread: publishes record k (Rec::store) once every reader is done with
  // record k - 2. Returns its slot.
  template <class Smem, class Rec>
  __device__ __forceinline__ static uint32_t publish(Smem& sm, int k, const Rec& rec) {
    slots(sm).acquire(k);
    const uint32_t at = slot_at(sm, k);
    rec.store(at);
    slots(sm).commit(k);  // release: the record is visible to the waiters
    return at;
  }

  // A reader (a consumer or checking thread): waits for record k; returns its slot, which stays
  // the reader's until done(k).
  template <class Smem>
  __device__ __forceinline__ static uint32_t take(Smem& sm, int k) {
    slots(sm).wait(k);
    return slot_at(sm, k);
  }
  template <class Smem>
  __device__ __forceinline__ static void done(Smem& sm, int k) {
    slots(sm).release(k);
  }
};

}  // namespace sdpa::cutlass_sm90
