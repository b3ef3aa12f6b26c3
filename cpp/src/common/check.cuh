// Error checking shared by every backend: a failed CUDA call becomes an sdpa::Error carrying
// the CUDA error string and the call site, which cxx turns into a Rust Err.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "sdpa/sdpa.h"

namespace sdpa {

inline void check_cuda(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess) {
    throw Error(std::string(what) + " failed: " + cudaGetErrorName(e) + " (" +
                cudaGetErrorString(e) + ") at " + file + ":" + std::to_string(line));
  }
}

}  // namespace sdpa

#define SDPA_CUDA_CHECK(call) ::sdpa::check_cuda((call), #call, __FILE__, __LINE__)
// After a <<<>>> launch: reports bad launch configurations without synchronizing.
#define SDPA_LAUNCH_CHECK(name) ::sdpa::check_cuda(cudaGetLastError(), name, __FILE__, __LINE__)
