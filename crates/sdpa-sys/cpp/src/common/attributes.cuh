// What `sdpa info` shows per kernel on the device (cudaFuncGetAttributes), shared by every
// backend: one entry per mask instantiation.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "common/check.cuh"
#include "sdpa/sdpa.h"

namespace sdpa {

// A kernel's attributes on the current device; false where the build has no code for the GPU
// (the sm_90a kernels on any other), which `sdpa info` then leaves out.
inline bool attributes_on_device(const void* kernel, cudaFuncAttributes& fa) {
  const cudaError_t e = cudaFuncGetAttributes(&fa, kernel);
  if (e == cudaErrorInvalidDeviceFunction || e == cudaErrorNoKernelImageForDevice) {
    (void)cudaGetLastError();  // not a sticky error: cleared, so the next call does not see it
    return false;
  }
  SDPA_CUDA_CHECK(e);
  return true;
}

// `kernels` = {non-causal, causal} or {non-causal, causal, band} (the general path of the
// kernels that have one: windows, top-left causal, softcap, ALiBi); `dynamic_smem` = bytes each
// launch requests (cudaFuncGetAttributes only knows static shared memory).
template <int N>
void push_attributes(std::vector<KernelAttr>& out, const char* backend, const char* dtype,
                     int head_dim, const void* const (&kernels)[N],
                     const int32_t (&dynamic_smem)[N]) {
  static_assert(N == 2 || N == 3);
  constexpr const char* kSuffix[3] = {"", "_causal", "_band"};
  for (int i = 0; i < N; ++i) {
    cudaFuncAttributes fa;
    if (!attributes_on_device(kernels[i], fa)) continue;
    out.push_back({backend,
                   std::string("fwd_") + dtype + "_d" + std::to_string(head_dim) + kSuffix[i],
                   fa.numRegs, int32_t(fa.sharedSizeBytes), dynamic_smem[i],
                   int32_t(fa.localSizeBytes), fa.maxThreadsPerBlock});
  }
}

// Kernels that all request the same dynamic shared memory.
template <int N>
void push_attributes(std::vector<KernelAttr>& out, const char* backend, const char* dtype,
                     int head_dim, const void* const (&kernels)[N], int32_t dynamic_smem) {
  int32_t smem[N];
  for (int i = 0; i < N; ++i) smem[i] = dynamic_smem;
  push_attributes(out, backend, dtype, head_dim, kernels, smem);
}

}  // namespace sdpa
