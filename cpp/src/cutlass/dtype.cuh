// Names of the CuTe element types, for the kernel reports of both CUTLASS backends.
#pragma once

#include <cutlass/numeric_types.h>

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

}  // namespace sdpa
