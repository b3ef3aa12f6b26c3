// Quantization to and from FP8 E4M3 with per-tensor or per-(batch, head) scales: the absmax
// reduction that picks the scales, the quantize pass (the GPU's own saturating, round-to-
// nearest-even conversion, which the host codec in crates/sdpa/src/fp8.rs matches bit for bit)
// and the dequantize pass the simulated FP8 path runs before an f16/bf16 kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common/check.cuh"
#include "fp8/codec.cuh"
#include "sdpa/sdpa.h"

namespace sdpa {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ int64_t group_of(int64_t i, const ScaleMap& m) {
  return (i / m.per_batch) * m.heads + (i / m.inner) % m.heads;
}

template <typename T>
__device__ __forceinline__ float load(const void* x, int64_t i);
template <>
__device__ __forceinline__ float load<float>(const void* x, int64_t i) {
  return static_cast<const float*>(x)[i];
}
template <>
__device__ __forceinline__ float load<__half>(const void* x, int64_t i) {
  return __half2float(static_cast<const __half*>(x)[i]);
}
template <>
__device__ __forceinline__ float load<__nv_bfloat16>(const void* x, int64_t i) {
  return __bfloat162float(static_cast<const __nv_bfloat16*>(x)[i]);
}

// Non-negative floats order like their bit patterns, so the max is an integer atomicMax.
// Lanes of a warp that share a group reduce among themselves first (one atomic per group).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    absmax_kernel(const void* __restrict__ x, int64_t n, ScaleMap map, unsigned* amax) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.x; base < n; base += stride) {
    const int64_t i = base + threadIdx.x;
    const bool valid = i < n;
    const float v = valid ? fabsf(load<T>(x, i)) : 0.f;
    const unsigned bits = isnan(v) ? 0u : __float_as_uint(v);  // NaN is not a magnitude
    const long long g = valid ? group_of(i, map) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, g);
    const unsigned m = __reduce_max_sync(peers, bits);
    if (valid && (threadIdx.x & 31) == __ffs(peers) - 1) atomicMax(amax + g, m);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const void* __restrict__ x, uint8_t* __restrict__ y, int64_t n, ScaleMap map,
                    const float* __restrict__ scale) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] =
        __nv_cvt_float_to_fp8(load<T>(x, i) / scale[group_of(i, map)], __NV_SATFINITE, __NV_E4M3);
}

using fp8::decode;
using fp8::from_float;

template <typename Out>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ x, Out* __restrict__ y, int64_t n, ScaleMap map,
                      const float* __restrict__ scale) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = from_float<Out>(decode(x[i]) * scale[group_of(i, map)]);
}

unsigned blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return unsigned(b < 2048 ? b : 2048);  // grid-stride beyond ~15 CTAs per SM
}

void check_map(const ScaleMap& m, const char* what) {
  if (m.heads < 1 || m.inner < 1 || m.per_batch < 1)
    throw Error(std::string(what) + ": scale map fields must be positive");
}

}  // namespace

void absmax(const void* x, bool x_is_f32, Dtype dtype, int64_t n, ScaleMap map, float* amax,
            int64_t groups, void* stream) {
  check_map(map, "absmax");
  if (n <= 0 || groups <= 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  auto* out = reinterpret_cast<unsigned*>(amax);
  if (x_is_f32)
    absmax_kernel<float><<<blocks_for(n), kThreads, 0, s>>>(x, n, map, out);
  else if (dtype == Dtype::F16)
    absmax_kernel<__half><<<blocks_for(n), kThreads, 0, s>>>(x, n, map, out);
  else if (dtype == Dtype::BF16)
    absmax_kernel<__nv_bfloat16><<<blocks_for(n), kThreads, 0, s>>>(x, n, map, out);
  else
    throw Error("absmax: input must be f32, f16 or bf16");
  SDPA_LAUNCH_CHECK("absmax launch");
}

void e4m3_quantize(const void* x, bool x_is_f32, Dtype dtype, uint8_t* y, int64_t n, ScaleMap map,
                   const float* scale, void* stream) {
  check_map(map, "e4m3 quantize");
  if (n <= 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  if (x_is_f32)
    quantize_kernel<float><<<blocks_for(n), kThreads, 0, s>>>(x, y, n, map, scale);
  else if (dtype == Dtype::F16)
    quantize_kernel<__half><<<blocks_for(n), kThreads, 0, s>>>(x, y, n, map, scale);
  else if (dtype == Dtype::BF16)
    quantize_kernel<__nv_bfloat16><<<blocks_for(n), kThreads, 0, s>>>(x, y, n, map, scale);
  else
    throw Error("e4m3 quantize: input must be f32, f16 or bf16");
  SDPA_LAUNCH_CHECK("e4m3 quantize launch");
}

void e4m3_dequantize(const uint8_t* x, void* y, Dtype out_dtype, int64_t n, ScaleMap map,
                     const float* scale, void* stream) {
  check_map(map, "e4m3 dequantize");
  if (n <= 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  if (out_dtype == Dtype::F16)
    dequantize_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, static_cast<__half*>(y), n, map, scale);
  else if (out_dtype == Dtype::BF16)
    dequantize_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, static_cast<__nv_bfloat16*>(y), n, map,
                                                         scale);
  else
    throw Error("e4m3 dequantize: output must be f16 or bf16");
  SDPA_LAUNCH_CHECK("e4m3 dequantize launch");
}

}  // namespace sdpa
