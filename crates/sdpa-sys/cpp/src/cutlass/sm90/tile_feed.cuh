// The masked kernels' work tiles, handed to a persistent grid as its CTAs free up. Tiles differ
// tenfold in cost (a causal query tile sees as many key tiles as its index, and packed sequences
// differ in length); the scheduler orders them heaviest first, and a CTA that finishes takes the
// next from a global counter, which balances them greedily. Within a CTA the producer's TMA
// thread fetches each tile and publishes it in a two-slot ring in shared memory; the consumers
// and the non-finite V check read it from there, so every role walks the same tiles. The CTA
// then loads the next tile's Q and K/V while its consumers finish the last one, instead of a new
// CTA starting cold.
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

  // Work tile k of this CTA: its own block index first, then one from the counter; `tiles`
  // (none) once they are all handed out.
  __device__ __forceinline__ int fetch(int k) const {
    if (k == 0) return int(blockIdx.x);
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

  // The feed's two slots (tile k in slot k % 2): the producer's TMA thread writes, every other
  // role of the CTA reads.
  template <class Smem>
  __device__ __forceinline__ static Handoff<2> slots(Smem& sm) {
    return {sm.feed_full, sm.feed_empty};
  }

  // The producer's TMA thread: fetches work tile k and publishes it in its slot once every
  // reader has taken tile k - 2 from there. Returns it (`tiles`: none; the CTA is done).
  template <class Smem>
  __device__ __forceinline__ int publish(Smem& sm, int k) const {
    const int t = fetch(k);
    slots(sm).acquire(k);
    st_shared(uint32_t(__cvta_generic_to_shared(&sm.feed_tile[Handoff<2>::slot(k)])), uint32_t(t));
    slots(sm).commit(k);  // release: the tile's value is visible to the waiters
    if (t >= tiles) finish();
    return t;
  }

  // A reader (a consumer or checking thread): work tile k, from the producer's slot.
  template <class Smem>
  __device__ __forceinline__ static int take(Smem& sm, int k) {
    slots(sm).wait(k);
    const int t =
        int(ld_shared_32(uint32_t(__cvta_generic_to_shared(&sm.feed_tile[Handoff<2>::slot(k)]))));
    slots(sm).release(k);
    return t;
  }
};

}  // namespace sdpa::cutlass_sm90
