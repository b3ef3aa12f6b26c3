// Position in a ring of shared-memory stages guarded by mbarriers (the K/V ring of the sm_90a
// kernel). Each stage has a "full" barrier the producer's TMA completes and an "empty" barrier
// the consumers arrive on once they are done with it; a barrier's phase flips at each
// completion, so a waiter names the phase it waits for.
#pragma once

#include <cstdint>

namespace sdpa::cutlass_sm90 {

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

}  // namespace sdpa::cutlass_sm90
