// 2^x on the SFU alone, denormal results flushed to zero: the softmax's exponent, for every
// kernel that takes one per score. exp2f (without fast-math) adds a denormal-range fix-up to each
// call, a compare and two predicated multiplies; scores below 2^-126 of the row's max add nothing
// a 16-bit P or an f32 row sum can hold.
#pragma once

#include <cuda_runtime.h>

namespace sdpa {

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace sdpa
