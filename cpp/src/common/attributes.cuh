// What `sdpa info` shows per kernel on the device (cudaFuncGetAttributes), shared by every
// backend: one entry for the non-causal and one for the causal instantiation.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "common/check.cuh"
#include "sdpa/sdpa.h"

namespace sdpa {

// `kernels` = {non-causal, causal}; `dynamic_smem` = bytes the launch requests (cudaFuncGet-
// Attributes only knows static shared memory).
inline void push_attributes(std::vector<KernelAttr>& out, const char* backend, const char* dtype,
                            int head_dim, const void* const (&kernels)[2], int32_t dynamic_smem) {
  for (int causal = 0; causal < 2; ++causal) {
    cudaFuncAttributes fa;
    SDPA_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernels[causal]));
    out.push_back(
        {backend,
         std::string("fwd_") + dtype + "_d" + std::to_string(head_dim) + (causal ? "_causal" : ""),
         fa.numRegs, int32_t(fa.sharedSizeBytes), dynamic_smem, int32_t(fa.localSizeBytes),
         fa.maxThreadsPerBlock});
  }
}

}  // namespace sdpa
