// 16-byte shared-memory load by 32-bit shared address, for the kernels that address shared
// memory themselves (cutlass sm_90a, wmma, cutlass sm_80). A volatile asm with a memory clobber:
// it stays after the barriers and cp.async waits before it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sdpa {

__device__ __forceinline__ uint4 ld_shared_128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

}  // namespace sdpa
