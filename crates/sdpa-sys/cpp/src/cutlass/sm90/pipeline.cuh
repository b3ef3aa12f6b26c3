// The mbarrier pipelines of the sm_90a kernel: the K/V ring (stages the producer's TMA fills and
// the consumers release), the non-finite V check's detour on the V ring, and the one- and two-slot
// hand-overs (Q, the tile feed, the check's records). Each type owns its barriers' phases: a
// role says which use of a pipeline it is at, and the type says which barrier and phase that is.
// A barrier's phase flips at each completion, so a waiter names the phase it waits for.
#pragma once

#include <cutlass/arch/barrier.h>

#include <cstdint>

namespace sdpa::cutlass_sm90 {

using Bar = cutlass::arch::ClusterTransactionBarrier;

// Use u of a ring of S stages (uses count up from 0 over the whole kernel): stage u % S, the
// (u / S)-th time that stage is filled.
template <int S>
struct PipelineState {
  int u;

  __device__ __forceinline__ int stage() const { return u % S; }
  // The phase a consumer waits for on the stage's full barrier.
  __device__ __forceinline__ uint32_t full_phase() const { return (u / S) & 1; }
  // As full_phase, where the first use of each of stages [0, diverted) completed on another
  // barrier instead (the non-finite V check's): this stage's full barrier then runs one behind.
  __device__ __forceinline__ uint32_t full_phase_after(int diverted) const {
    return ((u / S) - (stage() < diverted ? 1 : 0)) & 1;
  }
  // As full_phase_after, where the first `diverted` uses (any number) completed on another
  // barrier: this stage's full barrier runs as many phases behind as those uses it held.
  __device__ __forceinline__ uint32_t full_phase_after_uses(int diverted) const {
    return ((u / S) - (diverted + S - 1 - stage()) / S) & 1;
  }
  // Whether the producer must wait for the stage to be released before filling it (use u - S
  // was on it), and the phase of that release on the stage's empty barrier.
  __device__ __forceinline__ bool reuses() const { return u >= S; }
  __device__ __forceinline__ uint32_t empty_phase() const { return ((u / S) + 1) & 1; }
};

// A ring of S stages: full[s] completes when stage s holds its data (TMA's bytes, or a count of
// arrivals), empty[s] when its readers are done with it.
template <int S>
struct Ring {
  uint64_t* full;
  uint64_t* empty;

  // Producer: waits until the stage of `use` is free (its use - S released).
  __device__ __forceinline__ void acquire(const PipelineState<S>& use) const {
    if (use.reuses()) Bar::wait(&empty[use.stage()], use.empty_phase());
  }
  // Producer: the stage's full barrier, expecting `bytes` of TMA (the copy completes it).
  __device__ __forceinline__ uint64_t& expect(const PipelineState<S>& use, uint32_t bytes) const {
    uint64_t& bar = full[use.stage()];
    Bar::arrive_and_expect_tx(&bar, bytes);
    return bar;
  }
  // Producer counted in arrivals (the converting warps): the stage is filled.
  __device__ __forceinline__ void commit(const PipelineState<S>& use) const {
    Bar::arrive(&full[use.stage()]);
  }
  // Consumer: waits until the stage of `use` is filled.
  __device__ __forceinline__ void wait(const PipelineState<S>& use) const {
    Bar::wait(&full[use.stage()], use.full_phase());
  }
  // Consumer: done with the stage.
  __device__ __forceinline__ void release(const PipelineState<S>& use) const {
    Bar::arrive(&empty[use.stage()]);
  }
};

// Phases of a set of barriers tracked one bit each, for barriers whose completions do not follow
// from a use count (the V ring's stages where only some uses take a barrier).
struct PhaseBits {
  uint32_t bits = 0;

  // Waits on `bar`, tracked in bit `bit`, and flips that bit.
  __device__ __forceinline__ void wait(uint64_t& bar, int bit) {
    Bar::wait(&bar, (bits >> bit) & 1);
    bits ^= 1u << bit;
  }
};

// How the V ring's phases follow from its uses where the non-finite V check diverts some of them
// (the partly masked tiles, a query tile's first ring uses: TileKeys::key_tile) from full[s]
// onto landed[s], and then onto checked[s] once checked.
enum class VCheck {
  kNone,         // no check: every use completes full[s]
  kOneTile,      // one query tile a CTA, at most one checked use a stage
  kOneTileMany,  // one query tile a CTA, any number of checked uses
  kTracked,      // query tiles walked from the feed: each barrier's phase tracked (PhaseBits)
};

// The V ring with the non-finite V check's detour.
template <int S, VCheck kCheck>
struct VRing {
  Ring<S> ring;       // full: V landed (unchecked uses) or converted; empty: released
  uint64_t* landed;   // checked uses: V landed, for the check
  uint64_t* checked;  // checked uses: V checked, for the consumers

  // Producer: the barrier the TMA copy of `use` completes, expecting `bytes`: landed[s] for a
  // use the check takes.
  __device__ __forceinline__ uint64_t& expect(const PipelineState<S>& use, bool to_check,
                                              uint32_t bytes) const {
    uint64_t& bar =
        kCheck != VCheck::kNone && to_check ? landed[use.stage()] : ring.full[use.stage()];
    Bar::arrive_and_expect_tx(&bar, bytes);
    return bar;
  }

  // The check: waits until V of a checked `use` has landed (phases: bit s of `ph` where tracked).
  __device__ __forceinline__ void wait_landed(const PipelineState<S>& use, PhaseBits& ph) const {
    if constexpr (kCheck == VCheck::kTracked)
      ph.wait(landed[use.stage()], use.stage());
    else
      Bar::wait(&landed[use.stage()], use.full_phase());
  }
  // The check: done with a checked use.
  __device__ __forceinline__ void commit_checked(const PipelineState<S>& use) const {
    Bar::arrive(&checked[use.stage()]);
  }

  // Consumer: waits for V of a query tile's i-th use, `use` of the ring, of which the first
  // n_checked uses the check takes (tracked: bit s of `ph` for full[s], S + s for checked[s]).
  __device__ __forceinline__ void wait(int i, const PipelineState<S>& use, int n_checked,
                                       PhaseBits& ph) const {
    const int s = use.stage();
    if constexpr (kCheck == VCheck::kTracked) {
      const bool c = i < n_checked;
      ph.wait(c ? checked[s] : ring.full[s], c ? S + s : s);
    } else if constexpr (kCheck == VCheck::kOneTileMany) {
      // Each stage's barriers count its own checked uses.
      if (i < n_checked)
        Bar::wait(&checked[s], use.full_phase());
      else
        Bar::wait(&ring.full[s], use.full_phase_after_uses(n_checked));
    } else if constexpr (kCheck == VCheck::kOneTile) {
      if (i < n_checked)
        Bar::wait(&checked[s], 0);
      else
        Bar::wait(&ring.full[s], use.full_phase_after(n_checked));
    } else {
      ring.wait(use);
    }
  }
};

// A hand-over through N (1 or 2) slots: hand-over n (n = 0, 1, ...) goes through slot n % N,
// whose full barrier the writer completes and whose empty barrier the readers complete.
template <int N>
struct Handoff {
  static_assert(N == 1 || N == 2);
  static constexpr int kShift = N == 2 ? 1 : 0;  // n / N
  uint64_t* full;
  uint64_t* empty;

  __device__ __forceinline__ static int slot(int n) { return n & (N - 1); }
  // Writer: waits until the readers are done with hand-over n - N.
  __device__ __forceinline__ void acquire(int n) const {
    if (n >= N) Bar::wait(&empty[slot(n)], ((n >> kShift) - 1) & 1);
  }
  // Writer: hand-over n's full barrier, expecting `bytes` of TMA.
  __device__ __forceinline__ uint64_t& expect(int n, uint32_t bytes) const {
    uint64_t& bar = full[slot(n)];
    Bar::arrive_and_expect_tx(&bar, bytes);
    return bar;
  }
  // Writer counted in arrivals: hand-over n is written (a release: visible to the waiters).
  __device__ __forceinline__ void commit(int n) const { Bar::arrive(&full[slot(n)]); }
  // Reader: waits for hand-over n.
  __device__ __forceinline__ void wait(int n) const {
    Bar::wait(&full[slot(n)], (n >> kShift) & 1);
  }
  // Reader: done with hand-over n.
  __device__ __forceinline__ void release(int n) const { Bar::arrive(&empty[slot(n)]); }
};

}  // namespace sdpa::cutlass_sm90
