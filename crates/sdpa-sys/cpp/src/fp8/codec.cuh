// Device-side E4M3 decode and the rounding to the 16-bit output types, shared by the
// quantization passes (quant.cu) and the simulated path (simulated.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace sdpa::fp8 {

// The exact value of an E4M3 code (every one is an f16 value).
__device__ __forceinline__ float decode(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));
}

// f32 -> f16 / bf16, round to nearest even.
template <typename Out>
__device__ __forceinline__ Out from_float(float v);
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

}  // namespace sdpa::fp8
