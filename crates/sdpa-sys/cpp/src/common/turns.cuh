// A counter in global memory that orders CTAs (the backward's ordered dQ accumulation): one
// thread waits until it reads `turn` (acquire) and, once its CTA's writes are done and the CTA
// has met at a barrier, passes the turn on (release). A release at gpu scope is cumulative: the
// writes of every thread the barrier ordered before it are visible to the CTA that acquires the
// turn, so no fence is needed besides. The CTAs a counter orders must be launched in turn order,
// so that a CTA only waits on CTAs launched before it.
#pragma once

#include <cuda_runtime.h>

namespace sdpa {

__device__ __forceinline__ void wait_for_turn(const int* counter, int turn) {
  int v;
  for (;;) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
    if (v == turn) break;
    __nanosleep(32);
  }
}

__device__ __forceinline__ void pass_the_turn(int* counter) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}

}  // namespace sdpa
