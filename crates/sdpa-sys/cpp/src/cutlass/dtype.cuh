// The CuTe element types both CUTLASS backends instantiate: their names (kernel reports), their
// CUDA types and the packing of two f32 into one register of them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cutlass/numeric_types.h>

#include <cute/numeric/numeric_types.hpp>
#include <type_traits>

#include "common/dtype.cuh"

namespace sdpa {

template <>
constexpr const char* dtype_name<cute::half_t>() {
  return "f16";
}
template <>
constexpr const char* dtype_name<cute::bfloat16_t>() {
  return "bf16";
}

// The CUDA type of a CuTe element type (the scalar kernels' instantiation, which the backwards'
// shared launches take).
template <typename T>
using native_t = std::conditional_t<std::is_same_v<T, cute::half_t>, __half, __nv_bfloat16>;

// Two f32 -> one packed pair of T (low half = a), round to nearest.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<cute::half_t>(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<cute::bfloat16_t>(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

}  // namespace sdpa
